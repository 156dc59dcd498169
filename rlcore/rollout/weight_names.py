"""Loading named full tensors into an engine's model in place (`NativeEngine.load_weights`, and the trainer's
weight pushes, `rlcore.step.weights`).

    load_named(model, [("model.layers.0.mlp.up_proj.weight", tensor), ...])
    canonical_name("_orig_mod.module.lm_head.weight")     # "lm_head.weight"

The trainer names its tensors as its wrapped module sees them: `torch.compile` adds `_orig_mod.`, FSDP and
activation checkpointing add their wrapper parts, and a wrapper may lead with `module.`. `canonical_name`
drops those parts so a name matches the plain Hugging Face model the engine runs; `load_named` copies
each tensor into the tensor of that name and raises on a name the model lacks or a shape that differs,
so a mismatch is an error, never a silent skip.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def load_named(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy full tensors into `model`'s state in place, matched by `canonical_name`; a name it lacks or a
    shape that differs raises."""
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in named_tensors:
            key = canonical_name(name)
            if key not in targets:
                raise KeyError(f"load_weights: the engine's model has no tensor {name!r} (as {key!r})")
            target = targets[key]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's is {tuple(target.shape)}"
                )
            target.copy_(tensor)


def canonical_name(name: str) -> str:
    """A parameter name without wrapper parts (`_orig_mod.`, FSDP/checkpoint wrappers, a leading `module.`)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)
