"""Plain per-sample loop references for the advantage estimators.

Each function transcribes, in the most literal way, what verl 0.9.1's loop implementation in
`core_algos.py` does for one sample or one group at a time (dicts of lists keyed by group id,
Python loops over samples and time). They are slow on purpose and serve only as the reference the
vectorised code in `rlcore.pure.advantages` is compared with. The one agreed departure, applied at
the end of each: outputs are zeroed at masked positions (see rlcore.pure.advantages).
"""

from __future__ import annotations

from collections import defaultdict

import torch


def _mask_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def whiten(x, m):
    mean = _mask_mean(x, m)
    var = _mask_mean((x - mean) ** 2, m)
    n = m.sum()
    var = var * n / max(n - 1, 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _by_group(scores, ids):
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[int(ids[i])].append(i)
    return groups


def grpo(r, m, ids, eps=1e-6, norm_by_std=True):
    scores = r.sum(-1).clone()
    out = torch.zeros_like(scores)
    for members in _by_group(scores, ids).values():
        vals = scores[members]
        mean, std = (0.0, 1.0) if len(members) == 1 else (vals.mean(), vals.std())
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out[:, None] * m


def rloo(r, m, ids):
    scores = r.sum(-1).clone()
    out = scores.clone()
    for members in _by_group(scores, ids).values():
        n = len(members)
        if n > 1:
            mean = scores[members].mean()
            for i in members:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out[:, None] * m


def opo(r, m, ids):
    scores, lengths = r.sum(-1), m.sum(-1)
    out = scores.clone()
    for members in _by_group(scores, ids).values():
        if len(members) > 1:
            base = (lengths[members] * scores[members]).sum() / lengths[members].sum()
            for i in members:
                out[i] = scores[i] - base
    return out[:, None] * m


def gpg(r, m, ids, f_norm=1.0):
    scores = r.sum(-1)
    alpha = len(scores) / max(int((scores != 0).sum()), 1)
    out = torch.zeros_like(scores)
    for members in _by_group(scores, ids).values():
        mean = 0.0 if len(members) == 1 else scores[members].mean()
        for i in members:
            out[i] = alpha * (scores[i] - mean) / f_norm
    return out[:, None] * m


def reinforce_pp_baseline(r, m, ids):
    scores = r.sum(-1).clone()
    for members in _by_group(scores, ids).values():
        mean = 0.0 if len(members) == 1 else scores[members].mean()
        for i in members:
            scores[i] = scores[i] - mean
    tiled = scores[:, None].expand(m.shape) * m
    return whiten(tiled, m) * m


def grpo_passk(r, m, ids, eps=1e-6, norm_by_std=True):
    scores = r.sum(-1)
    out = torch.zeros_like(scores)
    for members in _by_group(scores, ids).values():
        if len(members) < 2:
            continue  # verl raises here; rlcore gives 0 (documented)
        vals = scores[members]
        top = torch.topk(vals, 2)
        adv = top.values[0] - top.values[1]
        if norm_by_std:
            adv = adv / (vals.std() + eps)
        out[members[int(top.indices[0])]] = adv
    return out[:, None] * m


def gae(r, v, m, gamma=1.0, lam=1.0):
    b, t_len = r.shape
    adv = torch.zeros_like(r)
    for i in range(b):
        next_value, last = 0.0, 0.0
        for t in reversed(range(t_len)):
            delta = r[i, t] + gamma * next_value - v[i, t]
            cand = delta + gamma * lam * last
            if m[i, t] != 0:
                next_value, last = v[i, t], cand
            adv[i, t] = last
    returns = (adv + v) * m
    return whiten(adv, m) * m, returns


def reinforce_pp(r, m, gamma=1.0, carry=True):
    """verl 0.9.1 (carry: a masked position leaves the running return as it was) or older verl (reset)."""
    b, t_len = r.shape
    returns = torch.zeros_like(r)
    for i in range(b):
        running = 0.0
        for t in reversed(range(t_len)):
            new = r[i, t] + gamma * running
            returns[i, t] = new
            running = new * m[i, t] + (running * (1 - m[i, t]) if carry else 0.0)
    return whiten(returns, m) * m, returns * m


def remax(r, m, baseline):
    b, t_len = r.shape
    returns = torch.zeros_like(r)
    for i in range(b):
        acc = 0.0
        for t in reversed(range(t_len)):
            acc = acc + r[i, t] * m[i, t]
            returns[i, t] = acc
    returns = returns * m
    return returns - baseline[:, None] * m, returns
