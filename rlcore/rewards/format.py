"""Format rewards: does the response follow a required layout (e.g. `<think>...</think><answer>...</answer>`)?

    format_score("<think>2+2</think> <answer>4</answer>")          # 1.0
    compute_score = with_format_reward(math_answer.compute_score, weight=0.1)   # in a custom reward file

`with_format_reward` returns a verl-signature function whose dict carries `score` (the answer
score plus `weight` times the format score) and the parts, logged as `reward/acc` and
`reward/format`.
"""

from __future__ import annotations

import re
from typing import Any

from rlcore.rewards.custom import RewardFn

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"
"""DeepSeek-R1's layout: reasoning in <think>, then the final answer in <answer>, nothing else."""


def format_score(solution_str: str, *, pattern: str = THINK_ANSWER) -> float:
    """1.0 if the whole stripped response matches `pattern` (dot matches newlines), else 0.0."""
    return 1.0 if re.fullmatch(pattern, solution_str.strip(), flags=re.DOTALL) else 0.0


def with_format_reward(fn: RewardFn, *, weight: float = 0.1, pattern: str = THINK_ANSWER) -> RewardFn:
    """A verl-signature reward: `score = fn(...) + weight * format_score(...)`, parts as extras."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
        result = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
        acc = float(result["score"] if isinstance(result, dict) else result)
        fmt = format_score(solution_str, pattern=pattern)
        return {"score": acc + weight * fmt, "acc": acc, "format": fmt}

    return compute_score
