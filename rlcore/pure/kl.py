"""Per-token KL estimators, the KL penalty in the reward, and the adaptive KL coefficient.

The estimators are those of J. Schulman, "Approximating KL divergence" (2020),
http://joschu.net/blog/kl-approx.html, computed from the log-probabilities of the sampled tokens
under the policy (`logprob`) and the reference (`ref_logprob`); with r = ref_logprob - logprob:

    k1 = -r    abs = |r|    k2 = r^2 / 2    k3 = exp(r) - r - 1

Semantics follow verl 0.9.1: `kl_penalty` in `verl/trainer/ppo/core_algos.py` (kinds, clamps and
the straight-through `+` suffix), `apply_kl_penalty` in `verl/trainer/ppo/ray_trainer.py`, and
`AdaptiveKLController.update` (Ziegler et al. 2019). One departure: verl's "full" kind (KL over the
whole vocabulary) is not offered, as it needs full distributions rather than sampled log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlcore.pure.masks import apply_mask, masked_mean

_ALIASES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_KINDS: tuple[str, ...] = (*_ALIASES, *(f"{name}+" for name in _ALIASES))
"""Every accepted `kind`: verl's names, and each with the straight-through `+` suffix."""


def _kl_value(logprob: Tensor, ref_logprob: Tensor, base: str) -> Tensor:
    """The estimator `base` (one of k1, abs, k2, k3) elementwise."""
    if base == "k1":
        return logprob - ref_logprob
    if base == "abs":
        return (logprob - ref_logprob).abs()
    if base == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)  # log(pi_ref / pi), clamped as verl
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_estimate(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs; = verl `kl_penalty`.

    Shapes: `logprob`, `ref_logprob` (b, t) (any shape, broadcastable) -> same shape.
    Formula (r = ref_logprob - logprob): k1 = -r, abs = |r|, k2 = r^2/2,
    k3 = clamp(exp(clamp(r, -20, 20)) - clamp(r, -20, 20) - 1, -10, 10).
    A `+` suffix (`k1+`, `k3+`, ...) keeps the value of the estimator but takes the gradient of k2,
    which is the unbiased gradient of the KL: `k2 - k2.detach() + value.detach()` (straight-through).
    Reference: http://joschu.net/blog/kl-approx.html

    Raises ValueError for an unknown kind (verl's "full" needs full distributions: unsupported).
    """
    straight_through = kind.endswith("+")
    base = _ALIASES.get(kind[:-1] if straight_through else kind)
    if base is None:
        extra = (
            " ('full' needs full vocabulary distributions, not sampled log-probs)" if "full" in kind else ""
        )
        raise ValueError(f"unknown KL kind {kind!r}{extra}; valid kinds: {', '.join(KL_KINDS)}")
    value = _kl_value(logprob, ref_logprob, base)
    if not straight_through:
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def apply_kl_penalty(
    token_scores: Tensor,
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    *,
    coef: float | Tensor,
    kind: str = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-penalised token rewards; = verl `apply_kl_penalty` (ray_trainer.py) without the controller update.

    Shapes: `token_scores`, `logprob`, `ref_logprob`, `response_mask` (b, t) -> rewards (b, t).
    Formula: kl = kl_estimate * mask; token_rewards = token_scores - coef * kl.
    Metrics: `reward_kl_penalty` = mean over rows of the per-row masked token mean of kl (the value
    verl feeds to the adaptive controller), `reward_kl_penalty_coeff` = coef (0-dim tensors).
    Masked positions of kl are exactly 0 even where the log-probs hold NaN or inf.
    Reference: Ziegler et al. 2019, https://arxiv.org/abs/1909.08593 (reward - beta * KL).
    """
    kl = apply_mask(kl_estimate(logprob, ref_logprob, kind), response_mask)  # (b, t)
    token_rewards = token_scores - coef * kl  # (b, t)
    row_kl = masked_mean(kl, response_mask, dim=-1)  # (b,)
    metrics = {
        "reward_kl_penalty": row_kl.mean(),
        "reward_kl_penalty_coeff": torch.as_tensor(coef, dtype=kl.dtype, device=kl.device),
    }
    return token_rewards, metrics


def adaptive_kl_coef(
    coef: float | Tensor,
    observed_kl: float | Tensor,
    n_steps: int | float | Tensor,
    *,
    target: float,
    horizon: float,
) -> Tensor:
    """Next KL coefficient of the adaptive controller; pure form of verl `AdaptiveKLController.update`.

    Shapes: scalars (Python floats or 0-dim tensors) -> 0-dim tensor, with the dtype and device of
    `coef` if it is a tensor, else of `observed_kl` if that is one, else float64 on the CPU.
    Formula: err = clip(observed_kl / target - 1, -0.2, 0.2); new = coef * (1 + err * n_steps / horizon).
    Reference: Ziegler et al. 2019, https://arxiv.org/abs/1909.08593 (section 2.2).
    """
    if isinstance(horizon, (int, float)) and horizon <= 0:
        raise ValueError(f"horizon must be > 0, got {horizon}; use a fixed coefficient instead")
    if isinstance(target, (int, float)) and target <= 0:
        raise ValueError(f"target must be > 0, got {target}")
    like = coef if isinstance(coef, Tensor) else observed_kl if isinstance(observed_kl, Tensor) else None
    dtype = torch.float64 if like is None else like.dtype
    device = None if like is None else like.device
    err = (torch.as_tensor(observed_kl, dtype=dtype, device=device) / target - 1.0).clamp(-0.2, 0.2)
    return torch.as_tensor(coef, dtype=dtype, device=device) * (1.0 + err * n_steps / horizon)
