"""Masked reductions over response tokens.

`mask` is bool or float with the shape of `x` (or broadcastable to it); 1 marks a token that
counts. Masked positions never reach the result, even when they hold NaN or inf: values are
selected with `torch.where` before they are multiplied, so neither outputs nor gradients see them.

Semantics follow verl `verl/utils/torch_functional.py` (masked_sum / masked_mean / masked_var /
masked_whiten). One departure: verl raises when an unbiased variance has fewer than two tokens; a
pure function cannot inspect data without a host sync, so here such a variance is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_mask(x: Tensor, mask: Tensor) -> Tensor:
    """x * mask, with masked positions exactly 0 whatever `x` holds there (NaN and inf included)."""
    m = mask.to(x.dtype)
    return torch.where(m != 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """sum(x * mask) over `dim` (all dimensions when None)."""
    kept = apply_mask(x, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """sum(x * mask) / (sum(mask) + 1e-8); an empty mask gives 0, as in verl."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / (count + 1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of `x`: mean((x - mean)^2) * n / (n - 1) if unbiased.

    With n <= 1 kept entries the variance is 0 (verl raises instead).
    """
    m = mask.to(x.dtype)
    x = torch.where(m != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))  # no NaN in backward
    centered = x - masked_mean(x, m)
    var = masked_mean(centered * centered, m)
    if not unbiased:
        return var
    n = m.sum()
    return torch.where(n > 1, var * n / (n - 1).clamp(min=1.0), torch.zeros_like(var))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) * rsqrt(var + 1e-8) over the masked entries; the mean is added back if not shift_mean.

    Masked positions of the result hold (0 - mean) * rsqrt(var + 1e-8): finite, never read.
    """
    x = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))  # no NaN in backward
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean
