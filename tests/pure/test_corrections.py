"""rlcore.pure.corrections against values derived by hand (verl's rollout-correction semantics).

Two rows of three tokens; ratios pi/mu: row 0 = [1.8, 0.6, 4] (all kept), row 1 = [3/2] then two masked
positions holding garbage (a log ratio of 50 and of -50) that must never show.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.pure.corrections import is_weights, level_log_ratio, offpolicy_metrics, rejection_mask, veto_mask

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
RATIOS = [[1.8, 0.6, 4.0], [1.5, math.exp(50), math.exp(-50)]]


def logprobs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=torch.float64)
    log_ratio = torch.tensor([[math.log(r) for r in row] for row in RATIOS], dtype=torch.float64)
    return rollout + log_ratio, rollout  # (pi, mu)


def approx(x: float):
    return pytest.approx(x, rel=1e-7, abs=1e-12)


def test_token_is_weights_truncate_above_and_zero_off_the_mask() -> None:
    pi, mu = logprobs()
    w, m = is_weights(pi.requires_grad_(), mu, MASK, level="token", cap=2.0)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([[1.8, 0.6, 2.0], [1.5, 0.0, 0.0]], dtype=torch.float64))
    assert m["is_mean"].item() == approx((1.8 + 0.6 + 4 + 1.5) / 4)  # before truncation
    assert m["is_max"].item() == approx(4.0)
    assert m["is_truncated_mean"].item() == approx((1.8 + 0.6 + 2 + 1.5) / 4)
    assert m["is_ratio_fraction_high"].item() == approx(1 / 4)  # only the 4
    assert m["is_ratio_fraction_low"].item() == approx(0.0)  # 0.6 is not below 1/cap


def test_sequence_and_geometric_is_weights() -> None:
    pi, mu = logprobs()
    w, m = is_weights(pi, mu, MASK, level="sequence", cap=2.0)  # row 0: 1.8 * 0.6 * 4 = 4.32 -> 2
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [1.5, 0.0, 0.0]], dtype=torch.float64))
    assert m["is_mean"].item() == approx((3 * 4.32 + 1.5) / 4)
    assert m["is_ratio_fraction_high"].item() == approx(1 / 2)  # one row of two
    w, _ = is_weights(pi, mu, MASK, level="geometric", cap=2.0)  # row 0: 4.32 ** (1/3)
    g = 4.32 ** (1 / 3)
    torch.testing.assert_close(w, torch.tensor([[g, g, g], [1.5, 0.0, 0.0]], dtype=torch.float64))


def test_rejection_masks_units_outside_the_band_and_leaves_weights_alone() -> None:
    pi, mu = logprobs()
    mask, m = rejection_mask(pi, mu, MASK, level="token", upper=2.0)  # IcePop: keep [1/2, 2]
    torch.testing.assert_close(mask, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    assert m["rs_masked_fraction"].item() == approx(1 / 4)
    assert m["rs_seq_masked_fraction"].item() == approx(1 / 2)
    mask, m = rejection_mask(pi, mu, MASK, level="token", upper=5.0, lower=0.7)  # the 0.6 goes
    torch.testing.assert_close(mask, torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    mask, m = rejection_mask(pi, mu, MASK, level="sequence", upper=2.0)  # row 0's product 4.32: out
    torch.testing.assert_close(mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    assert m["rs_masked_fraction"].item() == approx(3 / 4)
    mask, _ = rejection_mask(pi, mu, MASK, level="geometric", upper=2.0)  # 4.32 ** (1/3) = 1.63: kept
    torch.testing.assert_close(mask, MASK)


def test_veto_drops_rows_with_a_catastrophic_token() -> None:
    pi, mu = logprobs()
    mask, m = veto_mask(pi, mu, MASK, threshold=0.65)  # row 0 holds a 0.6
    torch.testing.assert_close(mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    assert m["veto_fraction"].item() == approx(1 / 2)
    assert m["catastrophic_token_fraction"].item() == approx(1 / 4)
    mask, m = veto_mask(pi, mu, MASK, threshold=0.4)
    torch.testing.assert_close(mask, MASK)  # the masked 1e-22 ratio does not count
    assert m["veto_fraction"].item() == 0.0


def test_offpolicy_metrics_by_hand() -> None:
    pi, mu = logprobs()
    m = offpolicy_metrics(pi, mu, MASK)
    total = math.log(1.8) + math.log(0.6) + math.log(4) + math.log(1.5)  # the kept log ratios: ln 6.48
    assert m["kl"].item() == approx(-total / 4)  # KL(mu || pi), k1
    assert m["k3_kl"].item() == approx(((1.8 + 0.6 + 4 + 1.5) - total - 4) / 4)
    assert m["chi2_token"].item() == approx((1.8**2 + 0.6**2 + 16 + 2.25) / 4 - 1)
    assert m["chi2_seq"].item() == approx((4.32**2 + 1.5**2) / 2 - 1)


def test_log_ratios_are_clamped_to_the_safety_bound_and_levels_checked() -> None:
    pi = torch.tensor([[30.0, -30.0]], dtype=torch.float64)
    mu = torch.zeros_like(pi)
    w, _ = is_weights(pi, mu, torch.ones_like(pi), cap=1e12)
    torch.testing.assert_close(w, torch.tensor([[math.exp(20), math.exp(-20)]], dtype=torch.float64))
    ratio = level_log_ratio(pi, mu, torch.ones_like(pi), "geometric")
    torch.testing.assert_close(ratio, torch.zeros_like(pi))  # (30 - 30) / 2
    with pytest.raises(ValueError, match="level must be one of"):
        level_log_ratio(pi, mu, torch.ones_like(pi), "tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lower <= upper"):
        rejection_mask(pi, mu, torch.ones_like(pi), upper=0.5, lower=1.0)


def test_logprob_gap_by_hand():
    """d = |log mu - log pi| on the mask: (0.5, 0, masked 2.0) -> mean 0.5 / 2 tokens, max 0.5; a micro-batch's
    share of 4 tokens in all -> 0.5 / 4; no token -> 0 and 0."""
    from rlcore.pure.corrections import logprob_gap

    mu = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    pi = torch.tensor([[-1.5, -2.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    gap = logprob_gap(mu, pi, mask)
    assert gap["mean"].item() == 0.5 / 2 and gap["max"].item() == 0.5
    assert logprob_gap(mu, pi, mask, num_tokens=torch.tensor(4.0))["mean"].item() == 0.5 / 4
    empty = logprob_gap(mu, pi, torch.zeros_like(mask))
    assert empty["mean"].item() == 0.0 and empty["max"].item() == 0.0
