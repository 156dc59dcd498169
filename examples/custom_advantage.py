"""Plug a new advantage estimator and a new policy loss into train.py without editing the library:

    python examples/custom_advantage.py --trainer.steps 20      # any train.py flag may follow

Median baseline A_i = s_i - median of the group: its parameter names say what it is fed (`group_ids`:
n >= 2 is checked). The loss halves PPO's upper clip; `clip_high` gets --algo.clip-high by its name.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # train.py, from a checkout

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
    return ((scores - median).unsqueeze(-1) * response_mask,) * 2  # (advantages, returns), each (b, t)


def clipped_pg(logprob, old_logprob, advantages, response_mask, *, clip_high=0.2, **kw):
    return ppo_clip(logprob, old_logprob, advantages, response_mask, clip_high=clip_high / 2, **kw)


ESTIMATORS["median"], POLICY_LOSSES["clipped_pg"] = median_baseline, clipped_pg
if __name__ == "__main__":
    import train

    flags = ["--algo.adv-estimator", "median", "--algo.policy-loss", "clipped_pg"]
    sys.exit(train.main(["grpo", *flags, *sys.argv[1:]]))
