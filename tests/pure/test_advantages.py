"""Advantage estimators: hand-derived values, loop references, and properties.

Expected values are written out symbolically; each comment says where the number comes from.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.pure import advantages as adv
from tests.pure import loop_reference as ref

F64 = torch.float64
ATOL = 1e-6


def outcome(scores, t_len=3, mask=None):
    """Rewards with each score on the last response token of its row."""
    scores = torch.as_tensor(scores, dtype=F64)
    mask = torch.ones(len(scores), t_len, dtype=F64) if mask is None else torch.as_tensor(mask, dtype=F64)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    return torch.where(last, scores[:, None].expand(mask.shape), torch.zeros_like(mask)), mask


# ---------------------------------------------------------------- hand-derived values


def test_grpo_by_hand_with_a_group_of_one():
    # group 5: scores (1, 0, 0); group 9: a single score 2
    r, m = outcome([1.0, 0.0, 0.0, 2.0])
    ids = torch.tensor([5, 5, 5, 9])
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of (1, 0, 0)
    eps = 1e-6
    expected = [
        (1 - mean) / (std + eps),
        (0 - mean) / (std + eps),
        (0 - mean) / (std + eps),
        (2 - 0) / (1 + eps),
    ]
    a, ret = adv.grpo(r, m, ids)
    torch.testing.assert_close(a, torch.tensor(expected, dtype=F64)[:, None] * m, atol=ATOL, rtol=0)
    assert torch.equal(a, ret)


def test_drgrpo_is_grpo_without_the_std():
    r, m = outcome([1.0, 0.0, 0.0, 2.0])
    a, _ = adv.grpo(r, m, torch.tensor([5, 5, 5, 9]), norm_by_std=False)
    expected = [1 - 1 / 3, -1 / 3, -1 / 3, 2 - 0]  # s - mean_g; a group of one has mean 0
    torch.testing.assert_close(a[:, 0], torch.tensor(expected, dtype=F64), atol=ATOL, rtol=0)


def test_rloo_by_hand():
    r, m = outcome([1.0, 0.0, 0.0, 2.0])
    a, _ = adv.rloo(r, m, torch.tensor([5, 5, 5, 9]))
    expected = [
        1 - (0 + 0) / 2,
        0 - (1 + 0) / 2,
        0 - (1 + 0) / 2,
        2.0,
    ]  # s_i - mean of the others; alone: raw
    torch.testing.assert_close(a[:, 0], torch.tensor(expected, dtype=F64), atol=ATOL, rtol=0)


def test_opo_weights_the_baseline_by_length():
    mask = [[1, 1, 0], [1, 0, 0], [1, 1, 1]]  # lengths 2, 1, 3
    r, m = outcome([1.0, 0.0, 0.0], mask=mask)
    a, _ = adv.opo(r, m, torch.tensor([0, 0, 0]))
    base = (2 * 1 + 1 * 0 + 3 * 0) / (2 + 1 + 3)
    expected = torch.tensor([1 - base, 0 - base, 0 - base], dtype=F64)[:, None] * m
    torch.testing.assert_close(a, expected, atol=ATOL, rtol=0)


def test_gpg_scales_by_batch_over_nonzero_scores():
    r, m = outcome([1.0, 0.0, 0.0, 2.0])
    a, _ = adv.gpg(r, m, torch.tensor([5, 5, 5, 9]), f_norm=2.0)
    alpha = 4 / 2  # b = 4 rows, 2 non-zero scores
    expected = [alpha * (1 - 1 / 3) / 2, alpha * (-1 / 3) / 2, alpha * (-1 / 3) / 2, alpha * (2 - 0) / 2]
    torch.testing.assert_close(a[:, 0], torch.tensor(expected, dtype=F64), atol=ATOL, rtol=0)


def test_reinforce_pp_discounts_and_whitens():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    m = torch.ones_like(r)
    g = 0.5
    a, ret = adv.reinforce_pp(r, m, gamma=g)
    returns = torch.tensor([[g**2, g, 1.0]], dtype=F64)  # G_t = gamma^(2-t) * 1
    torch.testing.assert_close(ret, returns, atol=ATOL, rtol=0)
    mean = returns.mean()
    var = ((returns - mean) ** 2).sum() / 2  # unbiased over 3 tokens
    torch.testing.assert_close(a, (returns - mean) / torch.sqrt(var + 1e-8), atol=ATOL, rtol=0)


def test_reinforce_pp_observation_token_carries_like_verl_or_resets():
    # response: token, observation (mask 0, with a stray reward that must be ignored), token, token(+1)
    r = torch.tensor([[0.0, 5.0, 0.0, 1.0]], dtype=F64)
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64)
    _, ret = adv.reinforce_pp(r, m)
    # verl 0.9.1 (the default): carried across the observation, so the outcome reaches the first turn
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64), atol=ATOL, rtol=0)
    _, ret = adv.reinforce_pp(r, m, carry_through_masked=False)
    # older verl: the running return is multiplied by the mask, so it restarts at the observation
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=F64), atol=ATOL, rtol=0)


def test_gae_skips_observation_tokens():
    g, lam = 0.9, 0.8
    v0, v1, v2, v3 = 0.3, 7.0, -0.2, 0.5  # v1 sits on an observation token: it must be ignored
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64)
    v = torch.tensor([[v0, v1, v2, v3]], dtype=F64)
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64)
    a3 = 1 - v3  # delta_3 = r_3 + g*0 - v3
    a2 = (0 + g * v3 - v2) + g * lam * a3
    a0 = (0 + g * v2 - v0) + g * lam * a2  # the next kept token after 0 is 2
    a, ret = adv.gae(r, v, m, gamma=g, lam=lam)
    torch.testing.assert_close(
        ret, torch.tensor([[a0 + v0, 0.0, a2 + v2, a3 + v3]], dtype=F64), atol=ATOL, rtol=0
    )
    raw = torch.tensor([a0, a2, a3], dtype=F64)
    white = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)  # torch.var is unbiased
    torch.testing.assert_close(a[0, [0, 2, 3]], white, atol=ATOL, rtol=0)
    assert a[0, 1] == 0


def test_remax_subtracts_the_greedy_baseline():
    r = torch.tensor([[0.0, 0.5, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    a, ret = adv.remax(r, m, torch.tensor([0.25, 1.0], dtype=F64))
    returns = torch.tensor([[1.5, 1.5, 1.0], [2.0, 2.0, 0.0]], dtype=F64)  # reward-to-go on kept tokens
    torch.testing.assert_close(ret, returns, atol=ATOL, rtol=0)
    torch.testing.assert_close(a, returns - torch.tensor([[0.25], [1.0]], dtype=F64) * m, atol=ATOL, rtol=0)


def test_grpo_passk_rewards_only_the_best():
    r, m = outcome([0.2, 0.9, 0.5, 3.0])
    a, _ = adv.grpo_passk(r, m, torch.tensor([1, 1, 1, 2]))
    std = torch.tensor([0.2, 0.9, 0.5], dtype=F64).std()
    expected = [0.0, (0.9 - 0.5) / (std + 1e-6), 0.0, 0.0]  # best minus runner-up; alone → 0
    torch.testing.assert_close(a[:, 0], torch.tensor(expected, dtype=F64), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_pp_baseline", "grpo_passk"])
def test_all_equal_rewards_give_zero(name):
    r, m = outcome([0.7, 0.7, 0.7, 0.7])
    a, _ = adv.ESTIMATORS[name](r, m, torch.tensor([3, 3, 3, 3]))  # s - mean_g = 0 in every formula
    torch.testing.assert_close(a, torch.zeros_like(a), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_pp_baseline", "grpo_passk"])
def test_fully_masked_row_is_zero_and_finite(name):
    r, m = outcome([1.0, 0.0, 0.5], mask=[[1, 1, 1], [0, 0, 0], [1, 1, 0]])
    a, ret = adv.ESTIMATORS[name](r, m, torch.tensor([0, 0, 0]))
    assert torch.isfinite(a).all() and torch.isfinite(ret).all()
    assert (a[1] == 0).all()


# ---------------------------------------------------------------- loop reference vs vectorised


def random_case(seed, b=24, t_len=7):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(b, t_len, generator=gen, dtype=F64)
    lengths = torch.randint(0, t_len + 1, (b,), generator=gen)
    m = (torch.arange(t_len)[None] < lengths[:, None]).to(F64)
    m[torch.rand(b, t_len, generator=gen) < 0.15] = 0  # observation tokens in the middle
    r = torch.where(m > 0, r, torch.zeros_like(r))  # verl's pipelines hold no reward off the response
    raw_ids = torch.randint(0, 6, (b,), generator=gen)
    ids = raw_ids * 1000 - 37  # non-contiguous, negative, unsorted labels; singletons likely
    if seed % 3 == 0:
        r = torch.where(
            m > 0, torch.randint(0, 2, (b, t_len), generator=gen).to(F64), r
        )  # binary rewards, ties
    return r, m, ids


GROUPED = {
    "grpo": (adv.grpo, ref.grpo),
    "rloo": (adv.rloo, ref.rloo),
    "opo": (adv.opo, ref.opo),
    "gpg": (adv.gpg, ref.gpg),
    "reinforce_pp_baseline": (adv.reinforce_pp_baseline, ref.reinforce_pp_baseline),
    "grpo_passk": (adv.grpo_passk, ref.grpo_passk),
}


@pytest.mark.parametrize("name", sorted(GROUPED))
@pytest.mark.parametrize("seed", range(12))
def test_grouped_estimators_match_the_loop_reference(name, seed):
    fn, reference = GROUPED[name]
    r, m, ids = random_case(seed)
    a, _ = fn(r, m, ids)
    torch.testing.assert_close(a, reference(r, m, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(12))
def test_drgrpo_matches_the_loop_reference(seed):
    r, m, ids = random_case(seed)
    a, _ = adv.grpo(r, m, ids, norm_by_std=False)
    torch.testing.assert_close(a, ref.grpo(r, m, ids, norm_by_std=False), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(12))
def test_token_level_estimators_match_the_loop_reference(seed):
    r, m, _ = random_case(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    v = torch.randn(r.shape, generator=gen, dtype=F64)
    gamma, lam = 0.5 + 0.5 * float(torch.rand(1, generator=gen, dtype=F64)), 0.9
    got, want = adv.gae(r, v, m, gamma=gamma, lam=lam), ref.gae(r, v, m, gamma=gamma, lam=lam)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for carry in (True, False):
        got = adv.reinforce_pp(r, m, gamma=gamma, carry_through_masked=carry)
        for x, y in zip(got, ref.reinforce_pp(r, m, gamma=gamma, carry=carry), strict=True):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    base = torch.randn(r.shape[0], generator=gen, dtype=F64)
    for x, y in zip(adv.remax(r, m, base), ref.remax(r, m, base), strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- properties


group_case = st.tuples(
    st.lists(st.integers(0, 4), min_size=2, max_size=20),  # group labels
    st.integers(0, 2**31 - 1),  # seed for the rewards and masks
)


def draw(labels, seed, t_len=5):
    gen = torch.Generator().manual_seed(seed)
    b = len(labels)
    r = torch.randn(b, t_len, generator=gen, dtype=F64)
    m = (torch.rand(b, t_len, generator=gen) < 0.7).to(F64)
    m[:, 0] = 1  # every row has at least one response token
    return torch.where(m > 0, r, torch.zeros_like(r)), m, torch.tensor(labels)


@settings(max_examples=40, deadline=None)
@given(group_case)
def test_group_advantages_are_zero_mean_per_group(case):
    r, m, ids = draw(*case)
    for fn in (adv.grpo, adv.rloo):
        a = fn(r, m, ids)[0][:, 0]  # every row keeps token 0
        for g in ids.unique():
            members = ids == g
            if members.sum() > 1:
                assert abs(float(a[members].mean())) < 1e-9


@settings(max_examples=40, deadline=None)
@given(group_case, st.permutations(list(range(5))), st.integers(0, 2**31 - 1))
def test_invariant_to_relabelling_and_permuting(case, relabel, perm_seed):
    r, m, ids = draw(*case)
    new_ids = torch.tensor(relabel)[ids] * 17 + 3
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(perm_seed))
    for name, (fn, _) in GROUPED.items():
        a = fn(r, m, ids)[0]
        torch.testing.assert_close(fn(r, m, new_ids)[0], a, atol=1e-9, rtol=0, msg=name)
        torch.testing.assert_close(fn(r[perm], m[perm], ids[perm])[0], a[perm], atol=1e-9, rtol=0, msg=name)


@settings(max_examples=40, deadline=None)
@given(group_case, st.sampled_from([float("nan"), float("inf"), -1e30, 5.0]))
def test_masked_positions_never_affect_outputs_or_gradients(case, junk):
    """Finite junk at masked positions never matters; NaN/inf only for the `where`-based estimators."""
    r, m, ids = draw(*case)
    dirty = torch.where(m > 0, r, torch.full_like(r, junk))
    v = torch.randn(r.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    v_dirty = torch.where(m > 0, v, torch.full_like(v, junk))
    finite = math.isfinite(junk)
    calls = {name: (lambda x, vv, fn=fn: fn(x, m, ids)) for name, (fn, _) in GROUPED.items() if finite}
    calls["gae"] = lambda x, vv: adv.gae(x, vv, m, gamma=0.9, lam=0.95)
    calls["reinforce_pp"] = lambda x, vv: adv.reinforce_pp(x, m, gamma=0.9)
    calls["reinforce_pp_carry"] = lambda x, vv: adv.reinforce_pp(x, m, carry_through_masked=True)
    if finite:
        calls["remax"] = lambda x, vv: adv.remax(x, m, vv[:, 0])
    for name, call in calls.items():
        clean_out = call(r, v)
        x = dirty.clone().requires_grad_(True)
        vv = v_dirty.clone().requires_grad_(True)
        out = call(x, vv)
        for got, want in zip(out, clean_out, strict=True):
            torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg=name)
        (out[0] * torch.linspace(0.5, 1.5, out[0].numel(), dtype=F64).view_as(out[0])).sum().backward()
        assert torch.isfinite(x.grad).all(), name
        assert (x.grad[m == 0] == 0).all(), name
        if vv.grad is not None:
            assert torch.isfinite(vv.grad).all() and (vv.grad[m == 0] == 0).all(), name


def test_estimator_table_has_every_name_and_verl_spellings():
    expected = {
        "gae", "grpo", "rloo", "opo", "gpg", "reinforce_pp", "reinforce_pp_baseline", "remax", "grpo_passk",
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "none",
    }  # fmt: skip
    assert set(adv.ESTIMATORS) == expected
    assert adv.ESTIMATORS["reinforce_plus_plus"] is adv.reinforce_pp


def test_none_gives_zero_advantages_and_returns():
    r, m = torch.tensor([[0.0, 2.0], [1.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    a, ret = adv.ESTIMATORS["none"](r, m)
    assert a.tolist() == [[0.0, 0.0], [0.0, 0.0]] and ret.tolist() == a.tolist()


def _call(name, r, m, ids, v):
    """Each estimator with the inputs its API signature asks for (API.md section 1)."""
    fn = adv.ESTIMATORS[name]
    if name == "gae":
        return fn(r, v, m, gamma=0.99, lam=0.95)
    if name in ("reinforce_pp", "reinforce_plus_plus"):
        return fn(r, m, gamma=0.99)
    if name == "remax":
        return fn(r, m, v[:, 0])
    return fn(r, m, ids)


@pytest.mark.parametrize("name", sorted(set(adv.ESTIMATORS) - {"none"}))  # (none: zeros, tested above)
def test_every_estimator_runs_on_the_same_batch(name):
    r, m, ids = random_case(5)
    v = torch.randn(r.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    a, ret = _call(name, r, m, ids, v)
    assert a.shape == ret.shape == r.shape and a.dtype == ret.dtype == F64
    assert torch.isfinite(a).all() and torch.isfinite(ret).all()
    assert (a[m == 0] == 0).all() and (ret[m == 0] == 0).all()  # masked positions are 0 in outputs
    assert a.abs().sum() > 0  # a real advantage, not a zero stub
    r32, m32, v32 = r.float(), m.float(), v.float()
    a32, _ = _call(name, r32, m32, ids, v32)
    assert a32.dtype == torch.float32
    torch.testing.assert_close(a32.double(), a, atol=1e-4, rtol=0)  # float32 agrees with float64
