"""Off-policy corrections between the rollout policy (mu, the engine that sampled) and the trainer's
(pi, recomputed or current): importance weights, rejection masks and a veto, plus gap diagnostics.

All take `logprob` (pi) and `rollout_logprob` (mu), both (b, t), and `response_mask` (b, t); the log
ratio is L = log pi - log mu per token. A `level` says what one weight covers:
- "token":     L_t                                   (one weight per token; biased, low variance)
- "sequence":  sum_t L_t over the row's tokens        (the product of the token ratios; unbiased)
- "geometric": mean_t L_t over the row's tokens       (the geometric mean; length-neutral)
The weight is exp(L) with L clamped to [-20, 20] first (exp(20) ~ 4.9e8), as verl's SAFETY_BOUND.

Semantics follow verl's rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`, Liu, Li et
al. 2025, "When Speed Kills Stability", https://richardli.xyz/rl-collapse): IS weights are truncated
above at `cap` and zero off the mask; rejection keeps a weight in [lower, upper] (lower = 1 / upper
by default; token level with that default is IcePop's mask) and is applied to the response mask, not
to the weights; the veto drops a whole row holding any token whose ratio is below `threshold`. verl
also offers geometric for rejection only; here IS takes it too. Metrics are 0-dim tensors (no host
sync); means use verl's masked_mean (sum / (count + 1e-8): 0 for a batch without response tokens).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from rlcore.pure.masks import apply_mask, masked_mean, masked_sum

SAFETY_BOUND = 20.0
Level = Literal["token", "sequence", "geometric"]
LEVELS = ("token", "sequence", "geometric")


def level_log_ratio(logprob: Tensor, rollout_logprob: Tensor, response_mask: Tensor, level: Level) -> Tensor:
    """L at `level`, broadcast over the row's tokens: (b, t). Unclamped."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    mask = response_mask != 0
    log_ratio = torch.where(mask, logprob - rollout_logprob, torch.zeros_like(logprob))  # (b, t)
    if level == "token":
        return log_ratio
    per_row = log_ratio.sum(-1, keepdim=True)  # (b, 1)
    if level == "geometric":
        per_row = per_row / mask.sum(-1, keepdim=True).clamp(min=1).to(per_row.dtype)
    return per_row.expand_as(log_ratio)


def _weights(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


def _unit_fraction(flags: Tensor, response_mask: Tensor, level: Level) -> Tensor:
    """The share of tokens (token level) or of rows with a token (sequence levels) where `flags`."""
    mask = response_mask != 0
    if level == "token":
        return masked_mean(flags.to(torch.float32), mask)
    rows = mask.any(-1)  # (b,)
    return masked_mean((flags & mask).any(-1).to(torch.float32), rows)


def is_weights(
    logprob: Tensor,
    rollout_logprob: Tensor,
    response_mask: Tensor,
    *,
    level: Level = "token",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights w = min(exp(clamp(L, -20, 20)), cap) on the mask, 0 off it: (b, t).

    Detached (they reweight the loss; no gradient flows through them). Metrics: `is_mean` (masked mean
    before truncation), `is_max` (before truncation), `is_ratio_fraction_high` / `_low` (share of
    units with a weight above cap / below 1/cap), `is_truncated_mean` (masked mean after truncation).
    Token level with cap c is truncated IS (TIS, Yao et al. 2025); = verl `compute_rollout_correction_weights`.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = response_mask != 0
    raw = _weights(level_log_ratio(logprob, rollout_logprob, response_mask, level)).detach()
    raw = torch.where(mask, raw, torch.zeros_like(raw))  # (b, t)
    weights = raw.clamp(max=cap)
    metrics = {
        "is_mean": masked_mean(raw, mask),
        "is_max": raw.amax() if raw.numel() else raw.new_zeros(()),
        "is_truncated_mean": masked_mean(weights, mask),
        "is_ratio_fraction_high": _unit_fraction(raw > cap, response_mask, level),
        "is_ratio_fraction_low": _unit_fraction(raw < 1.0 / cap, response_mask, level),
    }
    return weights, metrics


def rejection_mask(
    logprob: Tensor,
    rollout_logprob: Tensor,
    response_mask: Tensor,
    *,
    level: Level = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The response mask with the units whose weight leaves [lower, upper] set to 0: (b, t), its dtype.

    lower defaults to 1 / upper (token level: IcePop's two-sided mask, Ling team 2025). Metrics:
    `rs_masked_fraction` (share of response tokens rejected), `rs_seq_masked_fraction` (share of rows
    with a rejected token). = verl `compute_rollout_rejection_mask` (its geometric level included).
    """
    lower = 1.0 / upper if lower is None else lower
    if not 0 <= lower <= upper:
        raise ValueError(f"need 0 <= lower <= upper, got lower={lower}, upper={upper}")
    weights = _weights(level_log_ratio(logprob, rollout_logprob, response_mask, level))  # (b, t)
    keep = (weights >= lower) & (weights <= upper)
    mask = response_mask != 0
    rejected = mask & ~keep
    metrics = {
        "rs_masked_fraction": masked_mean(rejected.to(torch.float32), mask),
        "rs_seq_masked_fraction": masked_mean(rejected.any(-1).to(torch.float32), mask.any(-1)),
    }
    return response_mask * keep.to(response_mask.dtype), metrics


def veto_mask(
    logprob: Tensor, rollout_logprob: Tensor, response_mask: Tensor, *, threshold: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The response mask with every row that holds a token of ratio below `threshold` set to 0: (b, t).

    Metrics: `veto_fraction` (share of rows vetoed), `catastrophic_token_fraction` (share of response
    tokens below the threshold). = verl's `rollout_token_veto_threshold`.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    mask = response_mask != 0
    bad = (logprob - rollout_logprob < math.log(threshold)) & mask
    vetoed = bad.any(-1, keepdim=True)  # (b, 1)
    metrics = {
        "veto_fraction": masked_mean(vetoed.squeeze(-1).to(torch.float32), mask.any(-1)),
        "catastrophic_token_fraction": masked_mean(bad.to(torch.float32), mask),
    }
    return response_mask * (~vetoed).to(response_mask.dtype), metrics


def offpolicy_metrics(logprob: Tensor, rollout_logprob: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """How far mu is from pi on the sampled tokens (0-dim tensors), as verl's `compute_offpolicy_metrics`:
    `kl` = mean(log mu - log pi) (KL(mu || pi), k1), `k3_kl` = mean(exp(L) - L - 1), `chi2_token` =
    mean(exp(2 L)) - 1 and `chi2_seq` = mean over rows of exp(2 sum_t L) - 1 (L clamped to +-20)."""
    mask = response_mask != 0
    log_ratio = level_log_ratio(logprob, rollout_logprob, response_mask, "token")  # (b, t), 0 off the mask
    rows = mask.any(-1)
    seq = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (b,)
    return {
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1.0, mask),
        "chi2_token": masked_mean(_weights(log_ratio).square(), mask) - 1.0,
        "chi2_seq": masked_mean((2.0 * seq).exp(), rows) - 1.0,
    }


def logprob_gap(
    rollout_logprob: Tensor, logprob: Tensor, response_mask: Tensor, *, num_tokens: Tensor | None = None
) -> dict[str, Tensor]:
    """How far the engine's log-probs (mu) are from the trainer's (pi) on the same tokens, (b, t) each:
    d = |log mu - log pi| on the mask, in the wider dtype on mu's device; `mean` = sum d / N with N =
    `num_tokens` (a micro-batch's share of a larger batch) or the mask's count (at least 1), `max` = max d
    (0 without tokens). The rollout/trainer mismatch diagnostic (logged as `rollout/logprob_diff_*`)."""
    dtype = torch.promote_types(rollout_logprob.dtype, logprob.dtype)
    diff = apply_mask(
        (rollout_logprob.to(dtype) - logprob.to(rollout_logprob.device, dtype)).abs(), response_mask
    )
    count = response_mask.to(diff.dtype).sum().clamp(min=1.0) if num_tokens is None else num_tokens
    return {
        "mean": masked_sum(diff, response_mask) / count,  # (,)
        "max": diff.amax() if diff.numel() else diff.new_zeros(()),  # (,)
    }


__all__ = [
    "LEVELS",
    "SAFETY_BOUND",
    "is_weights",
    "level_log_ratio",
    "logprob_gap",
    "offpolicy_metrics",
    "rejection_mask",
    "veto_mask",
]
