"""Logit processing and sampling: temperature, min-p, top-k, top-p, and the sampled token's log-prob.

The processed distribution is built in float32, in vLLM's order:

    x = logits / temperature                           (temperature > 0; 0 means greedy, below)
    min-p:  drop v where p(v) < min_p * max_u p(u)     (p = softmax(x))
    top-k:  keep v where x(v) >= the k-th largest x    (ties with the k-th are kept)
    top-p:  keep the most likely tokens until their mass reaches top_p: drop v when the tokens
            strictly ahead of it in descending order already hold >= top_p (the first is always kept)
    q = softmax(x with dropped tokens at -inf)

Dropped tokens get probability exactly 0, so they are never sampled, and the returned log-prob of a
sampled token is `log q(token)`: the distribution it was actually drawn from. With temperature 1 and
nothing dropped this equals `rlcore.pure.logprobs.token_logprobs` on the same logits, bit for bit
(same float32 division and log-softmax), which is what makes rollout and trainer log-probs agree.
Greedy decoding (`temperature == 0`) takes the argmax and reports log-prob 0 (the argmax
distribution is a point mass). Min-p compares to the most likely token, which top-k and top-p always
keep, so its place in the order matters only relative to top-p (vLLM applies it first).

Sampling draws from `q` by inverse CDF with an explicit `torch.Generator`, never the global RNG: one
uniform per row against the row's float64 cumulative sum, the first token whose cumulative mass
exceeds it. A dropped token adds no mass, so it is never drawn. This costs one random number per row;
`torch.multinomial` draws one exponential per vocabulary entry (40 ms per step for 64 rows of a 49k
vocabulary on 2 CPU cores, 16% of a real model's rollout).

References: top-p, Holtzman et al. 2019 (https://arxiv.org/abs/1904.09751); min-p, Nguyen et al.
2024 (https://arxiv.org/abs/2407.01082).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sampling(*, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Raise a one-line ValueError naming the bad field (temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1)."""
    if not temperature >= 0:
        raise ValueError(f"sampling.temperature={temperature}: must be >= 0 (0 is greedy)")
    if top_k < 0:
        raise ValueError(f"sampling.top_k={top_k}: must be >= 0 (0 keeps every token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"sampling.top_p={top_p}: must be in (0, 1] (1 keeps every token)")
    if not 0 <= min_p <= 1:
        raise ValueError(f"sampling.min_p={min_p}: must be in [0, 1] (0 is off)")


def processed_logits(
    logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Tensor:
    """Float32 logits of the processed distribution (see the module docstring), -inf on dropped tokens.

    logits (..., v) any float dtype -> (..., v) float32; `temperature` must be > 0 here.
    x = logits / T, then min-p, top-k, top-p masks; softmax(result) is the sampling distribution q.
    """
    assert temperature > 0, "greedy decoding (temperature 0) has no processed logits; use sample_tokens"
    x = logits.float()
    x = x if temperature == 1.0 else torch.div(x, temperature)  # (..., v)
    if min_p > 0:
        probs = torch.softmax(x, dim=-1)  # (..., v)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        x = _top_p(x, top_p)
    return x


def _top_p(x: Tensor, top_p: float) -> Tensor:
    """Drop tokens whose more likely predecessors (descending order) already hold >= top_p of the mass."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # (..., v)
    sorted_p = torch.softmax(sorted_x, dim=-1)  # (..., v)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # (..., v): mass strictly ahead
    drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return x.masked_fill(drop, float("-inf"))


def processed_logprobs(
    logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Tensor:
    """log q over the vocabulary, float32 (..., v); -inf on dropped tokens. log q = log_softmax(processed logits)."""
    x = processed_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logits: Tensor,
    *,
    generator: torch.Generator | None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(tokens (b,) long, logprobs (b,) float32): one draw per row from q, and log q(token).

    logits (b, v). `temperature == 0` is greedy: tokens = argmax(logits), logprobs = 0.
    `generator` must live on the logits' device (None only for greedy).
    """
    if temperature == 0:
        tokens = logits.argmax(dim=-1)  # (b,)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    x = processed_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)  # (b, v)
    logq = torch.log_softmax(x, dim=-1)  # (b, v)
    tokens = _inverse_cdf(logq, generator)  # (b, 1)
    return tokens.squeeze(-1), logq.gather(-1, tokens).squeeze(-1)


def _inverse_cdf(logq: Tensor, generator: torch.Generator | None) -> Tensor:
    """(b, 1) long: per row, the first token whose float64 cumulative mass exceeds a uniform draw.

    u = U[0, 1) x the row's total, kept below the total, so the token found has positive mass."""
    cdf = torch.cumsum(logq.exp().double(), dim=-1)  # (b, v) non-decreasing
    total = cdf[:, -1:]  # (b, 1)
    u = torch.rand(total.shape, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)
