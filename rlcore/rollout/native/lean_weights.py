"""The weights the lean decode step (`rlcore.rollout.native.lean`) reads: a decoder layer's tensors, read off the
module, and laid out as the step's kernels take them.

    layer = layer_tensors(module)                 # `Layer`: the module's own tensors, LoRA factors, MoE block
    layers, head = pack_weights(layers, head)     # default kernels on CPU: oneDNN-packed copies
    layers, head = exact_weights(layers, head)    # exact mode: the trainer's kernel per projection

The step reads the module's tensors at each `start`, so an optimizer step or a load between calls is
seen. Packed (`pack_weights`), each projection's weight and the head are copied once per `generate` into
oneDNN's blocked layout, which MKL's sgemm would otherwise rebuild at every product; q, k and v become
one weight, and gate and up one (unless a LoRA adapter sits on them): 4 products per layer instead of 7.
In exact mode (`exact_weights`) the same groups are fused only where `exact.stacks_exactly` checks that
the stacked product gives the unfused products' bits, so the step stays the trainer's arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlcore.models import exact
from rlcore.models.onednn import pack
from rlcore.rollout.native.lean_cover import (
    LAYER_FIELDS,
    PROJECTIONS,
    Layer,
    get,
    is_lora,
    lora_of,
    sparse_block,
)
from rlcore.rollout.native.lean_moe import as_layer_slot


def layer_tensors(module: torch.nn.Module) -> Layer:
    """The layer's tensors (`LAYER_FIELDS`), then each projection's LoRA (A, B, scale) or None, then its
    sparse MoE block or None."""
    tensors = tuple(_weight(module, field) for field in LAYER_FIELDS)
    return (*tensors, *(lora_of(get(module, path)) for path in PROJECTIONS), sparse_block(module))


def _weight(module: torch.nn.Module, field: str) -> Any:
    """The tensor at `field`; a LoRA projection's weight and bias are its base layer's."""
    path, name = field.rsplit(".", 1)
    owner = get(module, path)
    if owner is not None and is_lora(owner):
        owner = owner.base_layer
    return getattr(owner, name, None) if owner is not None else None


_PACKED_FIELDS = frozenset(i for i, f in enumerate(LAYER_FIELDS) if f.endswith("_proj.weight"))


def pack_weights(layers: tuple[Layer, ...], head: Tensor) -> tuple[tuple[Layer, ...], Tensor]:
    """Copies of the projection weights and the head in oneDNN's layout for `linear_product`
    (`rlcore.rollout.native.lean_kernels`; norms and LoRA factors stay as they are; a MoE layer's experts are
    packed per expert, `rlcore.rollout.native.lean_moe`). Without adapters on them, q, k and v become one weight
    in q's place, and gate and up one in gate's (k, v and up None): 4 products per layer instead of 7,
    on the same input."""
    packed = tuple(
        (
            *(pack(t) if i in _PACKED_FIELDS and t is not None else t for i, t in enumerate(layer[:-1])),
            as_layer_slot(layer[-1], pack),
        )
        for layer in map(_fused, layers)
    )
    return packed, pack(head)


_FUSED = tuple(
    (
        tuple(LAYER_FIELDS.index(f"{p}.weight") for p in group),
        tuple(len(LAYER_FIELDS) + PROJECTIONS.index(p) for p in group),
    )
    for group in (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    )
)
"""The projection groups `pack_weights` fuses, each into its first one's slots: (weight slots, each bias
the slot after its weight; LoRA slots)."""


def _fused(layer: Layer) -> Layer:
    """`layer` with each `_FUSED` group's weights stacked in its first projection's weight slot (biases
    likewise, an absent one among present ones as zeros; all absent: None) and the others' slots None,
    where no LoRA adapter sits on the group."""
    out = list(layer)
    for slots, adapters in _FUSED:
        if any(layer[i] is not None for i in adapters) or any(layer[i] is None for i in slots):
            continue  # adapted, or no such projections (a MoE layer's MLP)
        weights, biases = [layer[i].detach() for i in slots], [layer[i + 1] for i in slots]
        out[slots[0]] = torch.cat(weights)
        if any(b is not None for b in biases):
            zeros = [w.new_zeros(w.shape[0]) for w in weights]
            out[slots[0] + 1] = torch.cat(
                [z if b is None else b.detach() for z, b in zip(zeros, biases, strict=True)]
            )
        for i in slots[1:]:
            out[i] = out[i + 1] = None
    return tuple(out)


def exact_weights(layers: tuple[Layer, ...], head: Tensor) -> tuple[tuple[Layer, ...], Tensor]:
    """Exact mode's tensors: each layer's (`_exact_layer`), the head by `exact.packed_or_plain`."""
    return tuple(_exact_layer(layer) for layer in layers), exact.packed_or_plain(head.detach())


def _exact_layer(layer: Layer) -> Layer:
    """`layer` for exact mode's step: its projection weights by `exact.packed_or_plain` (the trainer's
    kernel), q/k/v and gate/up fused where that gives the unfused products' bits (`exact.stacks_exactly`),
    a MoE block called inside `exact.under_kernels` (the trainer's expert products)."""
    if all(_stacks_exactly(layer, slots) for slots, _ in _FUSED):
        layer = _fused(layer)
    *tensors, sparse = layer
    packed = (exact.packed_or_plain(t.detach()) if i in _PACKED_FIELDS and t is not None else t
              for i, t in enumerate(tensors))  # fmt: skip
    return (*packed, None if sparse is None else exact.under_kernels(sparse))


def _stacks_exactly(layer: Layer, slots: tuple[int, ...]) -> bool:
    weights = [layer[i] for i in slots]
    if any(w is None for w in weights):
        return True  # nothing to fuse (a MoE layer's MLP)
    w = weights[0]
    return exact.stacks_exactly(w.shape[1], tuple(t.shape[0] for t in weights), w.dtype, w.device)
