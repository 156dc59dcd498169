"""Tensor parallelism of a Hugging Face decoder with DTensor (`parallelize_module`), Megatron style.

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    problem = tp_problem(model.config, tp)          # None, or one line naming the factor that fails
    apply_tp(model, mesh["tp"])                     # then apply_fsdp(model, mesh["dp_shard"]) composes

Per decoder layer (the Llama family: llama, mistral, qwen2, qwen3): q/k/v and gate/up are split
column-wise (each rank holds `heads / tp` attention heads, `kv_heads / tp` KV heads and `intermediate /
tp` MLP columns, and computes them on the replicated input); o and down are split row-wise, their
partial outputs summed across the tp ranks. Embeddings, norms and lm_head stay replicated, so the
logits (and the log-probs of `rlcore.models.forward`) are whole on every rank. Attention reshapes with
`-1` heads, so the layers run unchanged on their local heads; Qwen3's per-head q/k norms hold their
weight as a replicated DTensor over the head-sharded input, so its gradient sums every rank's heads.
Backward all-reduces the input gradients of the column-wise layers (DTensor does it), so the replicated
parameters get the full gradient on every tp rank. Plans are a plain table by `config.model_type`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

LLAMA_LAYER_PLAN: dict[str, Callable[[], ParallelStyle]] = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}
"""Submodule of a decoder layer -> how it is split."""

_PER_HEAD_NORM = functools.partial(SequenceParallel, sequence_dim=2, use_local_output=True)
"""A norm over each local head (b, s, heads, head_dim): its weight a replicated DTensor, so the partial
gradients of the tp ranks' heads are summed."""

TP_PLANS: dict[str, dict[str, Callable[[], ParallelStyle]]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2"), LLAMA_LAYER_PLAN),
    "qwen3": {**LLAMA_LAYER_PLAN, "self_attn.q_norm": _PER_HEAD_NORM, "self_attn.k_norm": _PER_HEAD_NORM},
}
"""Layer plans by Hugging Face `model_type`; add an entry for another architecture."""


def tp_problem(config: Any, tp: int) -> str | None:
    """One line on why `config` cannot be split `tp` ways (None if it can)."""
    if tp == 1:
        return None
    kind = getattr(config, "model_type", None)
    if kind not in TP_PLANS:
        return f"no tensor-parallel plan for model_type {kind!r} (plans: {', '.join(sorted(TP_PLANS))})"
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name} {size}" for name, size in sizes.items() if size % tp]
    if bad:
        return f"{', '.join(bad)} not divisible by tp({tp}); use a tp that divides them"
    return None


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split every decoder layer of `model` over the 1-D `mesh` (see the module docstring), in place."""
    problem = tp_problem(model.config, mesh.size())
    if problem is not None:
        raise ValueError(problem)
    if mesh.size() == 1:
        return model
    plan = TP_PLANS[model.config.model_type]
    for layer in _layers(model):
        parallelize_module(layer, mesh, {name: style() for name, style in plan.items()})
    return model


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None) or getattr(model, "backbone", model)  # a causal LM, or a critic
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: not a Llama-family decoder")
    return list(layers)
