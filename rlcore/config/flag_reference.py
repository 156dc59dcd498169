"""The reference of every `python train.py` flag (docs/flags.md), rendered from configs.py's dataclasses.

    python -m rlcore.config.flag_reference > docs/flags.md

One table per config section: each flag's type, default, help text (its field's docstring) and the
presets that set another value. tests/test_flag_reference.py checks that the page is current.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping

from configs import PRESETS, Config

COMMAND = "python -m rlcore.config.flag_reference > docs/flags.md"
"""The command that writes docs/flags.md."""
INTRO = (
    "Every flag of `python train.py`, generated from the dataclasses in `configs.py`: one table per section, "
    "in the order `configs.py` declares them, each flag with its type, its default, its help text and the "
    "presets that set another value. `python train.py <preset> --help` prints the same flags and help "
    f"text, with that preset's values as the defaults. Regenerate this page with `{COMMAND}`."
)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), joined onto one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = typing.cast(ast.ClassDef, tree.body[0]).body
    return {
        node.target.id: " ".join(str(doc.value.value).split())
        for node, doc in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    }  # fmt: skip


def type_text(kind: object) -> str:
    """A type as a reader writes it: `native | vllm`, `tuple[str, ...]`, `int | None`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is tuple:
        return "tuple[" + ", ".join("..." if a is Ellipsis else type_text(a) for a in args) + "]"
    if kind is type(None):
        return "None"
    return getattr(kind, "__name__", str(kind))


def value_text(value: object) -> str:
    """A value as it is typed after its flag (a tuple: its items, space-separated; `""`, `()`: empty)."""
    if isinstance(value, tuple):
        return " ".join(value_text(v) for v in value) if value else "()"
    if isinstance(value, str):
        return value or '""'
    return repr(value)


def cell(text: str) -> str:
    """`text` safe in a Markdown table cell: pipes escaped, and `<` outside code spans as an entity (not
    read as HTML)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def flag_names(path: tuple[str, ...], kind: object) -> list[str]:
    """The flags of one field as tyro spells them (a bool also has its --x.no-y)."""
    *head, name = [p.replace("_", "-") for p in path]
    flags = ["--" + ".".join([*head, name])]
    if kind is bool:
        flags.append("--" + ".".join([*head, f"no-{name}"]))
    return flags


@dataclasses.dataclass(frozen=True)
class FlagRow:
    path: tuple[str, ...]
    kind: object
    doc: str


def rows(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[FlagRow]:
    """Every leaf field of `cls`, nested dataclasses flattened, in declaration order."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from rows(typing.cast(type, kind), (*prefix, f.name))
        else:
            yield FlagRow((*prefix, f.name), kind, docs.get(f.name, ""))


def value_at(config: object, path: tuple[str, ...]) -> object:
    return functools.reduce(getattr, path, config)


def presets_text(path: tuple[str, ...], default: object, presets: Mapping[str, object]) -> str:
    """`preset=value` for each preset whose value of the field at `path` is not the default."""
    changed = [(name, value_at(cfg, path)) for name, cfg in presets.items()]
    return ", ".join(f"`{name}={value_text(v)}`" for name, v in changed if v != default)


def table(section: list[FlagRow], default: object, presets: Mapping[str, object]) -> list[str]:
    lines = ["| flag | type | default | what it does | presets |", "|---|---|---|---|---|"]
    for row in section:
        value = value_at(default, row.path)
        flags = " ".join(f"`{f}`" for f in flag_names(row.path, row.kind))
        cells = [flags, f"`{type_text(row.kind)}`", f"`{value_text(value)}`", row.doc,
                 presets_text(row.path, value, presets)]  # fmt: skip
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return lines


def sections(config_cls: type) -> dict[str, list[FlagRow]]:
    """The rows by section: the top-level flags first (as --help lists them), then each section's."""
    grouped: dict[str, list[FlagRow]] = {"top level": []}
    for row in rows(config_cls):
        key = row.path[0] if len(row.path) > 1 else "top level"
        grouped.setdefault(key, []).append(row)
    return {key: section for key, section in grouped.items() if section}


def render(config_cls: type = Config, presets: Mapping[str, object] | None = None) -> str:
    """The Markdown reference of every flag of `config_cls`; `presets` (name: config) default to configs.py's."""
    presets = {name: cfg for name, (_, cfg) in PRESETS.items()} if presets is None else presets
    default = config_cls()
    out = ["# Flags", "", INTRO, ""]
    for name, section in sections(config_cls).items():
        title = name if name == "top level" else f"`--{name.replace('_', '-')}.*`"
        out += [f"## {title}", "", *table(section, default, presets), ""]
    return "\n".join(out)


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
