"""Which reward function scores a row: plain dicts from `data_source` (or its prefix) to a verl-signature function.

Every data_source that verl's `default_compute_score` scores without a server, with verl's rules
(`--reward.math-verifier verl`, the default, so a verl recipe's curves are comparable):

| data_source                                                     | reward                              |
|-----------------------------------------------------------------|-------------------------------------|
| `openai/gsm8k`                                                  | `gsm8k`: strict `#### n`; 1 / 0     |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500` | `math_reward`: last `\\boxed{}`, Hendrycks normalisation; 1 / 0 |
| `math_dapo`, `math`, `math_dapo_reasoning`, `aime*` (any prefix `aime`) | `math_dapo`: last `Answer:` line, Minerva normalisation; 1 / -1, `acc` |
| `numina_aops_forum`, `_synthetic_math`, `_amc_aime`, `_synthetic_amc`, `_cn_k12`, `_olympiads` | `prime_math`: answer after `answer:` / last box / last `=`, PRM800K grader + PRIME's numeric rules; 1 / 0 |
| `hiyouga/geometry3k`                                            | `geo3k`: last `\\boxed{}`, PRM800K grader (mathruler); 0.9 correct + 0.1 `<think>` format |
| `searchR1_nq`, `_triviaqa`, `_popqa`, `_hotpotqa`, `_2wikimultihopqa`, `_musique`, `_bamboogle` | `qa_em`: last `<answer>`, exact match; 1 / 0 |
| `code`, `codecontests`, `apps`, `codeforces`, `taco`            | `code`: tests in our sandbox; fraction passed |
| `countdown`                                                     | `countdown` (TinyZero; 1 / 0.1 / 0) |
| `builtin/<task>` for every task of `rlcore.data.tasks`          | `rlcore.data.tasks.compute_score`   |
| `builtin/calc` (multi-turn, `rlcore.data.agent_tasks`)          | `agent_tasks.compute_score`         |
| `builtin/shapes` (images, `rlcore.data.shapes`)                 | `shapes.compute_score`              |
| `reasoning_gym/<task>` (`rlcore.data.reasoning_gym`)            | the task's own `score_answer` on the extracted answer |

`--reward.math-verifier math-verify` scores the MATH, DAPO / AIME and `numina_*` rows with math-verify
instead (`math_answer`: symbolic equivalence, any final answer, boxed or not; 1 / 0); geometry3k keeps
its own reward (it also scores the format). `--reward.custom file.py:fn` replaces the table for every
data_source, as verl's `custom_reward_function` does. `resolve_reward_fn` runs at start-up, so an
unknown data_source fails before the first rollout, not at step 500.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable
from typing import Any

from rlcore.data import agent_tasks, reasoning_gym, shapes, tasks
from rlcore.rewards import (
    code,
    countdown,
    geo3k,
    gsm8k,
    math_answer,
    math_dapo,
    math_reward,
    prime_math,
    qa_em,
    sandbox,
)
from rlcore.rewards.custom import FLAG, RewardFn, RewardSpecError, load_custom

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every data_source starting with "aime"
SEARCH_R1_SOURCES = tuple(
    f"searchR1_{name}"
    for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
)
CODE_SOURCES = ("code", "codecontests", "apps", "codeforces", "taco")  # verl's names for code data

REWARD_FNS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k.compute_score,
    **dict.fromkeys(MATH_SOURCES, math_reward.compute_score),
    **dict.fromkeys(DAPO_SOURCES, math_dapo.compute_score),
    **dict.fromkeys(prime_math.DATA_SOURCES, prime_math.compute_score),
    "hiyouga/geometry3k": geo3k.compute_score,
    **dict.fromkeys(SEARCH_R1_SOURCES, qa_em.compute_score),
    "countdown": countdown.compute_score,
    **dict.fromkeys(CODE_SOURCES, code.compute_score),
    **{f"builtin/{name}": tasks.compute_score for name in tasks.TASKS},
    agent_tasks.DATA_SOURCE: agent_tasks.compute_score,
    shapes.DATA_SOURCE: shapes.compute_score,
}
"""Built-in rewards by data_source; every entry has verl's `compute_score` signature."""

REWARD_PREFIXES: dict[str, RewardFn] = {
    "aime": math_dapo.compute_score,
    reasoning_gym.DATA_SOURCE: reasoning_gym.compute_score,
}
"""Rewards of every data_source starting with the key (verl: `data_source.startswith("aime")`; reasoning-gym's
tasks by their `reasoning_gym/` prefix)."""

MATH_VERIFIERS = ("verl", "math-verify")
"""--reward.math-verifier: verl's rules per data_source, or math-verify for every math one."""
_VERL_MATH = (math_reward.compute_score, math_dapo.compute_score, prime_math.compute_score)


def find_reward(data_source: str, math_verifier: str = "verl") -> RewardFn | None:
    """The built-in reward of `data_source` (exact name, then prefix), None if there is none."""
    fn = REWARD_FNS.get(data_source)
    if fn is None:
        fn = next((f for prefix, f in REWARD_PREFIXES.items() if data_source.startswith(prefix)), None)
    if math_verifier == "math-verify" and fn in _VERL_MATH:
        return math_answer.compute_score
    return fn


class UnknownDataSourceError(RewardSpecError):
    """A data_source with no reward function and no `--reward.custom`."""


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    math_verifier: str = "verl",
) -> float | dict:
    """Score one response with the built-in reward of its data_source."""
    fn = find_reward(data_source, math_verifier)
    if fn is None:
        raise unknown_sources_error([data_source])
    return fn(
        data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
    )


def _builtin_names() -> list[str]:
    return sorted([*REWARD_FNS, *(f"{prefix}*" for prefix in REWARD_PREFIXES)])


def unknown_sources_error(unknown: Iterable[str]) -> UnknownDataSourceError:
    """The one-line error for data_sources that no built-in reward knows."""
    names = ", ".join(repr(s) for s in sorted(set(unknown)))
    return UnknownDataSourceError(
        f"no reward function for data_source {names} (built-in: {', '.join(_builtin_names())}); "
        f"pass {FLAG} path/to/file.py:compute_score to score it with your own function"
    )


def resolve_reward_fn(
    data_sources: Iterable[str], custom: str | None = None, math_verifier: str = "verl"
) -> RewardFn:
    """The reward function for a run: the custom one if given, else the built-in table after checking
    that every data_source in `data_sources` has an entry (and that math-verify is there if needed)."""
    if custom is not None:
        return load_custom(custom)
    if math_verifier not in MATH_VERIFIERS:
        raise RewardSpecError(
            f"--reward.math-verifier {math_verifier!r}: choose one of {list(MATH_VERIFIERS)}"
        )
    sources = set(data_sources)
    unknown = {s for s in sources if find_reward(s) is None}
    if unknown:
        raise unknown_sources_error(unknown)
    if sources & set(CODE_SOURCES) and not sandbox.sandbox_available():
        raise RewardSpecError(
            f"data_source {sorted(sources & set(CODE_SOURCES))} runs code, but the sandbox is unavailable: "
            "apt-get install -y bubblewrap (and allow user namespaces)"
        )
    latex = sorted(
        s for s in sources if find_reward(s, math_verifier) in (prime_math.compute_score, geo3k.compute_score)
    )
    if latex and importlib.util.find_spec("pylatexenc") is None:
        raise RewardSpecError(
            f"data_source {latex} grades LaTeX answers with pylatexenc: pip install pylatexenc"
        )
    verified = sorted(s for s in sources if find_reward(s, math_verifier) is math_answer.compute_score)
    if verified:
        try:
            math_answer.require_math_verify()
        except ImportError as e:
            raise RewardSpecError(f"data_source {verified}: {e}") from None
    if math_verifier == "verl":
        return default_compute_score
    return functools.partial(default_compute_score, math_verifier=math_verifier)
