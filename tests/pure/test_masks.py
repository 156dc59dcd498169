"""Masked reductions: hand-derived values and the NaN-safety guarantee."""

from __future__ import annotations

import torch

from rlcore.pure.masks import apply_mask, masked_mean, masked_sum, masked_var, masked_whiten

F64 = torch.float64


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]], dtype=F64)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert masked_sum(x, m) == 1 + 2 + 3 + 4  # the 100 and the NaN are masked
    torch.testing.assert_close(masked_sum(x, m, dim=-1), torch.tensor([1 + 2, 3 + 4], dtype=F64))
    torch.testing.assert_close(masked_mean(x, m), torch.tensor((1 + 2 + 3 + 4) / (4 + 1e-8), dtype=F64))
    torch.testing.assert_close(
        masked_mean(x, m, dim=-1), torch.tensor([3 / (2 + 1e-8), 7 / (2 + 1e-8)], dtype=F64)
    )


def test_empty_mask_gives_zero_not_nan():
    x = torch.tensor([1.0, 2.0], dtype=F64)
    m = torch.zeros(2, dtype=F64)
    assert masked_mean(x, m) == 0  # 0 / (0 + 1e-8), as verl
    assert masked_var(x, m) == 0
    assert torch.equal(masked_whiten(x, m), torch.zeros(2, dtype=F64))  # nothing kept: (0 - 0) * rsqrt(1e-8)


def test_masked_var_unbiased_by_hand():
    x = torch.tensor([1.0, 2.0, 4.0, 50.0], dtype=F64)
    m = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)
    n = 3 + 1e-8  # verl's masked_mean denominator
    mean = 7 / n
    biased = ((1 - mean) ** 2 + (2 - mean) ** 2 + (4 - mean) ** 2) / n
    torch.testing.assert_close(
        masked_var(x, m, unbiased=False), torch.tensor(biased, dtype=F64), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(masked_var(x, m), torch.tensor(biased * 3 / 2, dtype=F64), atol=1e-9, rtol=0)
    assert masked_var(x, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=F64)) == 0  # one token: 0 (verl raises)


def test_masked_whiten_by_hand_and_shift_mean():
    x = torch.tensor([1.0, 2.0, 4.0, 50.0], dtype=F64)
    m = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)
    mean, var = 7 / 3, torch.tensor([1.0, 2.0, 4.0], dtype=F64).var()  # unbiased, as masked_var
    expected = (x[:3] - mean) / torch.sqrt(var + 1e-8)  # kept positions only
    torch.testing.assert_close(masked_whiten(x, m)[:3], expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False)[:3], expected + mean, atol=1e-7, rtol=0)


def test_masked_positions_carry_no_gradient_even_when_infinite():
    x = torch.tensor([1.0, float("inf"), 3.0, float("nan")], dtype=F64, requires_grad=True)
    m = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    (masked_var(x, m) + masked_mean(x, m) + apply_mask(masked_whiten(x, m), m).sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[1] == 0 and x.grad[3] == 0
    assert (apply_mask(x, m) == torch.tensor([1.0, 0.0, 3.0, 0.0], dtype=F64)).all()
