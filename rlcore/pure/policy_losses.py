"""Loss aggregation and the token-level policy-gradient losses (PPO clip, GSPO, CISPO, GPG, SAPO, DRO).

Import these from `rlcore.pure.losses`, which re-exports them next to the sequence-level (GMPO) and
covariance losses, the value and entropy losses and the `POLICY_LOSSES` table.

Every policy loss shares one signature: `(logprob, old_logprob, advantages, response_mask, *,
agg="token-mean", clip_low=0.2, clip_high=0.2, is_weights=None, num_tokens=None, num_seqs=None,
horizon=None, ...)` and returns `(loss, metrics)`: a 0-dim loss and a dict of detached 0-dim tensors
with verl's metric keys less the `actor/` prefix. Note the order: the current `logprob` comes first
(verl passes `old_log_prob` first). `num_tokens`, `num_seqs`, `horizon` are the global normalisers of
`aggregate`, so that micro-batches and data-parallel ranks sum to the full-batch loss.

Semantics follow verl 0.9.1 `verl/trainer/ppo/core_algos.py` (`agg_loss`, `compute_policy_loss_*`).
Departures, each on purpose:
- inputs are read only where `response_mask` is non-zero (`torch.where`, not a product), so NaN or
  inf at masked positions reaches neither the loss, nor the metrics, nor the gradient;
- default normalisers are clamped to >= 1, so an empty mask gives a loss of 0 instead of NaN;
- `geo_mean` divides by `num_seqs` when given (verl takes a local `torch.mean` over rows), so it too
  sums correctly over micro-batches and ranks.
As in verl, `gspo` and `sapo` always aggregate with "seq-mean-token-mean" and `geo_mean` averages
per-sequence losses over rows: all three ignore `agg` (it is still validated).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlcore.pure.masks import masked_mean, masked_sum

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""The loss aggregation modes accepted by `aggregate` (verl's `loss_agg_mode` values)."""

Number = float | int | Tensor


def check_agg(mode: str) -> None:
    """Raise ValueError unless `mode` is one of AGG_MODES."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar; = verl `agg_loss` with dp_size=1.

    Shapes: `loss_mat`, `mask` (b, t) -> 0-dim.
    Formulas (S = masked sum, n_i = kept tokens of row i):
      token-mean               S / num_tokens          (default: kept tokens, at least 1)
      token-sum                S
      seq-mean-token-sum       sum_i S_i / num_seqs    (default: rows with n_i > 0, at least 1)
      seq-mean-token-mean      sum_{i: n_i>0} S_i / (n_i + 1e-8) / num_seqs
      seq-mean-token-sum-norm  sum_i S_i / num_seqs / horizon  (horizon default: t; Dr. GRPO,
                               arXiv:2503.20783; verl's current form, which older verl lacked 1/num_seqs)
    The result is a sum over rows divided by a normaliser: give every part of a batch (micro-batch,
    rank) the global `num_tokens` / `num_seqs` / `horizon` and the parts sum to the whole-batch loss.
    Normalisers may be Python numbers or 0-dim tensors. Masked entries of `loss_mat` are never read.
    """
    check_agg(mode)
    m = mask.to(loss_mat.dtype)  # (b, t)
    if mode == "token-mean":
        denom = m.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return masked_sum(loss_mat, m) / denom
    if mode == "token-sum":
        return masked_sum(loss_mat, m)
    row_sum = masked_sum(loss_mat, m, dim=-1)  # (b,)
    row_count = m.sum(dim=-1)  # (b,)
    row_kept = row_count > 0  # (b,)
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / (row_count + 1e-8)
    denom = row_kept.sum().to(loss_mat.dtype).clamp(min=1.0) if num_seqs is None else num_seqs
    seq_mean = masked_sum(row_sum, row_kept) / denom
    if mode == "seq-mean-token-sum-norm":
        return seq_mean / (m.shape[-1] if horizon is None else horizon)
    return seq_mean


def _kept(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask, 0 elsewhere (selected with `where`, so masked NaN/inf never reach the gradient)."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _weighted(pg_losses: Tensor, is_weights: Tensor | None, mask: Tensor) -> Tensor:
    """Per-token loss times the rollout-correction weights (verl's `rollout_is_weights`), if any."""
    return pg_losses if is_weights is None else pg_losses * _kept(is_weights, mask)


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def ppo_clip(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    is_weights: Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate with asymmetric clip and dual clip; = verl `compute_policy_loss_vanilla`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: r = exp(clamp(logprob - old_logprob, -20, 20));
    l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0, l = min(l, -A clip_c).
    Metrics: pg_clipfrac (clipped-branch share), ppo_kl (masked mean of old - new log-prob),
    pg_clipfrac_lower (dual-clip share). PPO: arXiv:1707.06347; dual clip: arXiv:1912.09729.
    """
    check_agg(agg)
    if clip_c <= 1.0:
        raise ValueError(f"clip_c (dual-clip lower bound) must be > 1.0, got {clip_c}")
    mask = response_mask
    adv = _kept(advantages, mask)  # (b, t)
    log_ratio = (_kept(logprob, mask) - _kept(old_logprob, mask)).clamp(-20.0, 20.0)  # (b, t)
    ratio = log_ratio.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_c
    dual = torch.minimum(loss3, clipped)
    pg_losses = torch.where(adv < 0, dual, clipped)  # (b, t)
    pg_losses = _weighted(pg_losses, is_weights, mask)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).to(adv.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": masked_mean(((clipped > loss3) & (adv < 0)).to(adv.dtype), mask).detach(),
    }
    return loss, metrics


def gspo(
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
    """Group Sequence Policy Optimization; = verl `compute_policy_loss_gspo`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: s_i = exp(mean_t(logprob - old_logprob)) per row; the token ratio has the value of s_i
    and the gradient of logprob: s_it = exp(min(logprob - sg(logprob) + sg(log s_i), 10));
    l = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high)), aggregated by `agg` (as verl 0.9.1,
    which recommends "seq-mean-token-mean": the `gspo` preset sets it). Metrics: pg_clipfrac, ppo_kl,
    pg_clipfrac_lower (always 0).
    Paper: arXiv:2507.18071.
    """
    check_agg(agg)
    mask = response_mask
    adv = _kept(advantages, mask)  # (b, t)
    lp = _kept(logprob, mask)
    log_ratio = lp - _kept(old_logprob, mask)  # (b, t)
    lengths = mask.to(lp.dtype).sum(dim=-1).clamp(min=1.0)  # (b,)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths  # (b,)
    token_log_ratio = (lp - lp.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)  # (b, t)
    ratio = token_log_ratio.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_losses = _weighted(torch.maximum(loss1, loss2), is_weights, mask)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).to(adv.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": _zero(adv),
    }
    return loss, metrics


def cispo(
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
    """Clipped IS-weight policy optimization; = verl `compute_policy_loss_cispo`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: r = exp(clamp(logprob - old_logprob, -20, 20)); l = -sg(clip(r, 1 - clip_low,
    1 + clip_high)) A logprob: every token keeps a gradient, only its weight is clipped.
    Metrics: pg_clipfrac (share with r outside the clip range), ppo_kl, pg_clipfrac_lower (always 0).
    Paper (MiniMax-M1): arXiv:2506.13585.
    """
    check_agg(agg)
    mask = response_mask
    adv = _kept(advantages, mask)  # (b, t)
    lp = _kept(logprob, mask)
    log_ratio = (lp - _kept(old_logprob, mask)).clamp(-20.0, 20.0)  # (b, t)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    pg_losses = _weighted(-weight * adv * lp, is_weights, mask)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "pg_clipfrac": masked_mean((ratio != weight).to(adv.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": _zero(adv),
    }
    return loss, metrics


def gpg(
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
    """Group Policy Gradient (plain REINFORCE on the current policy); = verl `compute_policy_loss_gpg`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: l = -A logprob (`old_logprob` and the clip ranges are unused). Metrics: none, as verl.
    Paper: arXiv:2504.02546.
    """
    check_agg(agg)
    mask = response_mask
    pg_losses = _weighted(-_kept(logprob, mask) * _kept(advantages, mask), is_weights, mask)  # (b, t)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {}


def sapo(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    is_weights: Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Soft Adaptive Policy Optimization: a sigmoid gate instead of a hard clip; = verl `compute_policy_loss_sapo`.

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: r = exp(clamp(logprob - old_logprob, -20, 20)); tau = tau_pos if A > 0 else tau_neg;
    l = -A sigmoid(tau (r - 1)) 4 / tau, aggregated "seq-mean-token-mean" whatever `agg` (as verl).
    Metrics: pg_clipfrac (always 0), ppo_kl, pg_clipfrac_lower (always 0). Paper: arXiv:2511.20347.
    """
    check_agg(agg)
    mask = response_mask
    adv = _kept(advantages, mask)  # (b, t)
    log_ratio = (_kept(logprob, mask) - _kept(old_logprob, mask)).clamp(-20.0, 20.0)  # (b, t)
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # (b, t)
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)
    pg_losses = _weighted(-gate * adv, is_weights, mask)
    loss = aggregate(pg_losses, mask, "seq-mean-token-mean", num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {
        "pg_clipfrac": _zero(adv),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": _zero(adv),
    }
    return loss, metrics


def dro(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    agg: str = "token-mean",
    beta: float = 0.05,
    is_weights: Tensor | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Direct reward optimisation's per-token loss, as the Tinker API defines its `dro`: a policy gradient
    held near the sampling policy by a quadratic penalty on the log-ratio (no clip).

    Shapes: all tensors (b, t) -> 0-dim loss.
    Formula: l = -(A logprob - beta / 2 (logprob - old_logprob)^2); `advantages` are the caller's (DRO's
    "soft" ones). Metrics: ppo_kl. Paper: Richemond et al. 2024, arXiv:2405.19107.
    """
    check_agg(agg)
    mask = response_mask
    lp = _kept(logprob, mask)
    log_ratio = lp - _kept(old_logprob, mask)  # (b, t)
    pg_losses = _weighted(-(_kept(advantages, mask) * lp - 0.5 * beta * log_ratio.square()), is_weights, mask)
    loss = aggregate(pg_losses, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {"ppo_kl": masked_mean(-log_ratio, mask).detach()}
