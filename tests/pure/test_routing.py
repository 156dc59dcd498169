"""Mixture-of-experts routing math, by hand and against Hugging Face's load-balancing loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.pure.routing import load_balancing_loss, replay_gates, route_agreement, router_stats, top_experts


def test_replay_gates_by_hand():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])  # probabilities 1/8, 2/8, 5/8
    experts = torch.tensor([[0, 1]])  # not the router's own top-2 (2, 1)
    assert torch.allclose(replay_gates(logits, experts, normalize=False), torch.tensor([[1 / 8, 2 / 8]]))
    assert torch.allclose(replay_gates(logits, experts, normalize=True), torch.tensor([[1 / 3, 2 / 3]]))
    assert top_experts(logits, 2).tolist() == [[2, 1]]


def test_route_agreement_counts_sets_on_masked_recorded_tokens():
    natural = torch.tensor(
        [[[0, 1], [2, 3]], [[1, 0], [2, 3]], [[0, 1], [0, 1]], [[5, 6], [5, 6]]]
    )  # (N=4, L=2, k=2)
    recorded = torch.tensor([[[1, 0], [3, 1]], [[0, 1], [3, 2]], [[0, 2], [1, 0]], [[-1, -1], [-1, -1]]])
    mask = torch.tensor([1, 1, 1, 1])
    # layer 0: tokens 0, 1 agree (order ignored), 2 does not, 3 has no record -> 2/3
    # layer 1: token 0 does not (3, 1 vs 2, 3), tokens 1, 2 agree -> 2/3
    assert torch.allclose(route_agreement(natural, recorded, mask), torch.tensor([2 / 3, 2 / 3]))
    mask = torch.tensor([1, 0, 0, 1])  # token 0 only
    assert route_agreement(natural, recorded, mask).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_is_the_models_own(masked):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    layers, batch, seq, experts, k = 3, 2, 5, 6, 2
    logits = torch.randn(layers, batch * seq, experts, generator=g)
    attention = torch.ones(batch, seq, dtype=torch.long)
    if masked:
        attention[0, :2] = 0
    ours = load_balancing_loss(logits, top_k=k, mask=attention.reshape(-1))
    theirs = load_balancing_loss_func(tuple(logits), experts, k, attention if masked else None)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_balanced_routing_costs_k_and_gradients_reach_the_router():
    # every token spread evenly: f_e = k / E, P_e = 1 / E -> E * E * (k / E) * (1 / E) = k
    logits = torch.zeros(1, 4, 4, requires_grad=True)
    logits.data[0] = torch.eye(4) * 1e-3  # token i leans to expert i: each expert takes one token
    loss = load_balancing_loss(logits, top_k=1, mask=torch.ones(4))
    assert torch.allclose(loss, torch.tensor(1.0), atol=1e-3)
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_router_stats_by_hand():
    logits = torch.zeros(2, 3, 4)  # uniform router: entropy log 4
    experts = torch.tensor([[[0], [0], [1]], [[2], [3], [1]]])  # (L=2, N=3, k=1)
    stats = router_stats(logits, experts, torch.ones(3))
    assert torch.allclose(stats["entropy"], torch.tensor(math.log(4.0)))
    # layer 0: loads (2, 1, 0, 0), mean 3/4 -> 8/3; layer 1: (0, 1, 1, 1) -> 4/3
    assert torch.allclose(stats["load_max_over_mean"], torch.tensor(8 / 3))
    assert torch.allclose(stats["load_max_over_mean_avg"], torch.tensor(2.0))
