"""GSM8K answers: verl's strict (`#### 72`) and flexible (last number) extraction.

Semantics follow verl `verl/utils/reward_score/gsm8k.py`: only the last 300 characters of the
response are searched; strict takes the last `#### <number>` and drops `,` and `$`; flexible takes
the last run of digits, dots and commas that is not `""` or `"."` (kept as written, commas and a
trailing dot included, as verl does). The extracted string is compared to the ground truth as a
string: equal -> `correct_score` (1), extracted but different -> `format_score` (0 by default),
nothing extracted -> 0.
Reference: Trung et al., "ReFT: Reasoning with Reinforced Fine-Tuning", ACL 2024.
"""

from __future__ import annotations

import re
from typing import Any, Literal

CLIP_CHARS = 300
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER = re.compile(r"(\-?[0-9\.\,]+)")

Method = Literal["strict", "flexible"]


def extract_answer(solution_str: str, *, method: Method = "strict") -> str | None:
    """The answer string found in the response's last 300 characters, or None."""
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        return next((n for n in reversed(NUMBER.findall(tail)) if n not in ("", ".")), None)
    raise ValueError(f"gsm8k method={method!r}: expected 'strict' or 'flexible'")


def score(
    solution_str: str,
    ground_truth: Any,
    *,
    method: Method = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """correct_score if the extracted answer equals the ground truth, format_score if only extracted, else 0."""
    answer = extract_answer(solution_str, method=method)
    if answer is None:
        return 0.0
    return correct_score if answer == str(ground_truth) else format_score


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature GSM8K reward (strict extraction, format score 0, as verl's default)."""
    return score(solution_str, ground_truth)
