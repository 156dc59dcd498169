"""Exact mode's pre-flight check: on this CPU, for the products a model runs, a layout of rows under which a
row's bits do not depend on the other rows, measured before the model samples or trains.

    calibrate(model)       # in make_exact: ROWS[dtype] for each dtype the model multiplies in, or ValueError
    rows_signature()       # the layouts chosen, as numbers every rank compares (rlcore.trainer.models)

Why: exact mode needs each product's kernel to give a row the same bits whether it shares the call with 1
or 4000 other rows. That is a property of the CPU's kernels, not of rlcore: on AVX2 and AVX-512 CPUs
oneDNN's packed product holds it from 2 rows in fp32 and bf16, while on a CPU with AMX its bf16 kernels
were measured to block rows 7-17 otherwise than 1, 2 or 64 (2.4e-4 apart). So for every weight shape of
the model (each `nn.Linear`, each expert of a fused experts tensor) and attention's float32 products
(inner size the head dimension, and BLOCK), in its dtype and on its device, the first of CANDIDATES under
which the rows of a REFERENCE_ROWS-row product equal those of products of every count in ROW_COUNTS, at the
start and at the end of the reference (another place in a tile), is the one the process runs
(`exact_kernels.ROWS`). None holds: a ValueError naming the CPU's instructions and the way out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from rlcore.models import exact_kernels
from rlcore.models.exact_kernels import BLOCK, KernelRows, batched_product, packed_or_plain, product
from rlcore.models.onednn import cpu_isa

CANDIDATES = (KernelRows(floor=16), KernelRows(tile=64), KernelRows(tile=16))
"""The layouts tried, cheapest first: one call on at least 16 rows (no extra work past 16 rows), then
fixed tiles of 64 rows, then of 16 (every call one shape: invariant unless a row's place in the call
matters; 64 first, where rows 64 and more agreed on AMX, and fewer calls in a trainer's forward)."""

ROW_COUNTS = (1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 129)
"""Row counts compared with the reference: each side of every layout's boundaries, and AMX's 7-17 band."""

REFERENCE_ROWS = 200
"""Rows of the product the others are compared with (more than any count above, not a multiple of 64)."""

_SEEN: dict[tuple[torch.dtype, torch.device], set[tuple[int, int, bool]]] = {}
"""Every shape a calibrated model of this process multiplies in, per dtype and device: a later model's
layout must hold for the earlier models' products too."""

_VERDICTS: dict[tuple[object, ...], bool] = {}
"""`row_invariant`'s results, keyed by the kernel they measured (`exact_kernels.kernel`) and the case."""


def calibrate(model: nn.Module) -> None:
    """Set `exact_kernels.ROWS` for each dtype `model` multiplies in to the first of CANDIDATES under which
    all its products (and those of models calibrated before in this process) are row-invariant here.
    Raises ValueError (one line) where none is."""
    for (dtype, device), shapes in products_of(model).items():
        seen = _SEEN.setdefault((dtype, device), set())
        seen |= shapes
        exact_kernels.ROWS[dtype] = choose(dtype, device, seen)


def products_of(model: nn.Module) -> dict[tuple[torch.dtype, torch.device], set[tuple[int, int, bool]]]:
    """(n, k, batched) of the products `model`'s exact forward runs, per dtype and device: each linear
    weight (n, k); each expert (n, k) of a 3-D experts tensor (g, n, k); attention's batched products in
    float32, scores (inner size: each head dimension) and weighted values (inner size BLOCK)."""
    found: dict[tuple[torch.dtype, torch.device], set[tuple[int, int, bool]]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            found.setdefault((module.weight.dtype, module.weight.device), set()).add(
                (*module.weight.shape, False)
            )
    for p in model.parameters():
        if p.dim() == 3 and p.is_floating_point():
            found.setdefault((p.dtype, p.device), set()).add((p.shape[1], p.shape[2], False))
    head_dims = {m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)}
    device = next(model.parameters()).device
    attention = found.setdefault((torch.float32, device), set())
    for d in head_dims:
        attention |= {(3 * BLOCK + 1, d, True), (d, BLOCK, True)}
    return found


def choose(dtype: torch.dtype, device: torch.device, shapes: set[tuple[int, int, bool]]) -> KernelRows:
    """The first of CANDIDATES under which every one of `shapes` is row-invariant, or ValueError."""
    ordered = sorted(shapes)
    for rows in CANDIDATES:
        if all(row_invariant(rows, n, k, dtype, device, batched=b) for n, k, b in ordered):
            return rows
    n, k, batched = next(
        s for s in ordered if not row_invariant(CANDIDATES[0], *s[:2], dtype, device, batched=s[2])
    )
    what = (
        f"attention's batched {n}-wide products of inner size {k}"
        if batched
        else f"products by a {n}x{k} weight"
    )
    raise ValueError(
        f"on this CPU ({cpu_isa()}) {str(dtype).removeprefix('torch.')} {what} change a row's bits with the number "
        f"of rows in the call, in every layout tried ({'; '.join(r.name for r in CANDIDATES)}): "
        f"{_way_out(dtype)}"
    )


def _way_out(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return ("start the run with ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 in its environment, "
                "or run without exact mode")  # fmt: skip
    return ("run in float32 (--model.dtype float32), or start the run with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "
            "in its environment (no AMX: bf16 products several times slower)")  # fmt: skip


def row_invariant(
    rows: KernelRows, n: int, k: int, dtype: torch.dtype, device: torch.device, *, batched: bool
) -> bool:
    """Whether, under `rows`, each row of a REFERENCE_ROWS-row product by a random (n, k) weight has the same
    bits in products of ROW_COUNTS rows taken at the reference's start and end (measured once per kernel)."""
    key = (exact_kernels.kernel, rows, n, k, dtype, device, batched)
    if key not in _VERDICTS:
        _VERDICTS[key] = _measure(*_case(rows, n, k, dtype, device, batched))
    return _VERDICTS[key]


def _case(rows: KernelRows, n: int, k: int, dtype: torch.dtype, device: torch.device,
          batched: bool) -> tuple[Callable[[Tensor], Tensor], Tensor]:  # fmt: skip
    """(x -> its product in `rows`, the reference x): x (REFERENCE_ROWS, k) by a packed (n, k) weight, or
    x (2, REFERENCE_ROWS, k) batched by a (2, k, n) tensor; random normal values."""
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(
        (2, REFERENCE_ROWS, k) if batched else (REFERENCE_ROWS, k), generator=generator, device=device
    )
    if batched:
        b = torch.randn((2, k, n), generator=generator, device=device).to(dtype)
        return (lambda a: batched_product(a, b, rows)), x.to(dtype)
    weight = packed_or_plain(torch.randn((n, k), generator=generator, device=device).to(dtype))
    return (lambda a: product(a, weight, rows=rows)), x.to(dtype)


def _measure(run: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether the rows of run(x) equal those of run on each ROW_COUNTS slice of x's rows (dim -2), taken
    at the start and at the end."""
    full, total = run(x), x.shape[-2]
    for m in ROW_COUNTS:
        for start in (0, total - m):
            if not torch.equal(run(x[..., start : start + m, :]), full[..., start : start + m, :]):
                return False
    return True


def rows_signature() -> list[int]:
    """Which of CANDIDATES each of float32, bfloat16 and float16 runs in (-1: none chosen): every rank of a
    run must hold the same (`rlcore.trainer.models.agree_exact_rows`)."""
    return [
        CANDIDATES.index(exact_kernels.ROWS[d]) if d in exact_kernels.ROWS else -1 for d in (torch.float32, torch.bfloat16, torch.float16)
    ]
