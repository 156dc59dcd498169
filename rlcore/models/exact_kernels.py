"""Exact mode's kernels (`rlcore.models.exact`): one matrix product for the engine and the trainer alike.

    y = product(x, packed_or_plain(w), b)    # x W^T + b, a row's result independent of the other rows
    with ExactKernels():                      # a Hugging Face forward's mm/addmm/bmm/grouped mm and SiLU
        model(...)                            #   in that batch-invariant form (`_HANDLERS`)

A kernel's bits for a row may depend on how many rows its call holds: MKL's fp32 sgemm takes another kernel
below ~15 rows, and oneDNN's bf16 kernels on a CPU with AMX block rows 7-17 otherwise than 64 or more. So
every product hands its rows to `kernel` in one layout, a `KernelRows` per dtype (`ROWS`): at least 16 rows
(zeros appended), or fixed tiles of rows, each call the same shape. Which layout holds on this CPU, for a
model's shapes, is measured before the model runs (`rlcore.models.exact_check.calibrate`). oneDNN's packed
product is row-invariant from 2 rows on AVX2 and AVX-512 CPUs (MKL's sgemm from ~15) and faster than MKL's
at every row count measured. A weight is packed once per `ExactKernels` (per forward: an optimizer step, a
load through `.data` or an FSDP all-gather may change it without a version bump). A mixture of experts'
grouped products run expert by expert through the same product. SiLU is x / (1 + exp(-x)) (exp is
position-invariant, `aten.silu`'s vectorised and scalar paths differ by an ulp).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from rlcore.models.onednn import can_pack, pack, packed_linear

MIN_ROWS = 16
"""The fewest rows a matrix product runs with in the default layout (fp32 kernels change below ~15 rows)."""

BLOCK = 16
"""Keys per block of `exact.attend`'s weighted sum (one product of inner size BLOCK each), and the
multiple a prompt's padded width is rounded to (`exact.aligned_prompt_width`)."""


@dataclasses.dataclass(frozen=True)
class KernelRows:
    """How exact mode hands a product's rows to its kernel, so that a row's bits depend on that row alone.

    `tile` None: one call on all the rows, at least `floor` of them (zeros appended). `tile` set: every call
    on exactly `tile` rows (the rows cut into tiles, the last one padded with zeros), so every call has
    the same shape whatever the row count: the layout for kernels whose blocking follows the row count."""

    floor: int = MIN_ROWS
    tile: int | None = None

    @property
    def name(self) -> str:
        return f"tiles of {self.tile} rows" if self.tile else f"at least {self.floor} rows"

    def apply(self, fn: Callable[..., Tensor], *xs: Tensor, dim: int = 0) -> Tensor:
        """fn(*xs) in this layout: `xs` share their row count along `dim` (fn's output too), and each call
        of `fn` gets their rows of one span, padded with zeros; the outputs' rows are joined back."""
        m, size = xs[0].shape[dim], self.tile or self.floor
        if m > size and self.tile is not None:
            spans = range(0, m, self.tile)
            return torch.cat([self.apply(fn, *(x.narrow(dim, lo, min(self.tile, m - lo)) for x in xs), dim=dim)
                              for lo in spans], dim=dim)  # fmt: skip
        if m >= size:
            return fn(*xs)
        return fn(*(_pad_rows(x, dim, size) for x in xs)).narrow(dim, 0, m)


DEFAULT_ROWS = KernelRows()
ROWS: dict[torch.dtype, KernelRows] = {}
"""The layout per dtype for this process (`rows_for`), set by `exact_check.calibrate` to one that it
measured row-invariant on this CPU; DEFAULT_ROWS where none was set."""


def rows_for(dtype: torch.dtype) -> KernelRows:
    """The layout products in `dtype` run in (`ROWS`)."""
    return ROWS.get(dtype, DEFAULT_ROWS)


def _pad_rows(x: Tensor, dim: int, rows: int) -> Tensor:
    """`x` with zero rows appended along `dim` up to `rows`, contiguous."""
    extra = rows - x.shape[dim]
    if extra <= 0:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def kernel(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (m, K) W^T + b: the one kernel every exact product calls, oneDNN's packed product for a packed
    weight (`packed_or_plain`), else `F.linear`."""
    return packed_linear(x, weight, bias) if weight.is_mkldnn else F.linear(x, weight, bias)


def packed_or_plain(weight: Tensor) -> Tensor:
    """`weight` in oneDNN's packed layout (`rlcore.models.onednn`: a row's result then depends on that row
    alone, from 2 rows up, and it is faster than MKL's sgemm at every row count measured), or `weight`
    itself where it does not pack or oneDNN has no kernel for its shape (`_packs`)."""
    if not can_pack(weight) or not _packs(tuple(weight.shape), weight.dtype, weight.device):
        return weight
    return pack(weight)


@functools.cache
def _packs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN has a packed kernel for such a weight (tried once on MIN_ROWS rows; e.g. a LoRA
    factor of rank 8 in bf16 has none)."""
    weight = torch.zeros(shape, dtype=dtype, device=device)
    try:
        packed_linear(weight.new_zeros((MIN_ROWS, shape[1])), pack(weight), None)
    except RuntimeError:
        return False
    return True


def stacks_exactly(k: int, widths: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `product` by weights of `widths` rows (each k wide) stacked into one gives, column for column,
    the same bits as the product by each: the lean step then fuses q/k/v and gate/up as the default step
    does, while the trainer multiplies them apart. oneDNN's reduction order over k does not depend on the
    column count (measured for every shape tried); checked here once per shape and layout, on MIN_ROWS rows
    (a row's result does not depend on the row count, `product`)."""
    return _stacks_exactly(k, widths, dtype, device, rows_for(dtype))


@functools.cache
def _stacks_exactly(k: int, widths: tuple[int, ...], dtype: torch.dtype, device: torch.device, rows: KernelRows) -> bool:
    generator = torch.Generator(device).manual_seed(0)
    weights = [torch.randn((n, k), generator=generator, device=device).to(dtype) for n in widths]
    x = torch.randn((MIN_ROWS, k), generator=generator, device=device).to(dtype)
    stacked = product(x, packed_or_plain(torch.cat(weights)))
    return torch.equal(stacked, torch.cat([product(x, packed_or_plain(w)) for w in weights], dim=-1))


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None, rows: KernelRows | None = None) -> Tensor:
    """x W^T + b, (..., K) -> (..., N): exact mode's one product, for the trainer's forward and the engine's
    step alike, its rows handed to `kernel` in the layout `rows` (default: `rows_for(x.dtype)`).
    `weight`: from `packed_or_plain`, so the same weight takes the same kernel on both sides."""
    flat = x.reshape(-1, x.shape[-1])
    out = (rows or rows_for(x.dtype)).apply(lambda r: kernel(r.contiguous(), weight, bias), flat)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def silu(x: Tensor) -> Tensor:
    """x / (1 + e^-x), in float32: the same bits wherever an element sits in its tensor (`aten.silu`'s
    vectorised and scalar paths differ by an ulp)."""
    z = x.float()
    return (z / (1 + torch.exp(-z))).to(x.dtype)


def _weight_of(b: Tensor) -> Tensor | None:
    """The (N, K) weight whose transpose `b` (K, N) is (how `F.linear` hands a weight to `mm`), or None."""
    base = b._base
    if base is None or base.dim() != 2 or not base.is_contiguous() or b.shape != base.shape[::-1]:
        return None
    return base if b.stride() == (1, base.stride(0)) and b.data_ptr() == base.data_ptr() else None


def _experts_of(b: Tensor) -> Tensor | None:
    """The (G, N, K) expert weights whose per-expert transposes `b` (G, K, N) is (how transformers' grouped
    experts hand their fused weights to `_grouped_mm`), or None."""
    base = b._base
    if base is None or base.dim() != 3 or not base.is_contiguous() or b.data_ptr() != base.data_ptr():
        return None
    g, n, k = base.shape
    return base if b.shape == (g, k, n) and b.stride() == (n * k, 1, k) else None


def _mm(kernels: ExactKernels, func: Any, a: Tensor, b: Tensor) -> Tensor:
    weight = _weight_of(b)
    if weight is not None:
        return product(a, kernels.packed(weight))
    return rows_for(a.dtype).apply(lambda r: func(r, b), a)


def _addmm(kernels: ExactKernels, func: Any, bias: Tensor, a: Tensor, b: Tensor, *, beta: Any = 1,
           alpha: Any = 1) -> Tensor:  # fmt: skip
    weight = _weight_of(b)
    if weight is not None and bias.dim() == 1 and beta == 1 and alpha == 1:
        return product(a, kernels.packed(weight), bias)
    rows = rows_for(a.dtype)
    if bias.dim() == 2 and bias.shape[0] == a.shape[0] > 1:  # a bias per row: cut with the rows
        return rows.apply(lambda r, c: func(c, r, b, beta=beta, alpha=alpha), a, bias)
    return rows.apply(lambda r: func(bias, r, b, beta=beta, alpha=alpha), a)


def _addmm_(kernels: ExactKernels, func: Any, out: Tensor, a: Tensor, b: Tensor, *, beta: Any = 1,
            alpha: Any = 1) -> Tensor:  # fmt: skip
    """In place (a LoRA adapter added into its base output, `rlcore.models.lora`), in the rows' layout."""
    result = rows_for(a.dtype).apply(lambda o, r: func(o, r, b, beta=beta, alpha=alpha), out, a)
    return out if result is out else out.copy_(result)


def _bmm(kernels: ExactKernels, func: Any, a: Tensor, b: Tensor) -> Tensor:
    return rows_for(a.dtype).apply(lambda r: func(r, b), a, dim=1)


def _grouped_mm(kernels: ExactKernels, func: Any, a: Tensor, b: Tensor, offs: Tensor | None = None,
                bias: Tensor | None = None, out_dtype: Any = None) -> Tensor:  # fmt: skip
    """A mixture of experts' products (a's rows sorted by expert, `offs` each expert's end): each expert's
    rows by `product` with its own packed weight, so a token's result depends on that token alone."""
    experts = _experts_of(b)
    if experts is None or offs is None or a.dim() != 2 or bias is not None or out_dtype not in (None, a.dtype):
        raise NotImplementedError(f"exact mode: a grouped product of {tuple(a.shape)} x {tuple(b.shape)} "
                                  "that is not a mixture of experts' fused weights")  # fmt: skip
    out = a.new_empty((a.shape[0], b.shape[-1]))
    ends = offs.tolist()
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if end > start:
            out[start:end] = product(a[start:end], kernels.packed(experts, g))
    return out


def fold(parts: list[Tensor]) -> Tensor:
    """((p0 + p1) + p2) + ...: a sequential sum, so that parts that are exactly zero (masked blocks, before or
    after a sequence's own) change nothing, wherever they sit."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def batched_product(a: Tensor, b: Tensor, rows: KernelRows | None = None) -> Tensor:
    """a @ b (batched), a's rows (dim -2) in the layout `rows` (default: `rows_for(a.dtype)`)."""
    return (rows or rows_for(a.dtype)).apply(lambda r: r @ b, a, dim=-2)


def _silu(kernels: ExactKernels, func: Any, x: Tensor) -> Tensor:
    return silu(x)


_HANDLERS = {
    torch.ops.aten.mm.default: _mm,
    torch.ops.aten.addmm.default: _addmm,
    torch.ops.aten.addmm_.default: _addmm_,
    torch.ops.aten.bmm.default: _bmm,
    torch.ops.aten._grouped_mm.default: _grouped_mm,
    torch.ops.aten.silu.default: _silu,
}
"""The aten ops exact mode replaces, each with its batch-invariant form (one table, one place)."""


class ExactKernels(TorchDispatchMode):
    """Runs `_HANDLERS`' ops in their batch-invariant form; every other op as it is. Each weight is packed
    once per instance (`packed`): `make_exact`'s hooks make one per forward (an optimizer step, a load
    through `.data` or an FSDP all-gather may change a weight without a version bump, so packs are never
    reused across forwards); the lean step holds one per `generate` for a MoE block (`under_kernels`)."""

    def __init__(self) -> None:
        super().__init__()
        self.packs: dict[tuple[int, int | None], tuple[Tensor, Tensor]] = {}

    def packed(self, owner: Tensor, expert: int | None = None) -> Tensor:
        """`packed_or_plain` of the weight `owner` (2-D), or of expert `expert` of `owner` (3-D), once."""
        key = (id(owner), expert)
        hit = self.packs.get(key)
        if hit is None or hit[0] is not owner:
            hit = (owner, packed_or_plain(owner if expert is None else owner[expert]))
            self.packs[key] = hit
        return hit[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **(kwargs or {}))
        return handler(self, func, *args, **(kwargs or {}))


def under_kernels(module: nn.Module) -> Callable[..., Any]:
    """`module` as a function that runs it inside one `ExactKernels` (each weight packed at its first call,
    then kept): the lean step's MoE block, for one `generate` (`rlcore.rollout.native.lean`), runs the trainer's
    products without its model's hooks."""
    mode = ExactKernels()

    def call(*args: Any) -> Any:
        with mode:
            return module(*args)

    return call
