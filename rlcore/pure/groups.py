"""Per-group statistics over a flat batch, without a Python loop over groups.

`group_ids` is a `LongTensor[b]` of arbitrary integer labels (not necessarily contiguous or
sorted). Every function here maps the labels to dense indices once with `torch.unique` and then
uses `index_add` / gathers, so the cost is O(b) whatever the number of groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GroupStats(NamedTuple):
    """Statistics of `scores` per group, broadcast back to the rows (all shapes `(b,)`)."""

    inverse: Tensor  # (b,) dense group index of each row, in [0, n_groups)
    count: Tensor  # (b,) size of the row's group, in the scores' dtype
    mean: Tensor  # (b,) mean of the row's group
    std: Tensor  # (b,) unbiased standard deviation of the row's group (0 for a group of one)


def group_sum(values: Tensor, inverse: Tensor, n_groups: int | None = None) -> Tensor:
    """sum_{j in group g} values_j, gathered back to rows: out_i = S_{g(i)}.  # (b,)"""
    n = values.shape[0] if n_groups is None else n_groups
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, inverse, values)
    return sums[inverse]


def group_stats(scores: Tensor, group_ids: Tensor) -> GroupStats:
    """Group size, mean and unbiased std of `scores` (b,) for each row's group.

    std_g = sqrt(sum_{j in g} (s_j - mean_g)^2 / (n_g - 1)), two-pass like `torch.std`.
    """
    inverse = torch.unique(group_ids, return_inverse=True)[1]  # (b,)
    count = group_sum(torch.ones_like(scores), inverse)  # (b,)
    mean = group_sum(scores, inverse) / count  # (b,)
    centered = scores - mean
    var = group_sum(centered * centered, inverse) / (count - 1).clamp(min=1)  # (b,)
    # sqrt has an infinite slope at 0: take the std of a constant group as 0 with a 0 gradient,
    # so a group of one or of equal scores never turns a backward pass into NaN.
    positive = var > 0
    std = torch.where(
        positive, torch.where(positive, var, torch.ones_like(var)).sqrt(), torch.zeros_like(var)
    )
    return GroupStats(inverse, count, mean, std)
