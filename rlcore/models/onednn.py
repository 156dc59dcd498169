"""oneDNN's packed linear products on CPU: a weight reordered once into oneDNN's blocked layout, then
multiplied without the per-call repacking MKL's sgemm does (which at a few dozen rows costs more than the
product). Used by the lean decode step (`rlcore.rollout.native.lean.pack_weights`) and by exact mode
(`rlcore.models.exact`), whose trainer and engine both multiply through it.

    if can_pack(w):
        packed = pack(w)                       # a copy of w in oneDNN's layout (an opaque mkldnn tensor)
        y = packed_linear(x, packed, bias)     # x (m, K) -> (m, N), x W^T + bias
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def can_pack(weight: Tensor) -> bool:
    """Whether a weight can be packed: a CPU weight in float32, or in bfloat16 where oneDNN has bf16
    kernels for this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has none and samples
    with the plain products), and a oneDNN build."""
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _bf16_kernels()))
    )


@functools.cache
def _bf16_kernels() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: Tensor) -> Tensor:
    """(N, K) weight -> its copy in oneDNN's layout (`can_pack(weight)` must hold)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x (m, K) times a `pack`ed weight, plus bias: (m, N)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def cpu_isa() -> str:
    """This CPU's widest matrix instructions as a user reads them in `lscpu` (AMX-BF16, AVX512-BF16, AVX-512,
    AVX2, or the machine's name), with oneDNN's cap when `ONEDNN_MAX_CPU_ISA` sets one: what a product's
    kernel choice follows."""
    import os
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    names = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX-512", "avx2": "AVX2"}
    isa = next((name for flag, name in names.items() if flag in flags), platform.machine() or "unknown CPU")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{isa}, ONEDNN_MAX_CPU_ISA={cap}" if cap else isa
