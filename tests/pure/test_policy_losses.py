"""Policy losses: hand values on one tiny batch, clip_cov / kl_cov token selection, properties, the table.

The tiny batch (2 rows x 3 tokens, the last token of row 1 masked) is written once below; each
expected value is derived from it by hand, symbolically, with a comment saying how.
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.pure import losses as L
from rlcore.pure.masks import masked_mean

F64 = torch.float64
ATOL = 1e-6
e = math.exp

# the tiny batch: log-ratios d = logprob - old_logprob, advantages 1 (row 0) and -0.5 (row 1)
LOGPROB = [[-1.0, -0.5, -2.0], [-0.7, -1.2, -3.0]]
LOG_RATIO = [[0.15, -0.3, 0.25], [-0.3, -0.4, 7.0]]  # 7.0 sits on the masked token
A0, A1 = 1.0, -0.5


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def tiny():
    lp = t64(LOGPROB)
    return (
        lp.clone().requires_grad_(),
        lp - t64(LOG_RATIO),
        t64([[A0] * 3, [A1] * 3]),
        t64([[1, 1, 1], [1, 1, 0]]),
    )


# ---------------------------------------------------------------- hand-derived values


def test_cispo_by_hand():
    lp, old, adv, m = tiny()
    loss, metrics = L.cispo(lp, old, adv, m)
    # clip(r) in [0.8, 1.2]: e^.15 = 1.16 stays; e^-.3, e^-.4 -> 0.8; e^.25 = 1.28 -> 1.2
    w = [[e(0.15), 0.8, 1.2], [0.8, 0.8, 0.0]]
    p = LOGPROB
    expected = (
        -(
            A0 * (w[0][0] * p[0][0] + w[0][1] * p[0][1] + w[0][2] * p[0][2])
            + A1 * (0.8 * p[1][0] + 0.8 * p[1][1])
        )
        / 5
    )
    close(loss, expected)  # token-mean of -sg(clip(r)) A logprob
    close(metrics["pg_clipfrac"], 4 / 5)  # all kept tokens but (0, 0) fall outside [0.8, 1.2]
    close(metrics["ppo_kl"], -(0.15 - 0.3 + 0.25 - 0.3 - 0.4) / 5)
    loss.backward()
    close(lp.grad, -t64([[A0 * x for x in w[0]], [A1 * x for x in w[1]]]) / 5)  # every token keeps a gradient


def test_gpg_by_hand():
    lp, old, adv, m = tiny()
    loss, metrics = L.gpg(lp, old, adv, m)
    p = LOGPROB
    close(
        loss, -(A0 * (p[0][0] + p[0][1] + p[0][2]) + A1 * (p[1][0] + p[1][1])) / 5
    )  # token-mean of -A logprob
    assert metrics == {}
    loss.backward()
    close(lp.grad, t64([[-A0] * 3, [-A1, -A1, 0.0]]) / 5)


def test_sapo_by_hand():
    lp, old, adv, m = tiny()
    loss, metrics = L.sapo(lp, old, adv, m, agg="token-sum")  # agg ignored: seq-mean-token-mean

    def gate(d, tau):  # sigmoid(tau (r - 1)) * 4 / tau
        return 4 / tau / (1 + e(-tau * (e(d) - 1)))

    row0 = sum(-A0 * gate(d, 1.0) for d in LOG_RATIO[0]) / 3  # A > 0: tau_pos = 1
    row1 = sum(-A1 * gate(d, 1.05) for d in LOG_RATIO[1][:2]) / 2  # A < 0: tau_neg = 1.05
    close(loss, (row0 + row1) / 2)
    close(metrics["pg_clipfrac"], 0.0)
    loss2, _ = L.sapo(lp, old, adv, m, tau_pos=2.0, tau_neg=3.0)
    close(
        loss2,
        (
            sum(-A0 * gate(d, 2.0) for d in LOG_RATIO[0]) / 3
            + sum(-A1 * gate(d, 3.0) for d in LOG_RATIO[1][:2]) / 2
        )
        / 2,
    )


def test_geo_mean_by_hand():
    lp, old, adv, m = tiny()
    loss, metrics = L.geo_mean(lp, old, adv, m, agg="token-sum")  # agg ignored: mean over rows
    # row 0 (A > 0): min(d, clip(d, -0.2, 0.2)) = (0.15, -0.3, 0.2); ratio = exp(mean)
    # row 1 (A < 0): max(d, clip(d)) = (-0.2, -0.2); ratio = exp(-0.2)
    r0, r1 = e((0.15 - 0.3 + 0.2) / 3), e((-0.2 - 0.2) / 2)
    close(loss, (-A0 * r0 - A1 * r1) / 2)
    close(metrics["pg_clipfrac"], 2 / 5)  # (0, 1) and (0, 2) clipped with A > 0
    close(metrics["pg_clipfrac_lower"], 2 / 5)  # (1, 0) and (1, 1) clipped with A < 0
    close(metrics["ppo_kl"], -(0.15 - 0.3 + 0.25 - 0.3 - 0.4) / 5)
    loss.backward()
    # tokens whose own d was kept by the min/max carry gradient -A ratio / n_row / 2 rows:
    # (0, 0) and (0, 1) (min(-0.3, -0.2) keeps d); the clipped values (0, 2), (1, 0), (1, 1) do not
    close(lp.grad, t64([[-A0 * r0 / 3 / 2, -A0 * r0 / 3 / 2, 0.0], [0.0, 0.0, 0.0]]))
    w = t64([[2.0, 0.5, 4.0], [9.0, 1.0, 7.0]])  # per row: geometric mean of the kept weights
    loss_w, _ = L.geo_mean(lp, old, adv, m, is_weights=w)
    close(loss_w, (-A0 * r0 * (2.0 * 0.5 * 4.0) ** (1 / 3) - A1 * r1 * (9.0 * 1.0) ** (1 / 2)) / 2)
    loss_n, _ = L.geo_mean(lp, old, adv, m, num_seqs=5)  # a global row count replaces verl's local mean
    close(loss_n, (-A0 * r0 - A1 * r1) / 5)


def test_gspo_weights_multiply_the_clipped_token_loss():
    lp, old, adv, m = tiny()
    s0 = e((0.15 - 0.3 + 0.25) / 3)  # row 0's sequence ratio (inside the clip range)
    w = t64([[2.0, 0.5, 4.0], [3.0, 1.0, 7.0]])
    loss, _ = L.gspo(lp, old, adv, m, is_weights=w, agg="seq-mean-token-mean")
    # row 1: s1 = e^-.35 < 0.8 with A < 0, so each token's loss is -A1 * 0.8 = 0.4
    close(loss, ((-A0 * s0) * (2.0 + 0.5 + 4.0) / 3 + 0.4 * (3.0 + 1.0) / 2) / 2)


def test_kl_cov_by_hand():
    lp, old, adv, m = tiny()
    loss, metrics = L.kl_cov(lp, old, adv, m)
    # mean A = (3 * 1 - 2 * 0.5) / 5 = 0.4; mean logprob = -5.4 / 5 = -1.08
    # cov = (A - 0.4)(logprob + 1.08) = .6*.08, .6*.58, .6*-.92, -.9*.38, -.9*-.12: largest is (0, 1)
    # k = max(1, int(0.0002 * 5)) = 1: (0, 1) gets + 0.1 |d| = 0.1 * 0.3
    pg = -A0 * (e(0.15) + e(-0.3) + e(0.25)) - A1 * (e(-0.3) + e(-0.4))
    close(loss, (pg + 0.1 * 0.3) / 5)
    close(metrics["ppo_kl"], (0.15 + 0.3 + 0.25 + 0.3 + 0.4) / 5)  # mean |d|, verl's kl_cov metric
    loss2, _ = L.kl_cov(lp, old, adv, m, kl_cov_ratio=0.4, ppo_kl_coef=2.0)  # k = 2: (0, 1) and (1, 1)
    close(loss2, (pg + 2.0 * (0.3 + 0.4)) / 5)


def test_clip_cov_by_hand():
    lp, old, adv, m = tiny()
    # PPO clip without the dual clip: -e^.15, -e^-.3, -1.2 (clipped), 0.4, 0.4 (both clipped)
    ppo = [-e(0.15), -e(-0.3), -1.2, 0.4, 0.4]
    loss, metrics = L.clip_cov(lp, old, adv, m)  # no cov in (1, 5): nothing is detached
    close(loss, sum(ppo) / 5)
    close(metrics["pg_clipfrac"], 0.0)
    # lower bound 0.3: only (0, 1) (cov .348, not clipped by PPO) is eligible; k = 1 drops it
    loss2, metrics2 = L.clip_cov(lp, old, adv, m, clip_cov_lb=0.3)
    close(loss2, (ppo[0] + ppo[2] + ppo[3] + ppo[4]) / 5)
    close(metrics2["pg_clipfrac"], 1 / 5)
    loss2.backward()
    close(lp.grad, t64([[-A0 * e(0.15), 0.0, 0.0], [0.0, 0.0, 0.0]]) / 5)
    # lower bound 0: cov > 0 at (0, 0) .048, (0, 1) .348 and (1, 1) .108, but (1, 1) is already
    # clipped by PPO, so it is not eligible; k = int(0.6 * 5) = 3 covers both eligible tokens
    loss3, metrics3 = L.clip_cov(lp, old, adv, m, clip_cov_lb=0.0, clip_cov_ratio=0.6)
    close(loss3, (ppo[2] + ppo[3] + ppo[4]) / 5)
    close(metrics3["pg_clipfrac"], 2 / 5)


# ---------------------------------------------------------------- clip_cov / kl_cov selection


def cov_batch():
    g = torch.Generator().manual_seed(3)
    lp = -6 * torch.rand(4, 8, generator=g, dtype=F64)
    adv = t64([1.0, 1.0, -1.0, -1.0])[:, None].expand(4, 8)
    mask = torch.ones(4, 8, dtype=F64)
    mask[3, 5:] = 0  # 29 kept tokens
    return lp, adv, mask


def eligible_loop(lp, adv, mask, lb, ub):
    """verl's eligible set for clip_cov when old_logprob == logprob (ratio 1: nothing is PPO-clipped)."""
    n = float(mask.sum()) + 1e-8
    mean_a, mean_lp = float((adv * mask).sum()) / n, float((lp * mask).sum()) / n
    out = set()
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            cov = (float(adv[i, j]) - mean_a) * (float(lp[i, j]) - mean_lp)
            if mask[i, j] and lb < cov < ub:
                out.add((i, j))
    return out


def dropped_set(lp, adv, mask, **kw):
    """Tokens clip_cov detached: with ratio 1 they are exactly the kept tokens left without gradient."""
    x = lp.clone().requires_grad_()
    loss, metrics = L.clip_cov(x, lp, adv, mask, **kw)
    loss.backward()
    out = {(i, j) for i, j in (x.grad == 0).nonzero().tolist() if mask[i, j]}
    close(metrics["pg_clipfrac"], len(out) / float(mask.sum()))
    return out


def test_clip_cov_samples_k_eligible_tokens_uniformly_from_its_generator():
    lp, adv, mask = cov_batch()
    eligible = eligible_loop(lp, adv, mask, 1.0, 5.0)
    k = max(1, int(0.15 * 29))  # = 4 (7 tokens are eligible)
    assert len(eligible) > k  # precondition of this test's data
    counts = dict.fromkeys(eligible, 0)
    draws = 300
    for seed in range(draws):
        picked = dropped_set(
            lp, adv, mask, clip_cov_ratio=0.15, generator=torch.Generator().manual_seed(seed)
        )
        assert len(picked) == k and picked <= eligible
        for token in picked:
            counts[token] += 1
    for token, c in counts.items():  # each eligible token is picked with probability k / |eligible|
        assert abs(c / draws - k / len(eligible)) < 0.15, (token, c)
    same = [
        dropped_set(lp, adv, mask, clip_cov_ratio=0.15, generator=torch.Generator().manual_seed(11))
        for _ in range(2)
    ]
    assert same[0] == same[1]  # a seeded generator reproduces the sample


def test_clip_cov_takes_every_eligible_token_when_k_exceeds_them_and_spares_the_global_rng():
    lp, adv, mask = cov_batch()
    state = torch.get_rng_state()
    picked = dropped_set(lp, adv, mask, clip_cov_ratio=0.9)  # k = 26 > |eligible|; default generator
    assert picked == eligible_loop(lp, adv, mask, 1.0, 5.0)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("masked", [False, True])
def test_kl_cov_penalises_the_top_k_covariance_tokens(masked):
    lp, adv, mask = cov_batch()
    if masked:  # 18 of 32 kept: k = int(0.11 * 18) = 1 sits well below the shape's bound int(0.11 * 32) = 3
        mask[2:, 1:] = 0
    g = torch.Generator().manual_seed(5)
    adv = adv + 0.3 * torch.randn(4, 8, generator=g, dtype=F64)
    old = lp - 0.2 * torch.randn(4, 8, generator=g, dtype=F64)
    loss, _ = L.kl_cov(lp, old, adv, mask, kl_cov_ratio=0.11, ppo_kl_coef=0.5)
    valid = [(i, j) for i in range(4) for j in range(8) if mask[i, j]]  # verl: flatten, cov, topk
    a = torch.stack([adv[i, j] for i, j in valid])
    p = torch.stack([lp[i, j] for i, j in valid])
    top = torch.topk(
        (a - a.mean()) * (p - p.mean()), max(1, int(len(valid) * 0.11))
    ).indices.tolist()  # k = 3 (1 masked)
    total = 0.0
    for n, (i, j) in enumerate(valid):
        d = float(lp[i, j] - old[i, j])
        total += -float(adv[i, j]) * e(d) + (0.5 * abs(d) if n in top else 0.0)
    close(loss, total / len(valid))


# ---------------------------------------------------------------- properties


def make_batch(b, t, seed, weights):
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(b, t, generator=g, dtype=F64)
    old = lp + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, 1, generator=g, dtype=F64) + 0.5 * torch.randn(b, t, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) < 0.7).to(F64)
    w = 0.5 + torch.rand(b, t, generator=g, dtype=F64) if weights else None
    return lp, old, adv, mask, w


def global_counts(mask):
    return {
        "num_tokens": mask.sum().clamp(min=1.0),
        "num_seqs": (mask.sum(-1) > 0).sum().clamp(min=1),
        "horizon": mask.shape[-1],
    }


parts_of = st.integers(2, 6).flatmap(
    lambda b: st.tuples(st.just(b), st.lists(st.integers(1, b - 1), min_size=1, max_size=3, unique=True))
)
DECOMPOSABLE = ["ppo_clip", "gspo", "cispo", "gpg", "sapo", "geo_mean"]


def run(fn, lp, old, adv, mask, w, **kw):
    x = lp.clone().requires_grad_()
    loss = fn(x, old, adv, mask, is_weights=w, **kw)[0]
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("name", DECOMPOSABLE)
@settings(max_examples=25, deadline=None)
@given(rows=parts_of, t=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), weights=st.booleans())
def test_parts_with_global_counts_sum_to_the_whole_batch(name, rows, t, seed, weights):
    (b, cuts), fn = rows, L.POLICY_LOSSES[name]
    lp, old, adv, mask, w = make_batch(b, t, seed, weights)
    bounds = [0, *sorted(cuts), b]
    counts = global_counts(mask)
    for mode in L.AGG_MODES:
        whole, whole_grad = run(fn, lp, old, adv, mask, w, agg=mode, **counts)
        x = lp.clone().requires_grad_()
        total = sum(
            fn(
                x[s:e_],
                old[s:e_],
                adv[s:e_],
                mask[s:e_],
                agg=mode,
                is_weights=None if w is None else w[s:e_],
                **counts,
            )[0]
            for s, e_ in itertools.pairwise(bounds)
        )
        total.backward()
        close(total, whole)
        close(x.grad, whole_grad)


@settings(max_examples=40, deadline=None)
@given(rows=parts_of, t=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_aggregate_parts_with_global_counts_sum_to_the_whole(rows, t, seed):
    (b, cuts) = rows
    loss_mat, _, _, mask, _ = make_batch(b, t, seed, False)
    bounds = [0, *sorted(cuts), b]
    for mode in L.AGG_MODES:
        whole = L.aggregate(loss_mat, mask, mode, **global_counts(mask))
        parts = [
            L.aggregate(loss_mat[s:e_], mask[s:e_], mode, **global_counts(mask))
            for s, e_ in itertools.pairwise(bounds)
        ]
        close(sum(parts), whole)


GARBAGE = {"random": None, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def soil(x, mask, kind, g):
    """x with its masked positions replaced by garbage of the given kind."""
    junk = (
        100 * torch.randn(x.shape, generator=g, dtype=F64)
        if GARBAGE[kind] is None
        else torch.full_like(x, GARBAGE[kind])
    )
    return torch.where(mask > 0, x, junk)


def call(name, *args, **kw):
    if name == "value_loss":
        return L.value_loss(*args, agg=kw["agg"])
    return L.POLICY_LOSSES[name](*args, **kw)


@pytest.mark.parametrize("name", [*L.POLICY_LOSSES, "value_loss"])
@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(list(GARBAGE)),
    mode=st.sampled_from(L.AGG_MODES),
)
def test_masked_positions_never_matter(name, b, t, seed, kind, mode):
    lp, old, adv, mask, w = make_batch(b, t, seed, True)
    g = torch.Generator().manual_seed(seed)
    dirty = [soil(x, mask, kind, g) for x in (lp, old, adv, w)]
    results = []
    for tensors in ([lp, old, adv, w], dirty):
        x = tensors[0].clone().requires_grad_()
        kw = {"agg": mode} if name == "value_loss" else {"agg": mode, "is_weights": tensors[3]}
        loss, metrics = call(name, x, *tensors[1:3], mask, **kw)
        loss.backward()
        results.append((loss, metrics, x.grad))
    (clean_loss, clean_metrics, clean_grad), (loss, metrics, grad) = results
    close(loss, clean_loss, atol=1e-12)
    for key, value in clean_metrics.items():
        close(metrics[key], value, atol=1e-12)
    close(grad, torch.where(mask > 0, clean_grad, 0.0), atol=1e-12)  # kept: unchanged; masked: exactly 0


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 5), t=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_ppo_clip_with_ratio_one_is_minus_the_masked_mean_advantage(b, t, seed):
    lp, _, adv, mask, _ = make_batch(b, t, seed, False)
    loss, _ = L.ppo_clip(lp, lp.clone(), adv, mask, agg="token-mean")
    close(loss, -masked_mean(adv, mask))


# ---------------------------------------------------------------- the table

COMMON = {"agg", "clip_low", "clip_high", "is_weights", "num_tokens", "num_seqs", "horizon"}


def test_table_names_and_aliases():
    assert set(L.POLICY_LOSSES) == {
        "ppo_clip",
        "vanilla",
        "gspo",
        "cispo",
        "gpg",
        "sapo",
        "geo_mean",
        "clip_cov",
        "kl_cov",
    }
    assert L.POLICY_LOSSES["vanilla"] is L.POLICY_LOSSES["ppo_clip"] is L.ppo_clip


@pytest.mark.parametrize("name", list(L.POLICY_LOSSES))
def test_every_entry_shares_the_signature_and_behaves(name):
    fn = L.POLICY_LOSSES[name]
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:4]] == ["logprob", "old_logprob", "advantages", "response_mask"]
    assert {p.name for p in params if p.kind is p.KEYWORD_ONLY} >= COMMON
    lp, old, adv, mask, _ = make_batch(4, 5, 123, False)
    lp, old = lp * 2, old - 0.5  # enough spread that the clip branches are used
    common = {
        "agg": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "num_tokens": None,
        "num_seqs": None,
        "horizon": None,
    }
    x = lp.clone().requires_grad_()
    loss, metrics = fn(x, old, adv, mask, is_weights=None, **common)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    assert torch.isfinite(x.grad).all()
    ones, _ = fn(lp, old, adv, mask, is_weights=torch.ones_like(lp), **common)
    close(ones, loss.detach(), atol=1e-9)  # geo_mean's 1e-10 inside the log moves it by ~1e-10
    with pytest.raises(ValueError, match="token-means"):
        fn(lp, old, adv, mask, agg="token-means")
