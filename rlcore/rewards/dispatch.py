"""Which reward function scores a row: a plain dict from `data_source` to a verl-signature function.

| data_source                                                     | reward                              |
|-----------------------------------------------------------------|-------------------------------------|
| `openai/gsm8k`                                                  | `gsm8k` (strict `#### n`; 1 / 0)    |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`, `math` | `math_answer` (math-verify) |
| `countdown`                                                     | `countdown` (TinyZero; 1 / 0.1 / 0) |
| `builtin/<task>` for every task of `rlcore.data.tasks`          | `rlcore.data.tasks.compute_score`   |
| `builtin/calc` (multi-turn, `rlcore.data.agent_tasks`)          | `agent_tasks.compute_score`         |

`--reward.custom file.py:fn` replaces the table for every data_source, as verl's
`custom_reward_function` does. `resolve_reward_fn` runs at start-up, so an unknown data_source
fails before the first rollout, not at step 500.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlcore.data import agent_tasks, tasks
from rlcore.rewards import code, countdown, gsm8k, math_answer, sandbox
from rlcore.rewards.custom import FLAG, RewardFn, RewardSpecError, load_custom

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
CODE_SOURCES = ("code", "codecontests", "apps", "codeforces", "taco")  # verl's names for code data

REWARD_FNS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k.compute_score,
    **dict.fromkeys(MATH_SOURCES, math_answer.compute_score),
    "countdown": countdown.compute_score,
    **dict.fromkeys(CODE_SOURCES, code.compute_score),
    **{f"builtin/{name}": tasks.compute_score for name in tasks.TASKS},
    agent_tasks.DATA_SOURCE: agent_tasks.compute_score,
}
"""Built-in rewards by data_source; every entry has verl's `compute_score` signature."""


class UnknownDataSourceError(RewardSpecError):
    """A data_source with no reward function and no `--reward.custom`."""


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float | dict:
    """Score one response with the built-in reward of its data_source."""
    if data_source not in REWARD_FNS:
        raise unknown_sources_error([data_source])
    fn = REWARD_FNS[data_source]
    return fn(
        data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
    )


def unknown_sources_error(unknown: Iterable[str]) -> UnknownDataSourceError:
    """The one-line error for data_sources that no built-in reward knows."""
    names = ", ".join(repr(s) for s in sorted(set(unknown)))
    return UnknownDataSourceError(
        f"no reward function for data_source {names} (built-in: {', '.join(sorted(REWARD_FNS))}); "
        f"pass {FLAG} path/to/file.py:compute_score to score it with your own function"
    )


def resolve_reward_fn(data_sources: Iterable[str], custom: str | None = None) -> RewardFn:
    """The reward function for a run: the custom one if given, else the built-in table after checking
    that every data_source in `data_sources` has an entry (and that math-verify is there if needed)."""
    if custom is not None:
        return load_custom(custom)
    sources = set(data_sources)
    unknown = sources - REWARD_FNS.keys()
    if unknown:
        raise unknown_sources_error(unknown)
    if sources & set(CODE_SOURCES) and not sandbox.sandbox_available():
        raise RewardSpecError(
            f"data_source {sorted(sources & set(CODE_SOURCES))} runs code, but the sandbox is unavailable: "
            "apt-get install -y bubblewrap (and allow user namespaces)"
        )
    if sources & set(MATH_SOURCES):
        try:
            math_answer.require_math_verify()
        except ImportError as e:
            raise RewardSpecError(f"data_source {sorted(sources & set(MATH_SOURCES))}: {e}") from None
    return default_compute_score
