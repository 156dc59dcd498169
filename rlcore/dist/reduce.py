"""Global reductions over a data-parallel mesh (every rank of it), and the identity without one.

    n = all_reduce(local_tokens, mesh)              # sum over all ranks; `local_tokens` itself when mesh is None
    k = all_reduce(torch.tensor(n_micro), mesh, op="max")

Every rank of the mesh must call these in the same order (they are collectives). A 2-D mesh is
reduced one dimension after the other, which covers every rank once.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

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


def all_reduce_int(value: int, mesh: DeviceMesh | None, *, op: Literal["sum", "max", "min"] = "sum") -> int:
    """`all_reduce` of one Python int (a host sync; for counts that decide control flow)."""
    if mesh is None:
        return int(value)
    t = torch.tensor(value, dtype=torch.int64, device=mesh.device_type)
    return int(all_reduce(t, mesh, op=op).item())
