"""Rewards: rule rewards by data_source, custom verl-style reward files, reward models, and scoring a step.

    from rlcore.rewards import RewardScorer, score_step
    scorer = RewardScorer(custom=None, data_sources=dataset.data_sources, num_workers=8, timeout_s=10)
    batch, metrics = score_step(scorer, batch, tokenizer=tokenizer)      # + token_scores (b, t)
    scorer.close()

| module        | what                                                                            |
|---------------|---------------------------------------------------------------------------------|
| `custom`      | `load_custom("file.py:fn")`: a user's verl-signature `compute_score`            |
| `dispatch`    | `REWARD_FNS` (data_source -> function), `resolve_reward_fn` (checked at start-up) |
| `gsm8k`, `math_answer`, `countdown`, `format` | the built-in rule rewards                       |
| `pool`        | `RewardScorer`: worker processes, per-sample timeout, error counting and ceiling |
| `step`        | `score_step`, DAPO's overlong penalty, last-token placement                      |
| `model`       | `RewardModel`: a Hugging Face sequence-classification reward model             |

Scripts that use worker processes (`num_workers > 0`) need the usual `if __name__ == "__main__":`
guard: workers come from a "forkserver" that imports the main module once.
"""

from rlcore.rewards.custom import RewardFn, RewardSpecError, load_custom
from rlcore.rewards.dispatch import (
    REWARD_FNS,
    UnknownDataSourceError,
    default_compute_score,
    resolve_reward_fn,
)
from rlcore.rewards.format import format_score, with_format_reward
from rlcore.rewards.model import RewardModel
from rlcore.rewards.pool import RewardError, RewardScorer, Scores
from rlcore.rewards.sandbox import SandboxResult, SandboxUnavailable, run_python, sandbox_available
from rlcore.rewards.step import OverlongPenalty, last_token_scores, overlong_penalty, score_step

__all__ = [
    "REWARD_FNS",
    "OverlongPenalty",
    "RewardError",
    "RewardFn",
    "RewardModel",
    "RewardScorer",
    "RewardSpecError",
    "SandboxResult",
    "SandboxUnavailable",
    "Scores",
    "UnknownDataSourceError",
    "default_compute_score",
    "format_score",
    "last_token_scores",
    "load_custom",
    "overlong_penalty",
    "resolve_reward_fn",
    "run_python",
    "sandbox_available",
    "score_step",
    "with_format_reward",
]
