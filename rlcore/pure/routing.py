"""Mixture-of-experts routing math: replayed gates, routing agreement, load balance, router metrics.

    gates = replay_gates(router_logits, experts, normalize=True)     # (N, k): R3's gate weights
    agree = route_agreement(natural, recorded, mask)                  # (L,) per layer
    aux = load_balancing_loss(router_logits, top_k=2, mask=mask)      # the Switch / HF auxiliary loss
    stats = router_stats(router_logits, experts, mask)                # entropy, load max / mean

Shapes: N tokens (a forward's flattened rows x columns), E experts, k experts per token, L MoE
layers. Router logits are per layer `(N, E)` (stacked `(L, N, E)`), expert choices `(N, k)` long.
`mask` (N,) weights the tokens (1 real, 0 padding).

Rollout routing replay (R3, Ma et al. 2025, arXiv 2510.11370; verl's `router_replay` R3 mode): the
trainer routes each token to the experts the inference engine chose, and takes their gate weights from
its own router: softmax over all E logits, gathered at the recorded experts, renormalised over the k
when the model renormalises its top-k (Qwen3-MoE and OLMoE with `norm_topk_prob`, Mixtral always).
With the recorded experts equal to the router's own top-k this is exactly the model's own gating, and
the router still gets gradients through the gathered probabilities.
"""

from __future__ import annotations

import torch
from torch import Tensor


def replay_gates(router_logits: Tensor, experts: Tensor, *, normalize: bool, over_chosen: bool = False) -> Tensor:
    """Gate weights (N, k) of `experts` (N, k) under `router_logits` (N, E): p = softmax(logits) in float32
    gathered at the experts, divided by their sum when `normalize`; with `over_chosen` the softmax of the
    chosen experts' logits alone, in the logits' dtype (gpt-oss's router: the same value as normalising,
    computed as that router computes it, so a replay of its own choice changes no bit)."""
    if over_chosen:
        return torch.softmax(router_logits.gather(-1, experts), dim=-1, dtype=router_logits.dtype)
    probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E)
    gates = probs.gather(-1, experts)  # (N, k)
    return gates / gates.sum(dim=-1, keepdim=True) if normalize else gates


def top_experts(router_logits: Tensor, k: int) -> Tensor:
    """The router's own choice (N, k): the top-k experts by softmax probability (= by logit)."""
    return torch.topk(torch.softmax(router_logits.float(), dim=-1), k, dim=-1).indices


def route_agreement(natural: Tensor, recorded: Tensor, mask: Tensor) -> Tensor:
    """Per layer (L,) float32: the share of masked tokens whose expert set is the same in `natural` and
    `recorded` (N, L, k); order within the k does not matter. Tokens with a recorded -1 (no record)
    are left out. 1.0 where no token counts."""
    same = (natural.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)  # (N, L)
    weight = (mask[:, None] != 0) & (recorded >= 0).all(dim=-1)  # (N, L)
    counted = weight.sum(dim=0)  # (L,)
    agree = (same & weight).sum(dim=0)
    return torch.where(counted > 0, agree / counted.clamp(min=1), 1.0).float()


def load_balancing_loss(router_logits: Tensor, *, top_k: int, mask: Tensor) -> Tensor:
    """The auxiliary load-balancing loss (Switch Transformer eq. 4-6, as Hugging Face's MoE models
    compute it): E * sum_e f_e * P_e, where f_e is the mean over layers and masked tokens of the
    number of top-k slots expert e takes, and P_e the mean router probability of e; differentiable
    through P. `router_logits` (L, N, E), `mask` (N,). Uses the router's own top-k (not a replay)."""
    num_layers, _, num_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)  # (L, N, E)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (L, N, k)
    weight = (mask != 0).float()  # (N,)
    slots = torch.zeros_like(probs).scatter_(-1, chosen, 1.0)  # (L, N, E)
    tokens = (weight.sum() * num_layers).clamp(min=1.0)
    fraction = (slots.detach() * weight[None, :, None]).sum(dim=(0, 1)) / tokens  # (E,)
    probability = (probs * weight[None, :, None]).sum(dim=(0, 1)) / tokens  # (E,)
    return num_experts * (fraction * probability).sum()


def router_stats(router_logits: Tensor, experts: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Router metrics over the masked tokens: `entropy` (mean over tokens and layers of the router's
    entropy, nats), `load_max_over_mean` (the busiest expert's slots over the mean, per layer, then the
    max over layers; 1.0 is perfectly balanced) and `load_max_over_mean_avg` (its mean over layers).
    `router_logits` (L, N, E), `experts` (L, N, k) the experts used."""
    weight = (mask != 0).float()  # (N,)
    logp = torch.log_softmax(router_logits.float(), dim=-1)  # (L, N, E)
    entropy = -(logp.exp() * logp).sum(dim=-1)  # (L, N)
    tokens = weight.sum().clamp(min=1.0)
    mean_entropy = (entropy * weight).sum(dim=-1).mean() / tokens
    load = torch.zeros_like(logp).scatter_(-1, experts, 1.0)  # (L, N, E)
    per_expert = (load * weight[None, :, None]).sum(dim=1)  # (L, E)
    ratio = per_expert.amax(dim=-1) / per_expert.mean(dim=-1).clamp(min=1e-12)  # (L,)
    return {
        "entropy": mean_entropy,
        "load_max_over_mean": ratio.max(),
        "load_max_over_mean_avg": ratio.mean(),
    }
