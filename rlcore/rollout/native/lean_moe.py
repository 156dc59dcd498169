"""The lean decode step's experts: a MoE layer's router module, then its experts as oneDNN-packed products.

    packed = pack_experts(block, pack)      # None: the block keeps its own forward (see `packable`)
    out = experts_mlp(packed, h, product)   # (a, width): sum over each row's top-k of gate * expert(h)

Why: at a few rows per decode step each expert gets a handful of tokens, and its two products read the
whole expert through MKL, which repacks the weight at every call (transformers' `grouped_mm` on CPU runs
one such product per expert). Packed once per `generate` into oneDNN's layout, as `rlcore.rollout.native.lean`
packs the dense projections, the same products skip that repacking. The router is the model's own module,
called as the block calls it, so its hooks (`rlcore.models.moe`: route recording) fire unchanged.

Covered (`packable`): blocks whose forward is exactly "router, then experts" (Qwen3-MoE, Mixtral without
training jitter) over plain fused experts (`gate_up_proj` (E, 2i, h) with the gate rows first,
`down_proj` (E, h, i), act(gate) * up, as transformers 5 builds them). A shared expert (Qwen2-MoE) or an
adapter on the experts (peft wraps the experts module) keeps the block's own forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlcore.models.families import FAMILIES

PLAIN = frozenset((f.moe.lean_block, f.moe.lean_experts) for f in FAMILIES.values() if f.moe and f.moe.lean_block)
"""(sparse block class, experts class) of each family whose block's forward is the router, then experts
computing down(act(gate) * up) per expert from their fused tensors, and nothing else (`MoESpec`)."""


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """One MoE layer for the lean step: its router module and each expert's packed weights."""

    router: torch.nn.Module
    gate_up: tuple[Tensor, ...]  # E packed (2i, h)
    down: tuple[Tensor, ...]  # E packed (h, i)
    act: Callable[[Tensor], Tensor]


def packable(block: torch.nn.Module) -> bool:
    """Whether `experts_mlp` computes what `block` does (see the module docstring)."""
    return (
        (type(block).__name__, type(getattr(block, "experts", None)).__name__) in PLAIN
        and not (block.training and getattr(block, "jitter_noise", 0.0) > 0)
        and not block.experts._forward_hooks
        and not block.experts._forward_pre_hooks
    )


def pack_experts(block: torch.nn.Module, pack: Callable[[Tensor], Tensor]) -> PackedExperts | None:
    """`block`'s router and its experts' weights through `pack` (one copy per expert), or None."""
    if not packable(block):
        return None
    experts = block.experts
    return PackedExperts(
        block.gate,
        tuple(pack(w) for w in experts.gate_up_proj.detach()),
        tuple(pack(w) for w in experts.down_proj.detach()),
        experts.act_fn,
    )


def experts_mlp(packed: PackedExperts, h: Tensor, product: Callable[..., Tensor]) -> Tensor:
    """The MoE layer's output (a, width) for `h` (a, width): each row's top-k experts, gate-weighted.

    The (row, slot) pairs are sorted by expert (one host sync for the counts), each hit expert runs its
    two packed products on its rows, and the gate-weighted outputs are summed back per row."""
    _, gates, chosen = packed.router(h)  # (a, k) each; the router's hooks fire here
    k = chosen.shape[1]
    flat = chosen.reshape(-1)  # (a * k,)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(packed.down)).tolist()
    rows = order // k  # (a * k,) the row of each sorted pair
    x = h[rows]  # (a * k, width)
    out = torch.empty_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            gate, up = product(x[start : start + count], packed.gate_up[e], None).chunk(2, dim=-1)
            out[start : start + count] = product(packed.act(gate) * up, packed.down[e], None)
            start += count
    weighted = out * gates.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(h).index_add_(0, rows, weighted)


def as_layer_slot(block: torch.nn.Module | None, pack: Callable[[Tensor], Tensor]) -> Any:
    """What the packed lean step's layer holds for its MLP block: packed experts where the block is
    `packable`, else the block itself (called as a module), or None for a dense MLP."""
    return None if block is None else pack_experts(block, pack) or block
