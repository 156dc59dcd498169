"""Global reductions over a data-parallel mesh (every rank of it), and the identity without one.

    n = all_reduce(local_tokens, mesh)              # sum over all ranks; `local_tokens` itself when mesh is None
    k = all_reduce(torch.tensor(n_micro), mesh, op="max")

Every rank of the mesh must call these in the same order (they are collectives). A 2-D mesh is
reduced one dimension after the other, which covers every rank once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from rlcore.dist.mesh import group_device

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def mesh_size(mesh: DeviceMesh | None) -> int:
    """Number of ranks in `mesh` (1 for None)."""
    return 1 if mesh is None else mesh.size()


def all_reduce(
    tensor: Tensor, mesh: DeviceMesh | None, *, op: Literal["sum", "max", "min"] = "sum"
) -> Tensor:
    """A new tensor holding the reduction of `tensor` over every rank of `mesh` (a copy when mesh is None).

    `tensor` must live on the mesh's device type (cuda for nccl, cpu for gloo); it is not modified.
    """
    out = tensor.detach().clone()
    if mesh is None:
        return out
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(out, op=_OPS[op], group=mesh.get_group(dim))
    return out


def world_max(values: Sequence[int], group: Any = None) -> list[int]:
    """Each of `values` maximised over every rank of `group` (default: the world), for decisions every
    rank must take alike (a host sync); the values themselves without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [int(v) for v in values]
    out = torch.tensor([int(v) for v in values], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in out.tolist()]


def _combine(name: str) -> str:
    """How a metric is reduced over ranks, by its name: maxima and minima as named, means otherwise."""
    if name.endswith(("_max", "/max")):
        return "max"
    return "min" if name.endswith(("_min", "/min")) else "mean"


def reduce_metrics(metrics: dict[str, float], mesh: DeviceMesh | None) -> dict[str, float]:
    """Scalar metrics over every rank: `*_max` / `*/max` the maximum, `*_min` / `*/min` the minimum, the
    rest the mean over the ranks that have the key (a key some ranks lack is reduced over the others).

    Three collectives (the key sets, then one sum and one max over a stacked float64 tensor); every
    rank calls it with its own dict and gets the same result. `metrics` itself without a mesh.
    """
    if mesh is None or mesh.size() == 1:
        return dict(metrics)
    key_sets: list[list[str]] = [[] for _ in range(mesh.size())]
    dist.all_gather_object(key_sets, sorted(metrics), group=mesh.get_group() if mesh.ndim == 1 else None)
    keys = sorted(set().union(*key_sets))
    has = torch.tensor([k in metrics for k in keys], dtype=torch.float64)
    value = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    kind = [_combine(k) for k in keys]
    low = torch.tensor([-torch.inf if c != "mean" else 0.0 for c in kind], dtype=torch.float64)
    signs = torch.tensor([-1.0 if c == "min" else 1.0 for c in kind], dtype=torch.float64)
    device = mesh.device_type
    sums = all_reduce(torch.stack([value * has, has]).to(device), mesh).cpu()  # (2, k)
    tops = all_reduce(torch.where(has > 0, value * signs, low).to(device), mesh, op="max").cpu()  # (k,)
    out = {}
    for i, (key, c) in enumerate(zip(keys, kind, strict=True)):
        out[key] = float(sums[0, i] / sums[1, i]) if c == "mean" else float(tops[i] * signs[i])
    return out


def all_reduce_int(value: int, mesh: DeviceMesh | None, *, op: Literal["sum", "max", "min"] = "sum") -> int:
    """`all_reduce` of one Python int (a host sync; for counts that decide control flow)."""
    if mesh is None:
        return int(value)
    t = torch.tensor(value, dtype=torch.int64, device=mesh.device_type)
    return int(all_reduce(t, mesh, op=op).item())
