"""Process group and device mesh, from the torchrun environment or a one-process default.

    info = init_distributed()                       # python train.py: 1 process, no process group
    mesh = build_mesh(info)                         # None for 1 process: the trainer uses the plain module
    # torchrun --nproc_per_node=8 train.py          # 8 ranks, mesh ("dp_shard",) of size 8
    # torchrun --nnodes=2 --nproc_per_node=8 ...    # with replicate=2: hybrid shard, mesh (2, 8)

The mesh is passed explicitly to whoever needs it (`apply_fsdp`, `update_step`, `all_reduce`); nothing
here is global state beyond what `torch.distributed` itself keeps (the default process group).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlcore.dist.rendezvous import launcher_hosts_store, world_store

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: the same behaviour for our use (members are their string values)
    from enum import Enum

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


class MeshAxis(StrEnum):
    """Names of the mesh dimensions (used as `mesh_dim_names` and to look dimensions up)."""

    DP_REPLICATE = "dp_replicate"
    """Data parallel, parameters replicated (the outer axis of hybrid sharding, e.g. across nodes)."""
    DP_SHARD = "dp_shard"
    """Data parallel, parameters sharded with FSDP2 (the inner axis, e.g. the GPUs of a node)."""
    SP = "sp"
    """Sequence parallel (Ulysses): each sequence's tokens split, all-to-all around attention (`rlcore.dist.ulysses`)."""
    TP = "tp"
    """Tensor parallel: each decoder layer's heads and MLP columns split (`rlcore.dist.tp`)."""
    EP_REPLICATE = "ep_replicate"
    """Expert parallel, the groups of ep ranks, which hold the same experts (`rlcore.dist.ep`)."""
    EP = "ep"
    """Expert parallel: the ranks of one group, each holding its share of every MoE layer's experts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistInfo:
    """Where this process sits; `world_size == 1` means no process group is needed."""

    rank: int
    """Global rank (0 for one process)."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    device: torch.device
    """Device this rank computes on: cuda:<local_rank> or cpu."""

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the rank that writes files and logs)."""
        return self.rank == 0


_CREATED: list = []  # the process group init_distributed created (at most one)


def device_type(device: str) -> str:
    """cuda or cpu: what --trainer.device (auto, cpu, cuda) trains on; auto picks cuda where torch sees one."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device_type(device) == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "--trainer.device cuda was asked for but torch sees no CUDA device; use cpu or auto"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", *, rendezvous_timeout_s: float = 300.0) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Without torchrun (or with WORLD_SIZE=1) this is one process and no process group is created.
    If a process group already exists (tests that create it themselves), it is used as it is.
    The backend is nccl on cuda and gloo on cpu. `device` is auto (cuda when available), cpu or cuda.
    A world whose ranks do not all meet within `rendezvous_timeout_s` raises `rlcore.dist.rendezvous.WorldNotFormed`.
    """
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return DistInfo(
            rank=rank, world_size=world, local_rank=local_rank, device=_resolve_device(device, local_rank)
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = _resolve_device(device, local_rank)
    if world > 1:
        store = world_store(rank, world, rendezvous_timeout_s)
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
            dist.init_process_group("nccl", device_id=resolved, store=store, rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        _CREATED.append(dist.group.WORLD)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=resolved)


def build_mesh(info: DistInfo, *, replicate: int = 1, sp: int = 1, tp: int = 1) -> DeviceMesh | None:
    """The world as a mesh: (dp_shard,), with `replicate` > 1 (dp_replicate, dp_shard), with `sp` / `tp`
    > 1 their axes after it (dp_shard, sp, tp); None for 1 process. Ranks are laid out tp fastest, so a
    tp group is neighbouring ranks (one node's fast links).

    Raises ValueError naming every factor when they do not multiply to the world size.
    """
    if min(replicate, sp, tp) < 1 or info.world_size % (replicate * sp * tp):
        raise ValueError(mesh_problem(info.world_size, replicate=replicate, sp=sp, tp=tp))
    if info.world_size == 1:
        return None
    shard = info.world_size // (replicate * sp * tp)
    axes = [(MeshAxis.DP_REPLICATE, replicate), (MeshAxis.DP_SHARD, shard), (MeshAxis.SP, sp), (MeshAxis.TP, tp)]
    kept = [(axis, size) for axis, size in axes if size > 1 or axis == MeshAxis.DP_SHARD]
    return init_device_mesh(
        info.device.type, tuple(size for _, size in kept), mesh_dim_names=tuple(a.value for a, _ in kept)
    )


def mesh_problem(world_size: int, *, replicate: int = 1, sp: int = 1, tp: int = 1) -> str | None:
    """One line naming every factor of a mesh that does not fit `world_size` processes (None if it fits)."""
    if min(replicate, sp, tp) >= 1 and world_size % (replicate * sp * tp) == 0:
        return None
    shard = world_size // max(1, replicate * sp * tp)
    factors = [("dp_replicate", replicate), ("dp_shard", shard), ("sp", sp), ("tp", tp)]
    shown = " * ".join(f"{name}({size})" for name, size in factors if size != 1 or name == "dp_shard")
    return (
        f"{shown} != world size ({world_size}): every factor must be >= 1 and their product must divide "
        "the number of processes"
    )


LINGER_S = 3.0
"""Seconds the ranks of the node whose launcher hosts the rendezvous store stay after a clean finish of a
multi-node run (`leave_in_order`)."""


def leave_in_order() -> None:
    """At a clean finish, before anything closes: every rank waits for the others (a barrier), then, under
    a multi-node torchrun, the ranks whose launcher hosts the rendezvous store stay `LINGER_S` longer.
    torchrun's launchers meet in an exit barrier on that store: when its host arrives first, it may shut
    the store down while another launcher's last request is in flight, which that launcher logs as a
    `DistNetworkError` traceback after a run that succeeded. Arriving last, it sets the barrier's key itself
    and the others are already waiting. No effect without a process group we made."""
    if not (_CREATED and dist.is_initialized()):
        return
    dist.barrier()
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and launcher_hosts_store():
        time.sleep(LINGER_S)


def close_distributed() -> None:
    """Destroy the process group `init_distributed` created, if any (call once at the end of the run).

    A group someone else made (a test's, or the one vLLM makes for itself in a single process) is left
    to its owner.
    """
    if _CREATED and dist.is_initialized():
        dist.destroy_process_group(_CREATED.pop())


def group_rank(group: object = None) -> int:
    """This process's index in `group` (None: the world); 0 without a process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group: object = None) -> int:
    """The number of processes in `group` (None: the world); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_device(group: object = None) -> torch.device:
    """Where `group`'s tensors must live: the current CUDA device for nccl, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
