"""FSDP2 (`fully_shard`) wrapping of a Hugging Face causal LM over a data-parallel mesh.

    mesh = build_mesh(info)                                     # rlcore.dist.mesh
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16)     # on GPU: bf16 compute, fp32 master + reduce
    apply_activation_checkpointing(model)                      # optional, either way

Each decoder layer is one FSDP unit, the root (embeddings, final norm, lm_head — tied or not) is the
last. A 2-D mesh (dp_replicate, dp_shard) gives hybrid sharding: shard inside a group, replicate
across groups. Gradients are reduced as a plain SUM over ranks (`set_gradient_divide_factor(1.0)`),
not FSDP2's default average: the losses of `rlcore.step.update` are already divided by global token /
sequence counts, so the summed gradient is the gradient of the global loss whatever the world size.
With one process the trainer keeps the plain module; every helper here accepts both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model (classes named in `_no_split_modules`), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer classes (_no_split_modules); "
            "cannot wrap it layer by layer with FSDP2"
        )
    return layers


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 over `mesh` and return it (now an FSDPModule).

    `param_dtype`: compute dtype of the all-gathered parameters (None: keep the stored dtype, e.g.
    fp32 master weights stay fp32; bf16 on GPU); `reduce_dtype`: dtype of the gradient reduction.
    `reshard_after_forward` applies to the decoder layers (the root keeps its parameters between
    forward and backward, as FSDP2 advises). `cpu_offload` keeps sharded parameters, gradients and
    the optimizer state in CPU memory (GPU only; the optimizer step then runs on CPU).
    `ignored_params` stay as they are, neither sharded nor reduced (expert-parallel experts, which
    `rlcore.dist.ep` shards and reduces).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False,
                ignored_params=ignored_params)  # fmt: skip
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: the loss carries the global normaliser
            if mesh.device_type != "cuda":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def apply_activation_checkpointing(model: nn.Module, *, context_fn: Callable[[], Any] | None = None) -> nn.Module:
    """Recompute each decoder layer's activations in backward (Hugging Face's non-reentrant checkpointing):
    all of them from the layer's input, or with a `context_fn` the recomputation's contexts (selective
    checkpointing keeps its products' and attention's outputs: `rlcore.models.recompute.selective_contexts`;
    the same gradients, bit for bit).

    Parameter names are unchanged (no wrapper modules), so checkpoints and weight sync are unaffected.
    Checkpointing is active in train mode only; `update_step` switches the model to train mode.
    """
    kwargs: dict[str, object] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
        return model
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(
            f"{type(model).__name__} has no gradient_checkpointing_enable(); not a Hugging Face model"
        )
    enable(gradient_checkpointing_kwargs=kwargs)
    return model


def model_mesh(model: nn.Module) -> DeviceMesh | None:
    """The mesh `model`'s parameters are sharded over (None for a plain, unsharded module): the first
    DTensor parameter's (under tensor parallelism without FSDP2 the embeddings stay plain tensors)."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce gradients on the next backward (True) or only accumulate them locally (False); no-op unsharded."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
