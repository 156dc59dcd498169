"""Built-in tasks (`builtin:<task>` for `--data.train-files` / `--data.val-files`).

Each task generates verl-format rows deterministically from a seed, with no download, and scores a
response with a rule reward of verl's signature (`compute_score`). Train and validation never share
a problem: a problem belongs to the validation split iff crc32 of its text is 0 mod 10.

| task      | prompt (user message)          | answer         | reward                                      |
|-----------|--------------------------------|----------------|---------------------------------------------|
| reverse   | `reverse 40213`                | `31204`        | fraction of positions right (partial credit)|
| sort      | `sort 40213`                   | `01234`        | fraction of positions right (partial credit)|
| add       | `37+45`                        | `82`           | 1 if exact, else 0                          |
| countdown | `make 29 from 3 7 8`           | `(3*7)+8`      | 1 if it uses each number once and hits the target, 0.1 if a well-formed expression, else 0 |
"""

from __future__ import annotations

import ast
import operator
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

SPLITS = ("train", "val")


@dataclass(frozen=True, kw_only=True)
class Task:
    """A generated task: how to make one problem and how to score an answer to it."""

    name: str
    """The task's name; rows carry `data_source = "builtin/<name>"`."""
    make: Callable[[random.Random], tuple[str, str]]
    """Draws one (prompt text, ground truth) from the given RNG."""
    score: Callable[[str, str], float]
    """Scores a stripped response against the ground truth, in [0, 1]."""


def positional_credit(answer: str, truth: str) -> float:
    """Fraction of positions where the answer matches, over the longer of the two strings."""
    if not answer or not truth:
        return float(answer == truth)
    hits = sum(a == b for a, b in zip(answer, truth, strict=False))
    return hits / max(len(answer), len(truth))


def exact(answer: str, truth: str) -> float:
    return float(answer == truth)


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))


def _make_reverse(rng: random.Random) -> tuple[str, str]:
    s = _digits(rng)
    return f"reverse {s}", s[::-1]


def _make_sort(rng: random.Random) -> tuple[str, str]:
    s = _digits(rng)
    return f"sort {s}", "".join(sorted(s))


def _make_add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}", str(a + b)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an expression of integers, + - * / and brackets; raises ValueError otherwise."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError("not an arithmetic expression")


def _make_countdown(rng: random.Random) -> tuple[str, str]:
    while True:
        nums = [rng.randint(1, 12) for _ in range(3)]
        a, b, c = rng.sample(nums, 3)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"({a}{op1}{b}){op2}{c}"
        target = _evaluate(ast.parse(expr, mode="eval"), [])
        if target.denominator == 1 and 0 < target <= 200:
            return f"make {int(target)} from {' '.join(map(str, sorted(nums)))}", f"{int(target)}|{expr}"


def _score_countdown(answer: str, truth: str) -> float:
    target_text, reference = truth.split("|", 1)
    numbers = sorted(_numbers_of(reference))
    try:
        used: list[int] = []
        value = _evaluate(ast.parse(answer, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    return 1.0 if sorted(used) == numbers and value == int(target_text) else 0.1


def _numbers_of(expr: str) -> list[int]:
    used: list[int] = []
    _evaluate(ast.parse(expr, mode="eval"), used)
    return used


TASKS: dict[str, Task] = {
    "reverse": Task(name="reverse", make=_make_reverse, score=positional_credit),
    "sort": Task(name="sort", make=_make_sort, score=positional_credit),
    "add": Task(name="add", make=_make_add, score=exact),
    "countdown": Task(name="countdown", make=_make_countdown, score=_score_countdown),
}

DEFAULT_TASK = "reverse"


def split_of(prompt: str) -> str:
    """The split a problem belongs to, fixed by its text: 'val' iff crc32(prompt) % 10 == 0."""
    return "val" if zlib.crc32(prompt.encode()) % 10 == 0 else "train"


def draw_rows(
    name: str, split: str, n: int, seed: int, draw: Callable[[random.Random], tuple[str, dict]]
) -> list[dict]:
    """`n` rows for `split` from `draw(rng)` = (the problem's text, which fixes its split, a row maker's
    row), the rng seeded by (name, split, seed); each row gets its `extra_info` split and index."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'val'")
    rng, rows = random.Random(f"{name}/{split}/{seed}"), []
    for _ in range(100 * n + 1000):
        if len(rows) == n:
            break
        text, row = draw(rng)
        if split_of(text) == split:
            row["extra_info"] = {"split": split, "index": len(rows), **row.get("extra_info", {})}
            rows.append(row)
    if len(rows) < n:
        raise ValueError(f"built-in task {name!r} could not draw {n} {split} rows; ask for fewer")
    return rows


def generate_rows(task: str, split: str, n: int, *, seed: int = 0) -> list[dict]:
    """`n` verl-format rows of `task` for `split`, the same for the same (task, split, n, seed)."""
    if task not in TASKS:
        raise ValueError(f"unknown built-in task {task!r}; choose one of {sorted(TASKS)}")

    def draw(rng: random.Random) -> tuple[str, dict]:
        prompt, truth = TASKS[task].make(rng)
        return prompt, _row(task, prompt, truth)

    return draw_rows(task, split, n, seed, draw)


def _row(task: str, prompt: str, truth: str) -> dict:
    return {
        "data_source": f"builtin/{task}",
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "builtin",
        "reward_model": {"style": "rule", "ground_truth": truth},
    }


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """verl-signature reward of the built-in tasks: dispatch on `builtin/<task>`."""
    task = data_source.removeprefix("builtin/")
    if task not in TASKS:
        raise ValueError(f"no built-in reward for data_source {data_source!r}")
    return TASKS[task].score(solution_str.strip(), ground_truth)
