"""One value per measured figure. Each figure in QUANTITIES has a home page that states it with its run's
date and CPU; any other page (README.md, docs/*.md, examples/README.md, the --help text of configs.py)
that quotes it must quote the same value, and is better off linking to the home page instead."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
import typing
from pathlib import Path
from typing import NamedTuple

import configs

ROOT = Path(__file__).resolve().parents[1]


class Quantity(NamedTuple):
    name: str
    home: str
    """The page that states the figure, relative to the repository root."""
    pattern: str
    """A regex with one capture group, the value, over the flattened text (see `flatten`)."""


DEFAULT_ROW = r"^[^|\n]*\bdefault\b[^\n]*?\| "
"""A flattened table row whose first cell says `default`, up to the column that follows."""

QUANTITIES = [
    # the default run (python train.py)
    Quantity(
        "the default run's greedy validation before the first step",
        "README.md",
        r"(?:greedy validation (?=0\.\d+ ->)|greedy reward |step 0/30 \| val )(0\.\d+)",
    ),
    Quantity(
        "the default run's greedy validation after step 30",
        "README.md",
        r"(?:greedy validation 0\.\d+ -> |and ends at |step 30/30 \|[^\n]*?\| val |train\.py's default run: )(0\.\d+)",
    ),
    Quantity(
        "the default run's wall time",
        "README.md",
        r"(?:the run: |in |no downloads, )about (\d+) s\b",
    ),
    # rlcore against other trainers and engines
    Quantity(
        "rlcore's steps per second against TRL's GRPOTrainer on the default task",
        "docs/benchmarks.md",
        r"([\d.]+)x TRL(?: 1\.16)?'s (?:`GRPOTrainer` )?steps per second(?!\** on long-tailed)",
    ),
    Quantity(
        "rlcore's steps per second against TRL's GRPOTrainer on long-tailed responses",
        "docs/benchmarks.md",
        r"([\d.]+)x(?: TRL's steps per second\**)? on long-tailed responses",
    ),
    Quantity(
        "the native engine's speed against transformers' generate",
        "docs/benchmarks.md",
        r"native engine ([\d.]+)x `transformers` `generate`",
    ),
    Quantity(
        "the Tinker loop's step time against train.py's on SmolLM2-135M",
        "docs/benchmarks.md",
        r"([\d.]+)x `?train\.py`?'s (?:time per step )?on SmolLM2-135M",
    ),
    Quantity(
        "the Tinker loop's step time against train.py's on the 0.4M toy",
        "docs/benchmarks.md",
        r"([\d.]+(?:-[\d.]+)?)x on (?:this|the) 0\.4M(?:-parameter)? toy",
    ),
    Quantity(
        "rlcore.pure against verl's core_algos in float64",
        "docs/benchmarks.md",
        r"agree (?:to )?\(?(?:≤|<=) ([\d.]+e-\d+)",
    ),
    Quantity(
        "steps for every preset to reach 0.9 on reverse",
        "docs/benchmarks.md",
        r"0\.9 (?:greedy validation )?on `?reverse`? in ([\d-]+) steps",
    ),
    Quantity(
        "the split placement's steps/s against one colocated process",
        "docs/benchmarks.md",
        r"([\d.]+)x the steps/s and [\d.]+x the tokens/s",
    ),
    # bf16 compute, LoRA
    Quantity(
        "--model.compute-dtype bfloat16's update speed on builtin:small",
        "docs/benchmarks.md",
        r"([\d.]+)x (?:faster (?:updates )?on `?builtin:small|at 256 wide)",
    ),
    Quantity(
        "--model.compute-dtype bfloat16's update speed on tiny-reverse",
        "docs/benchmarks.md",
        r"([\d.]+)x (?:\(slower\) )?on the 0\.4M(?:-parameter)? (?:`?tiny-reverse|model)",
    ),
    Quantity(
        "LoRA's update speed against full fine-tuning on a 31.5M Llama",
        "docs/benchmarks.md",
        r"(?:LoRA|optimizer state)[^.]{0,200}?the update (?:is )?([\d.]+)x faster",
    ),
    Quantity(
        "LoRA's optimizer state against full fine-tuning's",
        "docs/benchmarks.md",
        r"optimizer state and (?:the )?checkpoint (?:are )?([\d.]+)x smaller",
    ),
    # memory: SmolLM2-135M GRPO 8 x 8
    Quantity(
        "SmolLM2-135M GRPO 8 x 8: the default's peak MiB",
        "docs/memory.md",
        DEFAULT_ROW + r"(?:update |tree )?peak MiB ([\d,]+(?:-[\d,]+)?)",
    ),
    Quantity(
        "SmolLM2-135M GRPO 8 x 8: the default's peak against the optimizer floor",
        "docs/memory.md",
        rf"(?:{DEFAULT_ROW}(?:peak / floor|x floor) |peaks at )(\d\.\d+(?:-\d\.\d+)?)(?=x its optimizer| \||$)",
    ),
    Quantity(
        "SmolLM2-135M GRPO 8 x 8: the default's step seconds",
        "docs/memory.md",
        DEFAULT_ROW + r"step s ([\d.]+(?:-[\d.]+)?)",
    ),
    Quantity(
        "full activation checkpointing's extra time",
        "docs/memory.md",
        r"activation-checkpointing`?[^.|]{0,80}?(?:~|about )?(\d+)% slower",
    ),
    Quantity(
        "selective checkpointing's extra forward and backward time",
        "docs/memory.md",
        r"selective[^.]{0,400}?forward and backward (?:about )?(\d+)% slower",
    ),
    Quantity(
        "selective checkpointing's step time at the default budget",
        "docs/memory.md",
        r"(?:selective-checkpointing`?[^.|]{0,40}?|SmolLM2 GRPO: steps )(the same speed|\d+% faster)",
    ),
    Quantity(
        "selective checkpointing's peak at the default budget",
        "docs/memory.md",
        r"the peak (\d+)% higher",
    ),
    Quantity(
        "selective checkpointing's peak at the default's micro-batch tokens",
        "docs/memory.md",
        r"lowers the peak \(?(?:by )?(\d+)%",
    ),
    Quantity(
        "selective checkpointing's values kept per token and layer",
        "docs/memory.md",
        r"(?:selective-checkpointing`? \| kept for backward per token and layer |SmolLM2-135M: )"
        r"([\d,]+)(?: against [\d,]+)? values",
    ),
    Quantity(
        "the default budget's tokens under selective checkpointing",
        "docs/memory.md",
        r"holds ([\d.]+)x the tokens",
    ),
    Quantity(
        "--trainer.freed-memory trim's extra step time",
        "docs/memory.md",
        r"\btrim\b[^;|]{0,150}?(\d+(?:-\d+)?)% slower steps",
    ),
    Quantity(
        "--trainer.freed-memory unmap's extra step time",
        "docs/memory.md",
        r"\bunmap\b[^;|]{0,150}?(\d+(?:-\d+)?)% slower steps",
    ),
    Quantity(
        "--trainer.freed-memory unmap's update peak below keep's",
        "docs/memory.md",
        r"(\d+)% below keep's",
    ),
    Quantity(
        "LoRA's rollout without the merged copy",
        "docs/memory.md",
        r"(?:a|the) rollout ~?(\d+(?:-\d+)?)% (?:slower|faster)",
    ),
    Quantity(
        "a Qwen2.5-0.5B-shaped model's peak against its floor",
        "docs/memory.md",
        r"([\d.]+)x (?:its [\d,]+ MiB floor|its floor)",
    ),
    Quantity(
        "a Qwen2.5-0.5B-shaped model's step time",
        "docs/memory.md",
        r"Qwen2\.5-0\.5B-shaped.{0,200}?(\d+) s a step",
    ),
    Quantity(
        "a Qwen2.5-1.5B-shaped LoRA model's peak",
        "docs/memory.md",
        r"1\.5B-shaped.{0,80}?([\d.]+) GiB",
    ),
    Quantity(
        "bf16 products on a CPU without bf16 instructions",
        "docs/memory.md",
        r"about (\d+)x slower than fp32",
    ),
]


class Text(NamedTuple):
    """A page flattened for matching: each paragraph on one line, each table row on its own line with every
    cell after the first prefixed by its column's header; `lines[i]` is the source line of `text[i]`."""

    text: str
    lines: list[int]


TABLE_CELL = re.compile(r"(?<!\\)\|")


def flatten(source: str, first_line: int = 1) -> Text:
    pieces: list[str] = []
    lines: list[int] = []
    header: list[str] | None = None
    for n, line in enumerate(source.splitlines(), first_line):
        row = line.strip()
        if row.startswith("|"):
            cells = [c.strip() for c in TABLE_CELL.split(row.strip("|"))]
            if header is None:
                header, piece = cells, " | ".join(cells)
            elif set(row) <= set("|-: "):
                piece = ""
            else:
                named = (f"{h} {c}".strip() for h, c in zip(header[1:], cells[1:], strict=False))
                piece = " | ".join([cells[0], *named])
            if pieces and not pieces[-1].endswith("\n"):
                piece = "\n" + piece
            piece += "\n"
        else:
            header = None
            piece = re.sub(r"\s+", " ", row) + (" " if row else "\n")
        pieces.append(piece)
        lines += [n] * len(piece)
    return Text("".join(pieces), lines)


def help_texts() -> Text:
    """The field docstrings of configs.py (the --help text), each after its flag, at their source lines."""
    hints = typing.get_type_hints(configs.Config)
    sections = {getattr(hints[f.name], "__name__", ""): f.name for f in dataclasses.fields(configs.Config)}
    tree = ast.parse(Path(configs.__file__).read_text())
    text, lines = "", []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for field, doc in itertools.pairwise(cls.body):
            if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
                continue
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)):
                continue
            name = field.target.id.replace("_", "-")
            flag = f"--{sections[cls.name]}.{name}" if cls.name in sections else f"{cls.name}.{name}"
            page = flatten(f"`{flag}`: {doc.value.value}\n\n", doc.lineno)
            text, lines = text + page.text, lines + page.lines
    return Text(text, lines)


def pages() -> dict[str, Text]:
    """README.md, docs/*.md, examples/README.md and configs.py's --help text, by their path."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
    found = {str(p.relative_to(ROOT)): flatten(p.read_text()) for p in paths}
    return found | {"configs.py": help_texts()}


def quotes(quantity: Quantity, texts: dict[str, Text]) -> list[tuple[str, str]]:
    """(value, file:line) of every place that quotes `quantity`; the value without thousands separators."""
    found = []
    for path, page in texts.items():
        for m in re.finditer(quantity.pattern, page.text, re.MULTILINE):
            value = " ".join(re.sub(r",(?=\d{3})", "", m.group(1)).replace("–", "-").split())
            found.append((value, f"{path}:{page.lines[m.start(1)]}"))
    return found


def conflicts(texts: dict[str, Text]) -> list[str]:
    """One line per quantity quoted with more than one value: each value at its first place."""
    bad = []
    for q in QUANTITIES:
        first: dict[str, str] = {}
        for value, place in sorted(quotes(q, texts), key=lambda vp: not vp[1].startswith(q.home + ":")):
            first.setdefault(value, place)
        if len(first) > 1:
            where = "; ".join(f"{value} at {place}" for value, place in first.items())
            bad.append(f"{q.name} (home: {q.home}): {where}")
    return bad


def test_each_figure_is_quoted_with_one_value():
    bad = conflicts(pages())
    assert not bad, "figures quoted with different values (keep the home page's, link to it elsewhere):\n" + (
        "\n".join(bad)
    )


def test_each_figure_is_on_its_home_page():
    texts = pages()
    assert len({q.name for q in QUANTITIES}) == len(QUANTITIES)
    assert all(re.compile(q.pattern).groups == 1 for q in QUANTITIES), "each pattern needs exactly one group"
    missing = [
        f"{q.name}: not on {q.home}"
        for q in QUANTITIES
        if q.home not in texts or not quotes(q, {q.home: texts[q.home]})
    ]
    assert not missing, "figures whose home page does not state them:\n" + "\n".join(missing)


def test_the_check_catches_a_planted_conflict():
    home = (
        "| variant | micro-batch tokens | peak MiB | step s |\n|---|---|---|---|\n"
        "| default | 1,058 | 4,533-4,554 | 40.2-42.3 |\n"
    )
    other = "Its peak:\n\n| | peak MiB | step s |\n|---|---|---|\n| `keep` (default) | 4571 | 42.1 |\n"
    same = "| | step s | peak MiB |\n|---|---|---|\n| default (2 GiB) | 40.2-42.3 | 4533-4554 |\n"
    assert conflicts({"docs/memory.md": flatten(home), "docs/b.md": flatten(same)}) == []
    bad = conflicts({"docs/memory.md": flatten(home), "docs/b.md": flatten(other)})
    assert bad == [
        "SmolLM2-135M GRPO 8 x 8: the default's peak MiB (home: docs/memory.md): "
        "4533-4554 at docs/memory.md:3; 4571 at docs/b.md:5",
        "SmolLM2-135M GRPO 8 x 8: the default's step seconds (home: docs/memory.md): "
        "40.2-42.3 at docs/memory.md:3; 42.1 at docs/b.md:5",
    ]
    wrapped = "`--model.selective-checkpointing` (the\nsame speed)"
    bad = conflicts({"a.md": flatten(wrapped), "b.py": flatten("(SmolLM2 GRPO: steps 8% faster)", 40)})
    assert bad == [
        "selective checkpointing's step time at the default budget (home: docs/memory.md): "
        "the same speed at a.md:1; 8% faster at b.py:40"
    ]
