"""Plug a new advantage estimator and a new policy loss into train.py without editing the library.

    python experiments/custom_advantage.py --trainer.steps 20   # --algo.adv-estimator median --algo.policy-loss clipped_pg

Median baseline: A_i = s_i - median of the group (robust to outlier rewards). Its parameter names say
what the trainer feeds it (`group_ids`: n >= 2 is checked for it like for grpo). The loss is PPO's clip
with a tighter upper bound, bound to the --algo.clip-* flags by its parameter names.
"""

import sys

import torch

from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.groups import group_stats
from rlcore.pure.losses import POLICY_LOSSES, ppo_clip


def median_baseline(token_rewards, response_mask, group_ids):
    scores = (token_rewards * response_mask).sum(-1)  # (b,)
    stats = group_stats(scores, group_ids)
    by_score = torch.sort(scores, stable=True).indices
    order = by_score[torch.sort(stats.inverse[by_score], stable=True).indices]  # group-major, then score
    start = torch.searchsorted(stats.inverse[order], stats.inverse)  # (b,) where each row's group begins
    median = scores[order][start + (stats.count.long() - 1) // 2]  # (b,) the lower median
    advantages = (scores - median).unsqueeze(-1) * response_mask  # (b, t)
    return advantages, advantages


def clipped_pg(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=0.2, **kw):
    return ppo_clip(
        logprob, old_logprob, advantages, response_mask, clip_low=clip_low, clip_high=clip_high / 2, **kw
    )


ESTIMATORS["median"] = median_baseline
POLICY_LOSSES["clipped_pg"] = clipped_pg

if __name__ == "__main__":
    import train

    sys.exit(
        train.main(
            ["grpo", "--algo.adv-estimator", "median", "--algo.policy-loss", "clipped_pg", *sys.argv[1:]]
        )
    )
