"""Dependencies point inward: every import in rlcore/ (function-local and TYPE_CHECKING ones too, and a lazy
import's table of module names) goes to its own layer or to a lower tier, and only the config checks and the
shell import `configs`. LAYERS is the one table of the layers; docs/architecture.md's layer table is checked
against it (`python tests/test_layers.py` prints the rows it must have)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "rlcore"

LAYERS: tuple[tuple[tuple[str, tuple[str, ...]], ...], ...] = (
    (("pure", ("rlcore.pure",)),),
    (("values", ("rlcore.batch", "rlcore.columns")),),
    (("dist", ("rlcore.dist",)), ("data", ("rlcore.data",))),
    (("models", ("rlcore.models",)),),
    (("rollout", ("rlcore.rollout",)),),
    (("rewards", ("rlcore.rewards",)),),
    (("agent", ("rlcore.rollout.agent",)),),
    (("run", ("rlcore.state", "rlcore.plan", "rlcore.algorithm")),),
    (("step", ("rlcore.step",)),),
    (("serving", ("rlcore.serving",)), ("config", ("rlcore.config",))),
    (("gateway", ("rlcore.gateway",)), ("tinker", ("rlcore.tinker",))),
    (("trainer", ("rlcore.trainer",)),),
)
"""Tiers, lowest first; each tier is (layer, its modules and packages) pairs. A module may import its own layer
and every layer of a lower tier, never a layer of its own tier or above. The package itself (`rlcore`, its
version) is no layer: it imports nothing of ours and anything may import it."""

CONFIGS = "configs"
CONFIG_READERS = ("config", "trainer")
"""The layers that may import `configs` (the schema): the checks beside it and the shell."""

TIER = {name: i for i, tier in enumerate(LAYERS) for name, _ in tier}
MODULE_NAME = re.compile(r"rlcore(?:\.\w+)+")
"""A string constant that is a dotted module path (a lazy import's table) counts as an import of it."""


def layer_of(module: str) -> str | None:
    """The layer holding `module` (longest listed prefix wins); CONFIGS for the schema; None for the package
    itself and anything outside ours."""
    if module == CONFIGS or module.startswith(CONFIGS + "."):
        return CONFIGS
    best = max((p for tier in LAYERS for _, prefixes in tier for p in prefixes
                if module == p or module.startswith(p + ".")), key=len, default=None)  # fmt: skip
    return next((name for tier in LAYERS for name, prefixes in tier if best in prefixes), None)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imports(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `source`, wherever it stands. `from x import y` names x.y
    when that is a module of ours, else x; relative imports are resolved against `module`."""
    found: list[tuple[int, str]] = []
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*here[: len(here) - node.level + 1], *([node.module] if node.module else [])]
                )
            found += [
                (node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names
            ]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_NAME.fullmatch(node.value)
        ):
            found += [(node.lineno, node.value)] if node.value in known else []
    return found


def problem(mine: str, theirs: str) -> str | None:
    """Why layer `mine` may not import layer `theirs` (None if it may)."""
    if theirs == CONFIGS:
        return (
            None
            if mine in CONFIG_READERS
            else f"layer {mine} imports configs: only {' and '.join(CONFIG_READERS)} read it"
        )
    if mine == theirs or TIER[theirs] < TIER[mine]:
        return None
    where = "a layer of its own tier" if TIER[theirs] == TIER[mine] else "a higher layer"
    return f"layer {mine} imports layer {theirs}, {where}"


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def violations(found: dict[str, Path] | None = None) -> list[str]:
    """`module -> imported (why)  file:line` for every import that does not point inward."""
    found = modules() if found is None else found
    out = []
    for module, path in found.items():
        mine = layer_of(module)
        if mine is None:
            continue
        for line, imported in imports(path.read_text(), module, path.name == "__init__.py", set(found)):
            theirs = layer_of(imported)
            why = None if theirs is None else problem(mine, theirs)
            if why:
                out.append(f"{module} -> {imported} ({why})  {shown(path)}:{line}")
    return sorted(set(out))


def may_import(name: str) -> list[str]:
    """The layers `name` may import, lowest first (and `configs` where it may)."""
    lower = [other for tier in LAYERS[: TIER[name]] for other, _ in tier]
    return lower + ([f"`{CONFIGS}`"] if name in CONFIG_READERS else [])


def layer_rows() -> list[tuple[str, str, str]]:
    """(layer, modules, may import) per layer, lowest first: the first three cells of the docs' table."""

    def where(prefix: str) -> str:
        path = prefix.replace(".", "/")
        return f"`{path}/`" if (ROOT / path).is_dir() else f"`{path}.py`"

    return [(name, ", ".join(where(p) for p in prefixes), ", ".join(may_import(name)) or "nothing of ours")
            for tier in LAYERS for name, prefixes in tier]  # fmt: skip


def doc_rows(text: str) -> list[tuple[str, str, str]]:
    """The first three cells of each row of the table under docs/architecture.md's `<!-- layers -->` mark."""
    lines = text.split("<!-- layers -->\n", 1)[1].split("\n\n", 1)[0].strip().splitlines()[2:]
    return [tuple(cell.strip() for cell in line.strip("|").split("|")[:3]) for line in lines]  # type: ignore[misc]


def test_every_module_has_a_layer():
    homeless = [m for m in modules() if m != PACKAGE and layer_of(m) is None]
    assert homeless == [], f"modules in no layer (add them to LAYERS in tests/test_layers.py): {homeless}"


def test_the_package_itself_imports_nothing_of_ours():
    path = ROOT / PACKAGE / "__init__.py"
    assert [m for _, m in imports(path.read_text(), PACKAGE, True, set(modules())) if layer_of(m)] == []


def test_the_schema_imports_nothing_of_ours():
    found = imports((ROOT / "configs.py").read_text(), CONFIGS, False, set(modules()))
    assert [m for _, m in found if layer_of(m) not in (None, CONFIGS)] == [], "configs.py imports from rlcore"


def test_imports_point_inward():
    found = violations()
    assert found == [], "imports that point up or sideways:\n" + "\n".join(found)


def test_the_check_catches_an_upward_a_sideways_and_a_configs_import(tmp_path):
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlcore.trainer import run\n"
        "def f():\n    from rlcore.pure import kl\n    import configs\n"
    )
    (tmp_path / "b.py").write_text("SERVED = {'x': 'rlcore.tinker.server'}\nfrom ..pure import kl\n")
    found = violations({"rlcore.step.a": tmp_path / "a.py", "rlcore.gateway.b": tmp_path / "b.py",
                        "rlcore.tinker.server": tmp_path / "b.py", "rlcore.trainer.run": tmp_path / "a.py"})  # fmt: skip
    lines = [f.split("  ")[0] for f in found]
    assert "rlcore.step.a -> rlcore.trainer.run (layer step imports layer trainer, a higher layer)" in lines
    assert "rlcore.step.a -> configs (layer step imports configs: only config and trainer read it)" in lines
    assert (
        "rlcore.gateway.b -> rlcore.tinker.server (layer gateway imports layer tinker, a layer of its own tier)"
        in lines
    )
    assert not any("rlcore.pure" in line for line in lines)


def test_the_docs_layer_table_is_this_table():
    rows = doc_rows((ROOT / "docs" / "architecture.md").read_text())
    assert rows == layer_rows(), (
        "docs/architecture.md's layer table differs: `python tests/test_layers.py` prints it"
    )


if __name__ == "__main__":
    for row in layer_rows():
        print(f"| {' | '.join(row)} | ... |")
    print("\n".join(violations()), file=sys.stderr)
