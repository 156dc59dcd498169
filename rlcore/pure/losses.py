"""Losses: aggregation, policy-gradient losses, the clipped value loss and the entropy bonus.

This is the public module. `aggregate` and the token-level policy losses (`ppo_clip`, `gspo`,
`cispo`, `gpg`, `sapo`) live in `rlcore.pure.policy_losses` and are re-exported here; this file adds
the sequence-level GMPO loss (`geo_mean`), the covariance losses of Cui et al. (`clip_cov`,
`kl_cov`), `value_loss`, `entropy`, `entropy_loss`, and `POLICY_LOSSES`, the table the trainer looks
losses up in. All entries of the table take the same arguments (see `rlcore.pure.policy_losses` for
the shared signature, the argument order, the global normalisers and the departures from verl).

`clip_cov` and `kl_cov` pick a data-dependent number of tokens, k = max(1, int(ratio * n_kept)),
from batch-wide statistics. They do it without a host sync: every token gets a key, one `torch.topk`
takes the best max(1, int(ratio * numel)) keys (a bound on k known from the shape), and the first k
(a 0-dim tensor) of those are picked.
Their token selection is batch-global, so unlike the other losses they do not decompose over
micro-batches. `clip_cov` draws its keys from the `generator` it is given; verl draws a `randperm`
from the global RNG instead: the set picked differs, but it is, like verl's, a uniform sample of the
same size from the same eligible tokens.

Semantics: verl 0.9.1 `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_geo_mean`,
`compute_policy_loss_clip_cov`, `compute_policy_loss_kl_cov`, `compute_value_loss`,
`compute_entropy_loss`) and
`verl/utils/torch_functional.py` (`entropy_from_logits`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlcore.pure.masks import apply_mask, masked_mean, masked_sum
from rlcore.pure.policy_losses import (
    AGG_MODES,
    Number,
    _kept,
    _weighted,
    aggregate,
    check_agg,
    cispo,
    dro,
    gpg,
    gspo,
    ppo_clip,
    sapo,
)

__all__ = [
    "AGG_MODES",
    "POLICY_LOSSES",
    "aggregate",
    "check_agg",
    "cispo",
    "clip_cov",
    "dro",
    "entropy",
    "entropy_loss",
    "geo_mean",
    "gpg",
    "gspo",
    "kl_cov",
    "ppo_clip",
    "sapo",
    "value_loss",
]


def geo_mean(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Geometric-Mean Policy Optimization (GMPO); = verl `compute_policy_loss_geo_mean`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: d = logprob - old_logprob (not clamped); per token, the sign-aware clip of PPO in log
    space: d' = sgn(A) min(sgn(A) d, sgn(A) clip(d, -clip_low, clip_high)); per row,
    l_i = -mean_t(A) exp(mean_t d'); loss = sum_i l_i w_i / num_seqs (default: b rows, verl's
    `torch.mean`; `agg` is ignored), where w_i is the geometric mean over kept tokens of
    `is_weights` + 1e-10. Metrics: pg_clipfrac (clipped, A > 0), ppo_kl, pg_clipfrac_lower
    (clipped, A < 0). Paper: arXiv:2507.20673.
    """
    check_agg(agg)
    mask = response_mask
    adv = _kept(advantages, mask)  # (b, t)
    log_ratio = _kept(logprob, mask) - _kept(old_logprob, mask)  # (b, t)
    sign = adv.sign()
    log_ratio_clip = log_ratio.clamp(-clip_low, clip_high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clip)  # (b, t)
    denom = mask.to(adv.dtype).sum(dim=-1) + 1e-8  # (b,)
    ratio = (masked_sum(log_ratio_min, mask, dim=-1) / denom).exp()  # (b,)
    seq_losses = -(masked_sum(adv, mask, dim=-1) / denom) * ratio  # (b,)
    if is_weights is not None:
        log_w = apply_mask(torch.log(_kept(is_weights, mask) + 1e-10), mask)
        seq_losses = seq_losses * (log_w.sum(dim=-1) / denom).exp()
    loss = seq_losses.sum() / (seq_losses.shape[0] if num_seqs is None else num_seqs)
    clipped = log_ratio != log_ratio_clip
    metrics = {
        "pg_clipfrac": masked_mean((clipped & (adv > 0)).to(adv.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": masked_mean((clipped & (adv < 0)).to(adv.dtype), mask).detach(),
    }
    return loss, metrics


def _budget(mask: Tensor, ratio: float) -> Tensor:
    """k = max(1, int(ratio * kept tokens)) as a 0-dim float64 tensor (no host sync)."""
    return ((mask != 0).sum().to(torch.float64) * ratio).floor().clamp(min=1.0)


def _first_k(key: Tensor, k: Tensor, ratio: float, *, largest: bool) -> Tensor:
    """Bool mask (shape of `key`) of the k elements (0-dim tensor k) that come first, largest or smallest.

    k never exceeds max(1, int(ratio * key.numel())), a bound known from the shape, so one
    `torch.topk` of that many elements replaces a sort of all of them, with no host sync. Ties at
    the boundary are broken as `torch.topk` breaks them (verl's kl_cov uses topk too).
    """
    flat = key.reshape(-1)
    bound = min(flat.numel(), max(1, int(ratio * flat.numel())))
    picked = torch.topk(flat, bound, largest=largest, sorted=True).indices  # (bound,), best first
    keep = torch.arange(bound, device=flat.device) < k
    return torch.zeros_like(flat, dtype=torch.bool).scatter(0, picked, keep).reshape(key.shape)


def clip_cov(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    is_weights: Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO clip that also detaches a random few high-covariance tokens; = verl `compute_policy_loss_clip_cov`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: r = exp(logprob - old_logprob) (not clamped); cov = (A - mean A)(logprob - mean logprob)
    over kept tokens; eligible = kept, not clipped by PPO, clip_cov_lb < cov < clip_cov_ub; a uniform
    sample of min(k, #eligible) eligible tokens, k = max(1, int(clip_cov_ratio * n_kept)), gets loss 0;
    the others l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (no dual clip).
    Keys come from `generator` only (never the global RNG; it must live on logprob's device); with
    None a fresh generator seeded with 0 is used, so pass one to get new draws each step. Metrics: pg_clipfrac (share sampled), ppo_kl.
    Paper: arXiv:2505.22617.
    """
    check_agg(agg)
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    mask = response_mask
    adv = _kept(advantages, mask)  # (b, t)
    lp = _kept(logprob, mask)
    log_ratio = lp - _kept(old_logprob, mask)
    ratio = log_ratio.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    lp_d, adv_d = lp.detach(), adv.detach()
    cov = (adv_d - masked_mean(adv_d, mask)) * (lp_d - masked_mean(lp_d, mask))  # (b, t)
    eligible = (mask != 0) & (loss2 <= loss1).detach() & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    if generator is None:
        generator = torch.Generator(device=lp.device).manual_seed(0)
    keys = torch.rand(lp.shape, generator=generator, dtype=torch.float64, device=lp.device)
    keys = torch.where(eligible, keys, 2.0)  # ineligible tokens rank after every eligible one
    dropped = eligible & _first_k(keys, _budget(mask, clip_cov_ratio), clip_cov_ratio, largest=False)
    pg_losses = torch.where(dropped, 0.0, torch.maximum(loss1, loss2))
    pg_losses = _weighted(pg_losses, is_weights, mask)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "pg_clipfrac": masked_mean(dropped.to(adv.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return loss, metrics


def kl_cov(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    is_weights: Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: policy gradient with a KL penalty on the top-covariance tokens; = verl `compute_policy_loss_kl_cov`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: d = logprob - old_logprob (not clamped), r = exp(d); l = -A r, plus ppo_kl_coef |d| on
    the k = max(1, int(kl_cov_ratio * n_kept)) kept tokens of largest cov = (A - mean A)(logprob -
    mean logprob), means over kept tokens (ties at the k-th place: as torch.topk, like verl). No clipping.
    Metrics: ppo_kl (masked mean of |d|, as verl). Paper: arXiv:2505.22617.
    """
    check_agg(agg)
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    mask = response_mask
    kept = mask != 0
    adv = _kept(advantages, mask)  # (b, t)
    lp = _kept(logprob, mask)
    log_ratio = lp - _kept(old_logprob, mask)
    abs_kl = log_ratio.abs()
    loss1 = -adv * log_ratio.exp()
    lp_d, adv_d = lp.detach(), adv.detach()
    count = kept.sum().to(lp.dtype).clamp(min=1.0)
    cov = (adv_d - masked_sum(adv_d, kept) / count) * (lp_d - masked_sum(lp_d, kept) / count)  # (b, t)
    key = torch.where(kept, cov, -torch.inf)
    top = kept & _first_k(key, _budget(mask, kl_cov_ratio), kl_cov_ratio, largest=True)  # (b, t)
    pg_losses = torch.where(top, loss1 + ppo_kl_coef * abs_kl, loss1)
    pg_losses = _weighted(pg_losses, is_weights, mask)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {"ppo_kl": masked_mean(abs_kl, mask).detach()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float = 0.5,
    agg: str = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value-function loss of PPO; = verl `compute_value_loss`.

    Shapes: `values` (new predictions), `old_values` (rollout-time values), `returns`,
    `response_mask` (b, t) -> 0-dim loss.
    Formula: v' = clip(values, old_values - clip, old_values + clip);
    loss = 0.5 aggregate(max((values - R)^2, (v' - R)^2)).
    Metrics: vf_clipfrac (share where the clipped error is the larger). PPO: arXiv:1707.06347.
    """
    check_agg(agg)
    mask = response_mask
    v, old, ret = _kept(values, mask), _kept(old_values, mask), _kept(returns, mask)  # (b, t)
    v_clipped = torch.clamp(v, old - clip, old + clip)
    err1 = (v - ret).square()
    err2 = (v_clipped - ret).square()
    losses = torch.maximum(err1, err2)
    loss = 0.5 * aggregate(losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {"vf_clipfrac": masked_mean((err2 > err1).to(v.dtype), mask).detach()}


def entropy(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution given by `logits`; = verl `entropy_from_logits`.

    Shapes: (..., v) -> (...). Formula: H = logsumexp(z) - sum_v softmax(z)_v z_v.
    Computed in float32 at least (bf16/fp16 logits are upcast); float64 stays float64.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_loss(
    logits: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> Tensor:
    """Aggregated token entropy (the bonus is `-coef * entropy_loss`); = verl `compute_entropy_loss`.

    Shapes: `logits` (b, t, v), `response_mask` (b, t) -> 0-dim.
    Formula: aggregate(entropy(logits), response_mask, agg).
    """
    token_entropy = entropy(logits)  # (b, t)
    return aggregate(
        token_entropy, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
    )


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip,
    "vanilla": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "gpg": gpg,
    "sapo": sapo,
    "geo_mean": geo_mean,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
}
"""Policy losses by name (verl's `loss_mode` names; `vanilla` is verl's name for `ppo_clip`).

Every entry takes `(logprob, old_logprob, advantages, response_mask, *, agg, clip_low, clip_high,
is_weights, num_tokens, num_seqs, horizon)` and returns `(loss, metrics)`.
"""
