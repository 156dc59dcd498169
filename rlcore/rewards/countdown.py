"""Countdown in TinyZero's format: reach `target` with each of `numbers` once, using + - * / and brackets.

The ground truth is `{"target": int, "numbers": [int, ...]}`; the answer is the last
`<answer>...</answer>` of the response. Scores as TinyZero (verl `reward_score/countdown.py`):
no answer -> 0; an answer that does not use exactly the given numbers, does not evaluate, or
misses the target (|value - target| >= 1e-5) -> `format_score` (0.1); a hit -> 1.

Departures from TinyZero, both because rlcore passes the response alone (as verl does), not the
decoded prompt + response: no `Assistant:` marker is needed, and the answer may sit on any line.
The expression is evaluated exactly (fractions) by walking its syntax tree, never with `eval`, and
only + - * / (binary), unary minus and non-negative integer literals are accepted.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_answer(solution_str: str) -> str | None:
    """The stripped text of the last <answer>...</answer>, or None."""
    found = ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression; ValueError / ZeroDivisionError if it is not one."""
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an expression: {expression!r}") from e
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not allowed in a countdown answer: {ast.dump(node)[:60]}")


def score(
    solution_str: str, ground_truth: Any, *, format_score: float = 0.1, correct_score: float = 1.0
) -> float:
    """correct_score if the answer hits the target with each number once, format_score if not, 0 if none."""
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    used = sorted(
        n.lstrip("0") or "0" for n in re.findall(r"\d+", answer)
    )  # as text: no int() of 10^5 digits
    if used != sorted(str(int(n)) for n in numbers):
        return format_score
    try:
        value = evaluate(answer)
    except (ValueError, ZeroDivisionError, RecursionError):
        return format_score
    return correct_score if abs(value - Fraction(int(target))) < Fraction(1, 100_000) else format_score


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature Countdown reward (TinyZero's scores: 1 / 0.1 / 0)."""
    return score(solution_str, ground_truth)
