"""Plug a new advantage estimator into the rlcore loop without editing the library.

    python experiments/custom_advantage.py --trainer.steps 20

A "median baseline" GRPO variant: A_i = s_i - median of the group (robust to outlier rewards).
The loop looks estimators up in the plain table `rlcore.steps.ESTIMATOR_INPUTS`; adding an entry
makes `--algo.adv-estimator median` valid for this process.
"""

import sys

import torch

from rlcore import steps
from rlcore.pure.groups import group_stats


def median_baseline(token_rewards, response_mask, group_ids):
    """A_i = s_i - median_g(s) (lower median), on the response tokens. Vectorised: sort within groups."""
    scores = (token_rewards * response_mask).sum(-1)  # (b,)
    stats = group_stats(scores, group_ids)
    by_score = torch.sort(scores, stable=True).indices
    order = by_score[torch.sort(stats.inverse[by_score], stable=True).indices]  # group-major, then score
    sorted_groups = stats.inverse[order]  # (b,) non-decreasing
    start = torch.searchsorted(sorted_groups, stats.inverse)  # (b,) where each row's group begins
    median = scores[order][start + (stats.count.long() - 1) // 2]  # (b,)
    return (scores - median).unsqueeze(-1) * response_mask


steps.ESTIMATOR_INPUTS["median"] = lambda r, m, batch, algo: (
    (median_baseline(r, m, steps.group_ids(batch)),) * 2
)

if __name__ == "__main__":
    import train

    sys.exit(train.main(["grpo", "--algo.adv-estimator", "median", *sys.argv[1:]]))
