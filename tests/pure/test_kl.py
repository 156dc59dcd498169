"""Tests for rlcore.pure.kl: hand-derived values, verl's clamps, straight-through gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.pure.kl import KL_KINDS, adaptive_kl_coef, apply_kl_penalty, kl_estimate

F64 = torch.float64
L = [-0.5, -2.0, -1.2, -0.1]  # policy log-probs of sampled tokens
R = [-0.7, -1.0, -1.2, -3.0]  # reference log-probs of the same tokens


def _t(xs, requires_grad=False):
    return torch.tensor(xs, dtype=F64, requires_grad=requires_grad)


# Hand formulas, per token (l = logprob, r = ref_logprob), from Schulman's blog and verl's clamps.
def _k1(lp, r):
    return lp - r


def _abs(lp, r):
    return abs(lp - r)


def _k2(lp, r):
    return 0.5 * (lp - r) ** 2


def _k3(lp, r):
    d = min(max(r - lp, -20.0), 20.0)  # verl clamps log(pi_ref / pi) to [-20, 20] before exp
    return min(max(math.exp(d) - d - 1, -10.0), 10.0)  # and the estimate to [-10, 10]


HAND = {"k1": _k1, "kl": _k1, "abs": _abs, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3}


@pytest.mark.parametrize("kind", list(HAND))
def test_each_kind_matches_hand_formula(kind):
    got = kl_estimate(_t(L), _t(R), kind)
    expected = _t([HAND[kind](lp, r) for lp, r in zip(L, R, strict=True)])
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_values_written_out():
    # lp - r = 0.2, -1.0; exp(r - lp) - (r - lp) - 1 for the k3 column
    lp, r = _t([-0.5, -2.0]), _t([-0.7, -1.0])
    torch.testing.assert_close(kl_estimate(lp, r, "k1"), _t([0.2, -1.0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(kl_estimate(lp, r, "abs"), _t([0.2, 1.0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(kl_estimate(lp, r, "k2"), _t([0.5 * 0.04, 0.5 * 1.0]), atol=1e-12, rtol=0)
    k3 = [math.exp(-0.2) + 0.2 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_estimate(lp, r, "k3"), _t(k3), atol=1e-12, rtol=0)


def test_k3_clamps():
    # r - lp = 30 -> clamped to 20 inside: exp(20) - 20 - 1 > 10 -> output clamp 10.
    # r - lp = -30 -> clamped to -20: exp(-20) + 20 - 1 ~ 19 > 10 -> 10.
    # r - lp = 3 -> exp(3) - 3 - 1 = 16.09 > 10 -> 10; r - lp = 2 -> exp(2) - 3 = 4.389 (unclamped).
    got = kl_estimate(_t([0.0, 0.0, 0.0, 0.0]), _t([30.0, -30.0, 3.0, 2.0]), "k3")
    torch.testing.assert_close(got, _t([10.0, 10.0, 10.0, math.exp(2.0) - 3.0]), atol=1e-12, rtol=0)


def test_k3_inner_clamp_keeps_gradient_finite():
    # Beyond |r - lp| > 20 the value is clamped to 10 either way; the inner clamp is what keeps
    # exp(r - lp) from overflowing to inf, whose product with the outer clamp's 0 gradient is NaN.
    lp = _t([0.0, 0.0], requires_grad=True)
    kl_estimate(lp, _t([1000.0, -1000.0]), "k3").sum().backward()
    torch.testing.assert_close(lp.grad, _t([0.0, 0.0]), atol=0, rtol=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-50, 50), st.floats(-50, 50)), min_size=1, max_size=20))
def test_k3_is_nonnegative(pairs):
    lp, r = _t([p[0] for p in pairs]), _t([p[1] for p in pairs])
    # exp(d) - d - 1 >= 0 exactly; in floating point it cancels to about -1e-16 for tiny d
    assert (kl_estimate(lp, r, "k3") >= -1e-15).all()


@pytest.mark.parametrize(
    ("kind", "base"), [("k1+", "k1"), ("k3+", "k3"), ("kl+", "k1"), ("low_var_kl+", "k3")]
)
def test_straight_through_value_and_gradient(kind, base):
    l1, l2 = _t(L, requires_grad=True), _t(L, requires_grad=True)
    w = _t([1.0, -2.0, 0.5, 3.0])  # arbitrary upstream weights
    st_val = kl_estimate(l1, _t(R), kind)
    torch.testing.assert_close(st_val.detach(), kl_estimate(_t(L), _t(R), base), atol=1e-12, rtol=0)
    (st_val * w).sum().backward()
    (kl_estimate(l2, _t(R), "k2") * w).sum().backward()
    # d k2 / d lp = (lp - r): the gradient of 0.5 (lp - r)^2
    expected = _t([wi * (li - ri) for wi, li, ri in zip(w.tolist(), L, R, strict=True)])
    torch.testing.assert_close(l1.grad, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(l1.grad, l2.grad, atol=1e-12, rtol=0)


def test_plain_k3_gradient_is_not_k2():
    # Guards the test above: without '+', d k3 / d lp = 1 - exp(r - lp), which differs from lp - r.
    lp = _t([-0.5], requires_grad=True)
    kl_estimate(lp, _t([-0.7]), "k3").sum().backward()
    torch.testing.assert_close(lp.grad, _t([1 - math.exp(-0.2)]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["full", "k4", "K1", "", "k3++"])
def test_unknown_kind_raises(kind):
    with pytest.raises(ValueError, match="valid kinds") as err:
        kl_estimate(_t(L), _t(R), kind)
    assert repr(kind) in str(err.value)
    if kind == "full":
        assert "full vocabulary" in str(err.value)


def test_all_kinds_listed_are_accepted():
    for kind in KL_KINDS:
        assert kl_estimate(_t(L), _t(R), kind).shape == (4,)


def _batch():
    scores = _t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = _t([[-0.5, -1.0, -2.0], [-0.3, -0.4, float("nan")]])
    ref = _t([[-0.6, -1.5, -1.0], [-0.3, -0.9, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # NaN sits at the masked position (1, 2)
    return scores, logp, ref, mask


def test_apply_kl_penalty_by_hand():
    scores, logp, ref, mask = _batch()
    beta = 0.1
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, coef=beta, kind="k1")
    kl = [[0.1, 0.5, -1.0], [0.0, 0.5, 0.0]]  # logp - ref, 0 at the masked NaN
    expected = _t(
        [
            [s - beta * k for s, k in zip(sr, kr, strict=True)]
            for sr, kr in zip(scores.tolist(), kl, strict=True)
        ]
    )
    torch.testing.assert_close(rewards, expected, atol=1e-12, rtol=0)
    row_means = [(0.1 + 0.5 - 1.0) / 3, (0.0 + 0.5) / 2]  # per-row masked token means
    torch.testing.assert_close(metrics["reward_kl_penalty"], _t(sum(row_means) / 2), atol=1e-8, rtol=0)
    torch.testing.assert_close(metrics["reward_kl_penalty_coeff"], _t(beta), atol=0, rtol=0)
    assert not torch.isnan(rewards).any()


def test_apply_kl_penalty_k3_tensor_coef():
    scores, logp, ref, mask = _batch()
    beta = torch.tensor(0.25, dtype=F64)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, coef=beta, kind="low_var_kl")
    lp, r, s = logp.tolist(), ref.tolist(), scores.tolist()
    kl = [[_k3(lp[i][j], r[i][j]) if mask[i, j] else 0.0 for j in range(3)] for i in range(2)]
    expected = _t([[s[i][j] - 0.25 * kl[i][j] for j in range(3)] for i in range(2)])
    torch.testing.assert_close(rewards, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        metrics["reward_kl_penalty"], _t((sum(kl[0]) / 3 + sum(kl[1]) / 2) / 2), atol=1e-8, rtol=0
    )
    assert metrics["reward_kl_penalty_coeff"].dim() == 0


def test_apply_kl_penalty_matches_loop_over_seeds():
    # A per-sample loop transcribing verl's apply_kl_penalty: kld * mask, scores - beta * kld,
    # per-row sum / (count + 1e-8), then the mean over rows.
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        b, t = 5, 7
        scores, logp, ref = (torch.randn(b, t, generator=g, dtype=F64) for _ in range(3))
        mask = (torch.rand(b, t, generator=g) > 0.3).to(F64)
        mask[0] = 0.0  # an empty row counts as kl 0 in the mean, as in verl
        kind = ["k1", "abs", "k2", "k3"][seed % 4]
        rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, coef=0.05, kind=kind)
        hand = HAND[kind]
        exp_rewards, row_kls = torch.empty(b, t, dtype=F64), []
        for i in range(b):
            row = [hand(logp[i, j].item(), ref[i, j].item()) * mask[i, j].item() for j in range(t)]
            exp_rewards[i] = scores[i] - 0.05 * _t(row)
            row_kls.append(sum(row) / (mask[i].sum().item() + 1e-8))
        torch.testing.assert_close(rewards, exp_rewards, atol=1e-10, rtol=0)
        torch.testing.assert_close(metrics["reward_kl_penalty"], _t(sum(row_kls) / b), atol=1e-10, rtol=0)


def test_apply_kl_penalty_does_not_modify_inputs():
    scores, logp, ref, mask = _batch()
    copies = [x.clone() for x in (scores, logp, ref, mask)]
    apply_kl_penalty(scores, logp, ref, mask, coef=0.1, kind="k3")
    for x, c in zip((scores, logp, ref, mask), copies, strict=True):
        torch.testing.assert_close(x, c, equal_nan=True, atol=0, rtol=0)


def test_adaptive_coef_linear_region():
    # err = 0.06 / 0.05 - 1 = 0.2 is at the bound; use 0.055 -> err = 0.1 (inside the clip)
    new = adaptive_kl_coef(0.1, 0.055, 256, target=0.05, horizon=10000)
    torch.testing.assert_close(new, _t(0.1 * (1 + (0.055 / 0.05 - 1) * 256 / 10000)), atol=1e-12, rtol=0)


def test_adaptive_coef_clips_high_and_low():
    # observed 10x target: err = 9 clipped to +0.2; observed 0: err = -1 clipped to -0.2
    high = adaptive_kl_coef(0.1, 0.5, 100, target=0.05, horizon=1000)
    low = adaptive_kl_coef(0.1, 0.0, 100, target=0.05, horizon=1000)
    torch.testing.assert_close(high, _t(0.1 * (1 + 0.2 * 100 / 1000)), atol=1e-12, rtol=0)
    torch.testing.assert_close(low, _t(0.1 * (1 - 0.2 * 100 / 1000)), atol=1e-12, rtol=0)


def test_adaptive_coef_on_target_is_unchanged_and_accepts_tensors():
    coef = torch.tensor(0.3, dtype=torch.float32)
    new = adaptive_kl_coef(coef, torch.tensor(0.02), torch.tensor(64), target=0.02, horizon=500)
    assert new.dtype == torch.float32 and new.dim() == 0
    torch.testing.assert_close(new, torch.tensor(0.3), atol=1e-7, rtol=0)
    # tensor coef, float observed (err = 0.03 / 0.02 - 1 = 0.5 -> 0.2)
    new = adaptive_kl_coef(torch.tensor(0.3, dtype=F64), 0.03, 64, target=0.02, horizon=500)
    torch.testing.assert_close(new, _t(0.3 * (1 + 0.2 * 64 / 500)), atol=1e-12, rtol=0)


def test_adaptive_coef_rejects_bad_horizon():
    with pytest.raises(ValueError, match="horizon"):
        adaptive_kl_coef(0.1, 0.1, 1, target=0.1, horizon=0)
