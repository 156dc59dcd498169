"""Geometry3K's reward, verl's rules for `hiyouga/geometry3k` (mathruler): 0.9 * correct + 0.1 * format.

verl scores `hiyouga/geometry3k` with `verl/utils/reward_score/geo3k.py`, built on mathruler:
- **correct** (1 / 0): the content of the last `\\boxed{` up to its balanced `}` (the text `None` when
  there is none or it never closes), graded against the truth by the PRM800K grader in mathruler's
  dialect (`prm800k.grade_answer`, `MATHRULER`);
- **format** (1 / 0): the whole response is `<think>...</think>...\\boxed{...}...` (newlines allowed).

So a correct, well-formed response scores 1.0, a correct one without the think block 0.9, a wrong
well-formed one 0.1. verl returns the sum alone; so does this.
"""

from __future__ import annotations

import re
from typing import Any

from rlcore.data.answers import closing_brace
from rlcore.rewards import prm800k

FORMAT_WEIGHT = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_BOX = "\\boxed{"


def boxed_content(text: str) -> str:
    """mathruler's `extract_boxed_content`: the stripped text after the last `\\boxed{` up to the `}` that
    closes it, else the string `"None"`."""
    start = text.rfind(_BOX)
    end = closing_brace(text, start) if start != -1 else None
    return "None" if end is None else text[start + len(_BOX) : end].strip()


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature Geometry3K reward (see the module docstring)."""
    correct = (
        1.0
        if prm800k.grade_answer(boxed_content(solution_str), str(ground_truth), prm800k.MATHRULER)
        else 0.0
    )
    well_formed = 1.0 if _FORMAT.fullmatch(solution_str) else 0.0
    return (1.0 - FORMAT_WEIGHT) * correct + FORMAT_WEIGHT * well_formed
