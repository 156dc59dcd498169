"""Advantage estimators. Each returns `(advantages, returns)`, both `(b, t)`.

Semantics equal verl 0.9.1 `verl/trainer/ppo/core_algos.py` (`compute_*_advantage*`) on the same
inputs, with two deliberate, documented choices:
- outputs are exactly 0 at masked positions (verl leaves whitened GAE advantages and the returns of
  gae / reinforce_pp / remax non-zero there; nothing downstream reads them, so rlcore zeroes them);
- where verl raises on data (grpo_passk with a group of one), a pure function cannot inspect data
  without a host sync: such a group gets advantage 0.

`token_rewards` carry the outcome reward (usually on the last response token, minus any KL penalty);
outcome estimators use the per-row score `sum_t token_rewards[:, t] * mask[:, t]` (verl sums every
position; the two agree because rewards are 0 off the response).

Masked positions never affect outputs as long as they hold finite numbers: the outcome estimators
mask by multiplication, which is what keeps them at a few passes over (b, t) memory (see
experiments/bench_pure.py); NaN or inf there would propagate, as in verl. `gae` and `reinforce_pp`
select with `torch.where` and tolerate NaN/inf at masked positions too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlcore.pure.groups import group_stats, group_sum
from rlcore.pure.masks import apply_mask, masked_whiten


def _broadcast(per_row: Tensor, response_mask: Tensor) -> Tensor:
    """(b,) score → (b, t) advantage on the response tokens, 0 elsewhere (one fused multiply)."""
    return per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)  # (b, t)


def _scores(token_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome score per row: the sum of its rewards on response tokens.  # (b,)"""
    return (token_rewards * response_mask.to(token_rewards.dtype)).sum(dim=-1)


def gae(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, whitened over the masked tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};  R_t = A_t + V_t.
    Masked positions (observation tokens of a multi-turn response) are skipped: V_{t+1} and A_{t+1}
    are those of the next kept token, as in verl. Schulman et al. 2016, arXiv:1506.02438.
    """
    m = response_mask.to(values.dtype)
    rewards = apply_mask(token_rewards, m)  # (b, t)
    vals = apply_mask(values, m)  # (b, t)
    next_value = torch.zeros_like(vals[:, 0])  # (b,)
    next_adv = torch.zeros_like(vals[:, 0])  # (b,)
    advs = []
    for t in reversed(range(vals.shape[1])):  # a loop over time, vectorised over the batch
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        keep = m[:, t] != 0
        next_value = torch.where(keep, vals[:, t], next_value)
        next_adv = torch.where(keep, adv_t, next_adv)
        advs.append(next_adv)
    raw = torch.stack(advs[::-1], dim=1)  # (b, t)
    returns = apply_mask(raw + vals, m)
    return apply_mask(masked_whiten(raw, m), m), returns


def grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage: A_i = (s_i - mean_g) / (std_g + eps), or s_i - mean_g (Dr.GRPO).

    A group of one has mean 0 and std 1. Shao et al. 2024 arXiv:2402.03300; Dr.GRPO (no std):
    Liu et al. 2025 arXiv:2503.20783.
    """
    scores = _scores(token_rewards, response_mask)
    stats = group_stats(scores, group_ids)
    single = stats.count <= 1
    mean = torch.where(single, torch.zeros_like(scores), stats.mean)
    adv = scores - mean
    if norm_by_std:
        std = torch.where(single, torch.ones_like(scores), stats.std)
        adv = adv / (std + eps)
    out = _broadcast(adv, response_mask)
    return out, out


def rloo(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline: A_i = s_i - mean_{j != i} s_j = (n s_i - sum_g s) / (n - 1).

    A group of one keeps its raw score, as verl's loop version does. Ahmadian et al. 2024,
    arXiv:2402.14740.
    """
    scores = _scores(token_rewards, response_mask)
    stats = group_stats(scores, group_ids)
    n = stats.count
    loo = (scores * n - stats.mean * n) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, loo, scores)
    out = _broadcast(adv, response_mask)
    return out, out


def opo(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Length-weighted group baseline: A_i = s_i - sum_g(len_j s_j) / sum_g(len_j); 0 baseline alone.

    Hao et al. 2025 (On-Policy RL with Optimal reward baseline), arXiv:2505.23585.
    """
    scores = _scores(token_rewards, response_mask)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)  # (b,)
    stats = group_stats(scores, group_ids)
    baseline = group_sum(lengths * scores, stats.inverse) / group_sum(lengths, stats.inverse)
    baseline = torch.where(stats.count > 1, baseline, torch.zeros_like(scores))
    out = _broadcast(scores - baseline, response_mask)
    return out, out


def gpg(
    token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, *, f_norm: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Group policy gradient: A_i = alpha (s_i - mean_g) / f_norm, alpha = b / max(#{s != 0}, 1).

    Chu et al. 2025, arXiv:2504.02546. (verl passes f_norm = 1 and ignores its own alpha argument.)
    """
    scores = _scores(token_rewards, response_mask)
    stats = group_stats(scores, group_ids)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    mean = torch.where(stats.count > 1, stats.mean, torch.zeros_like(scores))
    out = _broadcast(alpha * (scores - mean) / f_norm, response_mask)
    return out, out


def reinforce_pp(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    carry_through_masked: bool = True,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go G_t = r_t + gamma G_{t+1}, whitened over the batch's tokens.

    As in verl 0.9.1, the running return is carried unchanged across masked positions (observation
    tokens inside a multi-turn response; their rewards are ignored), like `gae` does, so the outcome
    reward reaches every turn. `carry_through_masked=False` restarts it after each masked position
    instead (verl before 0.9.1: it cuts earlier turns off from the outcome). The two agree on
    single-turn responses, whose masked positions all follow the last token. Hu 2025, arXiv:2501.03262.
    """
    m = response_mask.to(token_rewards.dtype)
    rewards = apply_mask(token_rewards, m) if carry_through_masked else token_rewards
    running = torch.zeros_like(rewards[:, 0])  # (b,)
    rets = []
    for t in reversed(range(rewards.shape[1])):  # a loop over time, vectorised over the batch
        g_t = rewards[:, t] + gamma * running
        rets.append(g_t)
        keep = m[:, t] != 0
        running = torch.where(keep, g_t, running if carry_through_masked else torch.zeros_like(g_t))
    returns = apply_mask(torch.stack(rets[::-1], dim=1), m)  # (b, t)
    return apply_mask(masked_whiten(returns, m), m), returns


def reinforce_pp_baseline(
    token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, *, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline: A = whiten_batch(s_i - mean_g) on the response tokens.

    `eps` is accepted for signature parity with verl, which does not use it. arXiv:2501.03262.
    """
    scores = _scores(token_rewards, response_mask)
    stats = group_stats(scores, group_ids)
    centered = scores - torch.where(stats.count > 1, stats.mean, torch.zeros_like(scores))
    tiled = _broadcast(centered, response_mask)  # (b, t)
    out = apply_mask(masked_whiten(tiled, response_mask), response_mask)
    return out, out


def remax(token_rewards: Tensor, response_mask: Tensor, baseline_rewards: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax: G_t = sum_{s >= t} r_s (masked), A_t = G_t - b with b the greedy response's reward (b,).

    Li et al. 2023, arXiv:2310.10505.
    """
    masked = apply_mask(token_rewards, response_mask)  # (b, t)
    returns = apply_mask(masked.flip(-1).cumsum(-1).flip(-1), response_mask)
    adv = returns - apply_mask(baseline_rewards.unsqueeze(-1).expand(returns.shape), response_mask)
    return adv, returns


def grpo_passk(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Pass@k advantage: only each group's best response gets A = (s_max - s_second) [/ (std_g + eps)].

    Ties at the top give 0 whichever row is picked. A group of one gets 0 (verl raises).
    Chen et al. 2025, arXiv:2503.19595.
    """
    scores = _scores(token_rewards, response_mask)
    stats = group_stats(scores, group_ids)
    # Sort by score descending, then (stably) by group: each group's rows become a run whose first
    # entry is its maximum and whose second entry is its runner-up.
    by_score = torch.sort(scores, descending=True, stable=True).indices  # (b,)
    order = by_score[torch.sort(stats.inverse[by_score], stable=True).indices]  # (b,)
    sorted_groups = stats.inverse[order]
    is_first = torch.ones_like(sorted_groups, dtype=torch.bool)
    is_first[1:] = sorted_groups[1:] != sorted_groups[:-1]
    runner_up = torch.roll(scores[order], shifts=-1)  # score of the next row in sorted order
    gap = scores[order] - runner_up  # (b,) meaningful at each group's first row
    if norm_by_std:
        gap = gap / (stats.std[order] + eps)
    keep = is_first & (stats.count[order] > 1)
    adv = torch.zeros_like(scores).index_put((order,), torch.where(keep, gap, torch.zeros_like(gap)))
    out = _broadcast(adv, response_mask)
    return out, out


def no_task(token_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """No task advantage: zeros (the `none` estimator). With a teacher (on-policy distillation,
    rlcore.pure.distill) the teacher's per-token term is then the whole advantage."""
    zeros = torch.zeros_like(token_rewards) * response_mask
    return zeros, zeros


ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "opo": opo,
    "gpg": gpg,
    "reinforce_pp": reinforce_pp,
    "reinforce_plus_plus": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline,
    "remax": remax,
    "grpo_passk": grpo_passk,
    "none": no_task,
}
