"""Tensor-parallel layer plans: which submodule of a decoder layer is split how (`rlcore.dist.tp` applies
them; a model family names its plan in its record, `rlcore.models.families`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

LayerPlan = Mapping[str, Callable[[], ParallelStyle]]
"""Submodule of a decoder layer -> how it is split."""


def _shared_input(**kwarg: Any) -> ParallelStyle:
    """The block's input made one replicated DTensor before its column-wise projections read it: their
    input gradients then sum locally and meet in one all-reduce per block, not one per projection."""
    if kwarg:
        return PrepareModuleInput(
            input_kwarg_layouts=kwarg, desired_input_kwarg_layouts=kwarg, use_local_output=False
        )
    return PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )


LLAMA_LAYER_PLAN: LayerPlan = {
    "self_attn": functools.partial(_shared_input, hidden_states=Replicate()),  # called with hidden_states=
    "mlp": _shared_input,
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}
"""The Llama layer: q/k/v and gate/up column-wise, o and down row-wise."""

_PER_HEAD_NORM = functools.partial(SequenceParallel, sequence_dim=2, use_local_output=True)
"""A norm over each local head (b, s, heads, head_dim): its weight a replicated DTensor, so the partial
gradients of the tp ranks' heads are summed."""

QWEN3_LAYER_PLAN: LayerPlan = {
    **LLAMA_LAYER_PLAN, "self_attn.q_norm": _PER_HEAD_NORM, "self_attn.k_norm": _PER_HEAD_NORM,
}  # fmt: skip
"""The Llama layer with Qwen3's per-head q/k norms."""
