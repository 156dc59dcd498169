"""User-facing text says what is true now: no development or process talk (our tracker's issue numbers, a
fix's history, a session's turns, files that are not in the repository) in the docs, the examples, the
experiments' README, or the docstrings and comments of the library, the config and the trainer."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PHRASES = [
    (r"\bissues? #?\d+", "our tracker's issue number: say what is true now"),
    (r"(?<![\w/&])#\d{2,}\b", "our tracker's issue number: say what is true now"),
    (r"\bbefore (?:its|the) fix\b", "a fix's history: say what the code does now"),
    (r"\bin CI\b", "process talk: name the command that checks it"),
    (r"\bby hand\b", "process talk: say what was run, where and when"),
    (r"\bmissed so far\b", "history: say what is true now"),
    (r"\bseen once\b", "history: say what is true now"),
    (r"\b(?:this|last) session\b", "a development session: say what ran, where and when"),
    (r"(?<!the\s)\b(?:last|this|previous) turn\b", "a session's turn (an episode's is \"the last turn\")"),
    (r"\bturn \d+\b", "a development session's turn"),
    (r"\bGPU\.md\b", "a file that is not in the repository"),
]
"""(regex, reason). Case-insensitive; a space matches any run of whitespace, so a phrase wrapped across
lines is still found."""

CITED = {PHRASES[0][0], PHRASES[1][0]}
"""The issue-number patterns: a match whose word right before names another project ("verl #4535",
"vLLM issue 1234") cites that project's tracker and is allowed."""

NOT_A_PROJECT = frozenset(
    {"a", "after", "an", "and", "as", "at", "before", "by", "fixes", "for", "from", "in", "of", "on", "or", "our"}
    | {"per", "see", "since", "the", "this", "to", "with"}
)
"""Words that can stand right before our own issue number ("see #61", "from issue 61"): no project name."""

COMPILED = [(re.compile(p.replace(" ", r"\s+"), re.IGNORECASE), p, why) for p, why in PHRASES]


def scanned_files() -> list[Path]:
    """README.md, docs/*.md, every file in examples/, experiments/README.md, and the Python files whose
    docstrings and comments are read: configs.py, train.py, rlcore/**/*.py."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]
    files += sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return [*files, ROOT / "configs.py", ROOT / "train.py", *sorted((ROOT / "rlcore").rglob("*.py"))]


def docstrings(source: str) -> list[tuple[int, str]]:
    """(first line, source text) of each docstring: a string standing alone as a statement (a module's,
    class's or function's, and the one under an assignment that documents it)."""
    lines = source.splitlines()
    return [
        (node.lineno, "\n".join(lines[node.lineno - 1 : node.end_lineno]))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str)
    ]


def comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each block of comments on consecutive lines, without their `#` (a phrase wrapped
    across comment lines stays whole)."""
    blocks: list[tuple[int, list[str]]] = []
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if blocks and line == last + 1:
            blocks[-1][1].append(tok.string.lstrip("#"))
        else:
            blocks.append((line, [tok.string.lstrip("#")]))
        last = line
    return [(line, "\n".join(texts)) for line, texts in blocks]


def chunks(path: Path) -> list[tuple[int, str]]:
    """The user-facing text of `path` as (first line, text): a Python file's docstrings and comments, any
    other file whole."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        return [(1, text)]
    return docstrings(text) + comments(text)


def cites_a_project(text: str, start: int) -> bool:
    """Whether the word right before `start` (one space between) names a project: "verl #4535"."""
    m = re.search(r"([A-Za-z][\w.-]*)(?:'s)? $", text[max(0, start - 60) : start])
    return m is not None and m.group(1).lower() not in NOT_A_PROJECT


def hits(text: str) -> list[tuple[int, str, str]]:
    """(offset, matched text, pattern) of each banned phrase in `text`."""
    found = []
    for rx, pattern, _ in COMPILED:
        for m in rx.finditer(text):
            if pattern in CITED and cites_a_project(text, m.start()):
                continue
            found.append((m.start(), m.group(0), pattern))
    return found


def report(path: Path) -> list[str]:
    """`file:line: "phrase" (pattern)` for each banned phrase in the user-facing text of `path`."""
    out = []
    for first, text in chunks(path):
        for offset, phrase, pattern in hits(text):
            line = first + text.count("\n", 0, offset)
            out.append((line, f"{path.relative_to(ROOT)}:{line}: {' '.join(phrase.split())!r} ({pattern})"))
    return [message for _, message in sorted(out)]


def test_user_facing_text_has_no_process_talk():
    problems = [p for path in scanned_files() for p in report(path)]
    assert not problems, "development/process talk in user-facing text:\n" + "\n".join(problems)


EXAMPLES = {
    r"\bissues? #?\d+": ("measured on SmolLM2-135M (issue 61).", "verl issue 4535 has the same cause."),
    r"(?<![\w/&])#\d{2,}\b": ("the push got faster (see #62).", "as vLLM #1234 reports; owner/repo#12"),
    r"\bbefore (?:its|the) fix\b": ("the loss drifted before its\nfix", "the fix came before the test"),
    r"\bin CI\b": ("this runs in CI on every push", "in CIFAR-10 images"),
    r"\bby hand\b": ("checked by hand on a GPU", "a hand-written reward"),
    r"\bmissed so far\b": ("a case missed so far", "so far nothing was missed"),
    r"\bseen once\b": ("a hang seen once on 2 ranks", "each prompt is seen 4 times"),
    r"\b(?:this|last) session\b": ("measured this session", "a gateway session id"),
    r"(?<!the\s)\b(?:last|this|previous) turn\b": ("as noted last turn", "a tool call in the last turn"),
    r"\bturn \d+\b": ("fixed in turn 12", "a multi-turn rollout of 4 turns"),
    r"\bGPU\.md\b": ("see GPU.md for the checklist", "see docs/install.md"),
}
"""A sentence each pattern must catch and one it must let pass."""


def test_every_phrase_has_examples():
    assert set(EXAMPLES) == {p for p, _ in PHRASES}


@pytest.mark.parametrize("pattern", [p for p, _ in PHRASES])
def test_each_phrase_is_caught(pattern):
    caught, allowed = EXAMPLES[pattern]
    assert [h[2] for h in hits(caught)] == [pattern]
    assert not hits(allowed)
