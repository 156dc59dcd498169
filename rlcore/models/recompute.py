"""Selective activation checkpointing (--model.selective-checkpointing): each decoder layer keeps what its
products and attention produce, and recomputes the rest of its work in the backward pass.

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": selective_contexts})

A layer's forward saves, for its backward, every intermediate of its norms (x², the mean, the reciprocal
root, the normalised x), of RoPE (the halves, the rotated copy) and of its gated MLP (the activation and the
gated product): about half of what it keeps. Under this policy only the outputs of `KEPT` (the products and
attention) are kept; everything else runs again in the backward pass from the layer's input and those. The
recomputation runs the same ops on the same inputs, so the gradients are bit for bit those without it.
Measured on SmolLM2-135M (experiments/README.md, "Selective checkpointing"): 4,764 values kept per token
and layer against 9,568; a 756-token forward and backward 4.34 against 4.18 s (full checkpointing: 5.02 s).

What is kept is a cache torch holds per layer call. A layer that changed one of those tensors in place after
keeping it would make the recomputation read the changed value; torch checks each cached tensor's version
when the backward reads it and raises ("Tensor cached during selective activation checkpoint has been
mutated") instead of computing other gradients. `matmul` of a 3-D input returns its product through
`_unsafe_view`, an alias whose version counter is its own, so that alias is kept too: a change made through it
is then seen. In-place ops on anything else are replayed, so a router's weights normalised in place, or an
accumulator made inside the layer (a mixture of experts' `zeros` then `index_add_` per expert), are rebuilt
the same way. The trainer's LoRA layers add their adapter in place into the base product's output, so the
two are refused together (`rlcore.config.compatibility`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten

KEPT = frozenset({
    # the products and attention: what costs time to recompute
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten._grouped_mm.default,
    _aten.convolution.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    # an alias of a product's output with a version counter of its own (`matmul` of a 3-D input returns one):
    # kept, so a change made through it in place is seen by torch's check (module docstring)
    _aten._unsafe_view.default,
})  # fmt: skip
"""The ops whose outputs a checkpointed layer keeps; every other op (elementwise maths, norms, softmax, routing,
casts, views, in-place updates, new tensors) runs again in backward from the layer's input and these."""


_counting: contextvars.ContextVar[Callable[[torch.Tensor], None] | None] = contextvars.ContextVar(
    "rlcore_selective_counting", default=None
)


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of `KEPT` (shown to the `counting` block around the forward, if any), recompute the
    rest."""
    if op not in KEPT:
        return CheckpointPolicy.PREFER_RECOMPUTE
    report = None if ctx.is_recompute else _counting.get()
    if report is not None:
        for kept in tree_leaves(ctx.op_output):
            if isinstance(kept, torch.Tensor):
                report(kept)
    return CheckpointPolicy.MUST_SAVE


def selective_contexts() -> tuple[Any, Any]:
    """A checkpointed call's forward and recompute contexts (`torch.utils.checkpoint`'s `context_fn`)."""
    return create_selective_checkpoint_contexts(policy)


@contextlib.contextmanager
def counting(report: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within the block, `report(tensor)` receives each output a checkpointed layer keeps for its backward,
    as it is kept (`rlcore.models.footprint.SavedBytes` counts them)."""
    token = _counting.set(report)
    try:
        yield
    finally:
        _counting.reset(token)
