"""The reward both trainers use in experiments/vs_trl: a verl-style `compute_score` file, plus a TRL wrapper.

rlcore loads it with `--reward.custom experiments/vs_trl/reward.py:compute_score`; TRL's GRPOTrainer gets
`trl_reward`, which unpacks TRL's arguments (completions as chat messages, the dataset's other columns as
lists) and calls the same `compute_score`. The reverse task is scored here with no rlcore import, so the
TRL venv needs nothing of rlcore for it. The score is that of rlcore's built-in `reverse` task: the fraction of positions where
the stripped answer matches the reversed digits, over the longer of the two strings. Rows of a
`reasoning_gym/<task>` source (the real-model mode) are scored by rlcore.data.reasoning_gym: the answer
extracted per the row's format, then reasoning-gym's own `score_answer`. That import needs rlcore's
checkout on the path (added below) and, in the TRL venv, reasoning-gym and orjson (setup.sh installs them).
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[2])
"""rlcore's checkout, imported for reasoning_gym rows."""


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """verl signature: positional credit of `solution_str` (stripped) against `ground_truth`, in [0, 1]."""
    if data_source.startswith("reasoning_gym/"):
        if CHECKOUT not in sys.path:
            sys.path.insert(0, CHECKOUT)
        from rlcore.data.reasoning_gym import compute_score as reasoning_gym_score

        return reasoning_gym_score(data_source, solution_str, ground_truth, extra_info)
    if data_source != "builtin/reverse":
        raise ValueError(
            f"this reward scores 'builtin/reverse' and 'reasoning_gym/<task>', got {data_source!r}"
        )
    answer = solution_str.strip()
    if not answer or not ground_truth:
        return float(answer == ground_truth)
    hits = sum(a == b for a, b in zip(answer, ground_truth, strict=False))
    return hits / max(len(answer), len(ground_truth))


def _text(completion) -> str:
    """A TRL completion: a list of chat messages (conversational prompts) or a plain string."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def trl_reward(completions, data_source, reward_model, extra_info=None, **_) -> list[float]:
    """TRL reward function: one float per completion; the verl row's columns arrive as per-sample lists."""
    extra = extra_info if extra_info is not None else [None] * len(completions)
    return [
        compute_score(source, _text(completion), model["ground_truth"], info)
        for completion, source, model, info in zip(completions, data_source, reward_model, extra, strict=True)
    ]
