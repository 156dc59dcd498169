"""aggregate, ppo_clip, gspo, value_loss and entropy: hand-derived values and loop references.

Expected values are written out symbolically; each comment says where the number comes from.
The other policy losses, the hypothesis properties and the table test are in test_policy_losses.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.pure import losses as L
from rlcore.pure.masks import masked_mean

F64 = torch.float64
ATOL = 1e-6


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- aggregate

# rows: 2 kept tokens, 3 kept tokens, none kept
LOSS = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = t64([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),  # masked sum / kept tokens
        ("token-sum", 1 + 2 + 4 + 5 + 6),  # masked sum
        ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 2),  # row sums / rows with a kept token
        ("seq-mean-token-mean", ((1 + 2) / (2 + 1e-8) + (4 + 5 + 6) / (3 + 1e-8)) / 2),  # row means / 2 rows
        ("seq-mean-token-sum-norm", ((1 + 2) + (4 + 5 + 6)) / 2 / 3),  # row sums / 2 rows / t (= 3)
    ],
)
def test_aggregate_by_hand_with_a_fully_masked_row(mode, expected):
    close(L.aggregate(LOSS, MASK, mode), expected)
    close(L.aggregate(LOSS, MASK.bool(), mode), expected)  # bool mask, same result
    garbage = torch.where(MASK > 0, LOSS, torch.nan)  # masked entries are never read
    close(L.aggregate(garbage, MASK, mode), expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 10),  # num_tokens = 10
        ("token-sum", 1 + 2 + 4 + 5 + 6),  # no normaliser
        ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 4),  # num_seqs = 4
        ("seq-mean-token-mean", ((1 + 2) / (2 + 1e-8) + (4 + 5 + 6) / (3 + 1e-8)) / 4),  # num_seqs = 4
        ("seq-mean-token-sum-norm", ((1 + 2) + (4 + 5 + 6)) / 4 / 7),  # num_seqs = 4, horizon = 7
    ],
)
def test_aggregate_uses_the_given_normalisers(mode, expected):
    close(L.aggregate(LOSS, MASK, mode, num_tokens=10, num_seqs=4, horizon=7), expected)
    as_tensors = {"num_tokens": torch.tensor(10), "num_seqs": t64(4.0), "horizon": torch.tensor(7)}
    close(L.aggregate(LOSS, MASK, mode, **as_tensors), expected)


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_aggregate_of_an_empty_mask_is_zero_not_nan(mode):
    loss_mat = t64([[1.0, 2.0], [3.0, 4.0]]).requires_grad_()
    out = L.aggregate(loss_mat, torch.zeros(2, 2, dtype=F64), mode)
    close(out, 0.0)
    out.backward()
    close(loss_mat.grad, torch.zeros(2, 2))


def test_aggregate_rejects_an_unknown_mode_naming_it_and_the_valid_ones():
    with pytest.raises(ValueError, match="'seq-mean'") as err:
        L.aggregate(LOSS, MASK, "seq-mean")
    assert all(mode in str(err.value) for mode in L.AGG_MODES)


# ---------------------------------------------------------------- ppo_clip by hand


def batch(log_ratios, advantages, mask=None, logprob=None):
    """Tensors with old_logprob = logprob - log_ratio, so exp(logprob - old) = exp(log_ratio)."""
    lr = t64(log_ratios)
    lp = t64(logprob) if logprob is not None else torch.full_like(lr, -1.0)
    m = torch.ones_like(lr) if mask is None else t64(mask)
    return lp.clone().requires_grad_(), lp - lr, t64(advantages), m


def test_ppo_clip_hits_every_branch():
    # A = +1 row: r = 1.1 (inside), 1.5 (clipped to 1.2), 0.5 (below 0.8 but A > 0: unclipped)
    # A = -1 row: r = 0.5 (clipped to 0.8), 1.5 (unclipped), 5.0 (dual clip at clip_c = 3)
    r = [[1.1, 1.5, 0.5], [0.5, 1.5, 5.0]]
    lp, old, adv, m = batch([[math.log(x) for x in row] for row in r], [[1.0] * 3, [-1.0] * 3])
    loss, metrics = L.ppo_clip(lp, old, adv, m)
    per_token = [-1.1, -1.2, -0.5, 0.8, 1.5, 3.0]  # max(-A r, -A clip(r)), then min(., -A * 3) for A < 0
    close(loss, sum(per_token) / 6)
    close(metrics["pg_clipfrac"], 2 / 6)  # (0, 1) and (1, 0) take the clipped branch
    close(metrics["pg_clipfrac_lower"], 1 / 6)  # (1, 2): 5 > 3 with A < 0
    close(metrics["ppo_kl"], -sum(math.log(x) for row in r for x in row) / 6)  # mean of old - new
    loss.backward()
    # d/dlogprob of -A r is -A r; clipped and dual-clipped tokens have no gradient
    close(lp.grad, t64([[-1.1, 0.0, -0.5], [0.0, 1.5, 0.0]]) / 6)


def test_ppo_clip_dual_clip_only_binds_beyond_clip_c():
    lp, old, adv, m = batch([[math.log(5.0)]], [[-1.0]])
    loss, metrics = L.ppo_clip(lp, old, adv, m, clip_c=10.0)
    close(loss, 5.0)  # -A r = 5 < -A clip_c = 10: the dual clip does not bind
    close(metrics["pg_clipfrac_lower"], 0.0)
    with pytest.raises(ValueError, match="clip_c"):
        L.ppo_clip(lp, old, adv, m, clip_c=1.0)


def test_ppo_clip_asymmetric_clip():
    # clip range [1 - 0.1, 1 + 0.3] = [0.9, 1.3]
    r = [[1.25, 1.4, 0.85], [0.85, 1.4, 1.25]]
    lp, old, adv, m = batch([[math.log(x) for x in row] for row in r], [[1.0] * 3, [-1.0] * 3])
    loss, metrics = L.ppo_clip(lp, old, adv, m, clip_low=0.1, clip_high=0.3)
    # A > 0: -1.25 (inside), -1.3 (clipped high), -0.85 (low clip does not bind for A > 0)
    # A < 0: 0.9 (clipped low), 1.4 (high clip does not bind for A < 0), 1.25 (inside)
    close(loss, (-1.25 - 1.3 - 0.85 + 0.9 + 1.4 + 1.25) / 6)
    close(metrics["pg_clipfrac"], 2 / 6)
    loss_sym, _ = L.ppo_clip(lp, old, adv, m)  # symmetric 0.2: 1.25 -> 1.2 and 0.85 -> 0.8 bind instead
    close(loss_sym, (-1.2 - 1.2 - 0.85 + 0.85 + 1.4 + 1.25) / 6)


def test_ppo_clip_on_a_masked_batch_with_is_weights():
    lp, old, adv, m = batch(
        [[0.15, -0.3, 0.25], [-0.3, -0.4, 7.0]],
        [[1.0] * 3, [-0.5] * 3],
        mask=[[1, 1, 1], [1, 1, 0]],
        logprob=[[-1.0, -0.5, -2.0], [-0.7, -1.2, -3.0]],
    )
    e = math.exp
    # row 0 (A = 1): -e^.15 (inside), -e^-.3 (0.74 < 0.8 but A > 0), -1.2 (e^.25 = 1.28 clipped)
    # row 1 (A = -0.5): 0.5 * 0.8 twice (e^-.3, e^-.4 below 0.8: clipped); (1, 2) masked
    per_token = [-e(0.15), -e(-0.3), -1.2, 0.4, 0.4]
    loss, metrics = L.ppo_clip(lp, old, adv, m)
    close(loss, sum(per_token) / 5)
    close(metrics["pg_clipfrac"], 3 / 5)
    close(metrics["ppo_kl"], -(0.15 - 0.3 + 0.25 - 0.3 - 0.4) / 5)
    w = t64([[2.0, 0.5, 3.0], [1.5, 4.0, 9.0]])
    loss_w, _ = L.ppo_clip(lp, old, adv, m, is_weights=w)  # weights multiply each token's loss
    close(loss_w, (2.0 * per_token[0] + 0.5 * per_token[1] + 3.0 * per_token[2] + 1.5 * 0.4 + 4.0 * 0.4) / 5)


# ---------------------------------------------------------------- loop references


def agg_loop(loss, mask, mode):
    """verl agg_loss, one row and one token at a time (binary mask, dp_size 1, clamped defaults)."""
    total, tokens, seqs, seq_terms = 0.0, 0, 0, 0.0
    for i in range(loss.shape[0]):
        row, n = 0.0, 0
        for j in range(loss.shape[1]):
            if mask[i, j]:
                row, n = row + loss[i, j], n + 1
        total, tokens = total + row, tokens + n
        if n > 0:
            seqs += 1
            seq_terms = seq_terms + (row / (n + 1e-8) if mode == "seq-mean-token-mean" else row)
    if mode == "token-mean":
        return total / max(tokens, 1)
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-sum-norm":
        return seq_terms / max(seqs, 1) / loss.shape[1]
    return seq_terms / max(seqs, 1)


def ppo_loop(lp, old, adv, mask, mode, clip_low, clip_high, clip_c):
    """verl compute_policy_loss_vanilla per token; returns (loss, pg_clipfrac, ppo_kl, clipfrac_lower)."""
    losses = torch.zeros(lp.shape, dtype=F64)
    clipfrac, kl, lower, n = 0.0, 0.0, 0.0, 0
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if not mask[i, j]:
                continue
            d = min(max(lp[i, j] - old[i, j], -20.0), 20.0)
            r, a = torch.exp(d), adv[i, j]
            l1, l2 = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
            clipped = torch.maximum(l1, l2)
            value = min(clipped, -a * clip_c) if a < 0 else clipped
            losses = losses.index_put((torch.tensor(i), torch.tensor(j)), value)
            clipfrac, kl, n = clipfrac + float(l2 > l1), kl - float(d.detach()), n + 1
            lower += float(a < 0 and clipped > -a * clip_c)
    n = n + 1e-8
    return agg_loop(losses, mask, mode), clipfrac / n, kl / n, lower / n


def random_batch(seed, b=None, t=None):
    g = torch.Generator().manual_seed(seed)
    b = b or int(torch.randint(1, 5, (1,), generator=g))
    t = t or int(torch.randint(1, 6, (1,), generator=g))
    lp = -3 * torch.rand(b, t, generator=g, dtype=F64)
    old = lp + 0.4 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, 1, generator=g, dtype=F64) + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) < 0.75).to(F64)
    return lp, old, adv, mask


@pytest.mark.parametrize("seed", range(30))
def test_ppo_clip_matches_a_loop_reference(seed):
    lp, old, adv, mask = random_batch(seed)
    mode = L.AGG_MODES[seed % len(L.AGG_MODES)]
    clip_low, clip_high, clip_c = (0.2, 0.28, 3.0) if seed % 2 else (0.1, 0.1, 1.5)
    x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    loss, metrics = L.ppo_clip(
        x, old, adv, mask, agg=mode, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c
    )
    ref_loss, ref_clipfrac, ref_kl, ref_lower = ppo_loop(y, old, adv, mask, mode, clip_low, clip_high, clip_c)
    close(loss, ref_loss)
    close(metrics["pg_clipfrac"], ref_clipfrac)
    close(metrics["ppo_kl"], ref_kl)
    close(metrics["pg_clipfrac_lower"], ref_lower)
    loss.backward()
    if torch.is_tensor(ref_loss) and ref_loss.requires_grad:
        ref_loss.backward()
        close(x.grad, y.grad)
    else:  # nothing kept: no gradient anywhere
        close(x.grad, torch.zeros_like(lp))


def gspo_loop(lp, old, adv, mask, clip_low, clip_high):
    """verl compute_policy_loss_gspo one row at a time: seq-mean-token-mean of the clipped loss."""
    row_means, rows = [], 0
    for i in range(lp.shape[0]):
        kept = [j for j in range(lp.shape[1]) if mask[i, j]]
        if not kept:
            continue
        log_s = sum(float(lp[i, j].detach() - old[i, j]) for j in kept) / len(kept)  # sg(log s_i)
        row = 0.0
        for j in kept:
            ratio = torch.exp(torch.clamp(lp[i, j] - lp[i, j].detach() + log_s, max=10.0))
            a = adv[i, j]
            row = row + torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
        row_means.append(row / (len(kept) + 1e-8))
        rows += 1
    return sum(row_means) / max(rows, 1)


@pytest.mark.parametrize("seed", range(30))
def test_gspo_matches_a_loop_reference(seed):
    lp, old, adv, mask = random_batch(seed)
    x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    clip_low, clip_high = (3e-4, 4e-4) if seed % 2 else (0.2, 0.2)  # GSPO's paper uses tiny ranges
    loss, _ = L.gspo(x, old, adv, mask, clip_low=clip_low, clip_high=clip_high, agg="seq-mean-token-mean")
    ref = gspo_loop(y, old, adv, mask, clip_low, clip_high)
    close(loss, ref)
    loss.backward()
    if torch.is_tensor(ref):
        ref.backward()
        close(x.grad, y.grad)


def test_gspo_by_hand_gives_every_token_its_sequence_ratio():
    lp, old, adv, m = batch(
        [[0.15, -0.3, 0.25], [-0.3, -0.4, 7.0]],
        [[1.0] * 3, [-0.5] * 3],
        mask=[[1, 1, 1], [1, 1, 0]],
        logprob=[[-1.0, -0.5, -2.0], [-0.7, -1.2, -3.0]],
    )
    s0, s1 = math.exp((0.15 - 0.3 + 0.25) / 3), math.exp((-0.3 - 0.4) / 2)  # geometric-mean ratios
    assert s1 < 0.8  # row 1's ratio is below the clip range
    token_sum, _ = L.gspo(lp, old, adv, m, agg="token-sum")  # the given aggregation (verl 0.9.1)
    close(token_sum, -3 * s0 + 2 * 0.4)
    loss, metrics = L.gspo(lp, old, adv, m, agg="seq-mean-token-mean")  # the recommended one
    # row 0: -A s0 on each token (s0 = 1.03 inside); row 1: s1 = 0.70 < 0.8, A < 0: 0.5 * 0.8 each
    close(loss, (-s0 + 0.4) / 2)
    close(metrics["pg_clipfrac"], 2 / 5)
    close(metrics["pg_clipfrac_lower"], 0.0)
    loss.backward()
    close(lp.grad, t64([[-s0 / 6] * 3, [0.0] * 3]))  # d(-A s0)/dlogprob = -A s0, / 3 tokens / 2 rows


# ---------------------------------------------------------------- value_loss


def test_value_loss_by_hand():
    values = t64([[1.0, 1.0, 0.2], [0.0, -2.0, 5.0]]).requires_grad_()
    old = torch.zeros(2, 3, dtype=F64)
    returns = t64([[2.0, 0.0, 1.0], [0.3, 0.0, 9.0]])
    m = t64([[1, 1, 1], [1, 1, 0]])
    loss, metrics = L.value_loss(values, old, returns, m, clip=0.5)
    # (0,0): v 1 -> 0.5: max((1-2)^2, (0.5-2)^2) = 2.25 (clipped is larger)
    # (0,1): max((1-0)^2, (0.5-0)^2) = 1;  (0,2): 0.2 inside: 0.8^2;  (1,0): 0.3^2
    # (1,1): v -2 -> -0.5: max(4, 0.25) = 4;  (1,2): masked
    close(loss, 0.5 * (2.25 + 1.0 + 0.64 + 0.09 + 4.0) / 5)
    close(metrics["vf_clipfrac"], 1 / 5)
    loss.backward()
    # gradient 0.5 * 2 (v - R) / 5 where the unclipped error wins, 0 where the clipped one does
    close(values.grad, t64([[0.0, 1.0, -0.8], [-0.3, -2.0, 0.0]]) / 5)


def value_loop(v, old, ret, mask, mode, clip):
    losses = torch.zeros(v.shape, dtype=F64)
    clipped, n = 0.0, 0
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            if mask[i, j]:
                vc = torch.clamp(v[i, j], old[i, j] - clip, old[i, j] + clip)
                e1, e2 = (v[i, j] - ret[i, j]) ** 2, (vc - ret[i, j]) ** 2
                losses = losses.index_put((torch.tensor(i), torch.tensor(j)), torch.maximum(e1, e2))
                clipped, n = clipped + float(e2 > e1), n + 1
    return 0.5 * agg_loop(losses, mask, mode), clipped / (n + 1e-8)


@pytest.mark.parametrize("seed", range(30))
def test_value_loss_matches_a_loop_reference(seed):
    _, _, _, mask = random_batch(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    v, old, ret = (torch.randn(mask.shape, generator=g, dtype=F64) for _ in range(3))
    mode = L.AGG_MODES[seed % len(L.AGG_MODES)]
    x, y = v.clone().requires_grad_(), v.clone().requires_grad_()
    loss, metrics = L.value_loss(x, old, ret, mask, clip=0.3, agg=mode)
    ref_loss, ref_clipfrac = value_loop(y, old, ret, mask, mode, 0.3)
    close(loss, ref_loss)
    close(metrics["vf_clipfrac"], ref_clipfrac)
    loss.backward()
    if torch.is_tensor(ref_loss) and ref_loss.requires_grad:
        ref_loss.backward()
        close(x.grad, y.grad)


# ---------------------------------------------------------------- entropy


def test_entropy_by_hand():
    logits = t64([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]])
    p = [3 / 6, 1 / 6, 1 / 6, 1 / 6]  # softmax of (log 3, 0, 0, 0)
    close(L.entropy(logits), [math.log(4.0), -sum(q * math.log(q) for q in p)])
    x = t64([[[2.0, 0.0]]])  # two classes: binary entropy of sigmoid(2)
    q = 1 / (1 + math.exp(-2.0))
    close(L.entropy(x), [[-(q * math.log(q) + (1 - q) * math.log(1 - q))]])


def test_entropy_upcasts_low_precision_logits():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = L.entropy(logits)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    torch.testing.assert_close(out, L.entropy(logits.float()), atol=0, rtol=0)
    assert L.entropy(logits.double()).dtype == F64


def test_entropy_loss_is_the_aggregated_token_entropy():
    logits = t64([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]]])  # third token masked
    m = t64([[1, 1, 0]])
    h1, h2 = math.log(2.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # p = (1/2, 1/2), (3/4, 1/4)
    close(L.entropy_loss(logits, m), (h1 + h2) / 2)
    close(L.entropy_loss(logits, m, agg="seq-mean-token-sum-norm", horizon=4), (h1 + h2) / 1 / 4)  # 1 row
    close(L.entropy_loss(logits, m, agg="token-mean", num_tokens=t64(8.0)), (h1 + h2) / 8)


def test_ppo_clip_with_ratio_one_is_the_negative_mean_advantage():
    lp, _, adv, mask = random_batch(7, b=3, t=4)
    loss, metrics = L.ppo_clip(lp, lp.clone(), adv, mask)
    close(loss, -masked_mean(adv, mask))  # r = 1 everywhere: inside the clip range, -A r = -A
    close(metrics["pg_clipfrac"], 0.0)
    close(metrics["ppo_kl"], 0.0)
