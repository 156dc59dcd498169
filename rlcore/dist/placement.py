"""Roles and resource pools: which ranks generate and which train, with the groups between them.

    place(info)                               # colocate: every rank does both (the default)
    place(info, split=True, rollout_ranks=1)  # torchrun, W ranks: rank 0 rolls out, ranks 1..W-1 train
    place(info, tp=2, sp=2)                   # colocate on a mesh (dp_shard, sp, tp): 4 ranks share a batch
    place(info, split=True, tp=2)             # split: the trainer ranks on their own (dp_shard, tp) mesh
    place(info, ep=2)                         # experts split over pairs of ranks (rlcore.dist.ep)

Under split placement ranks [0, N) hold the rollout role (engine, rewards, prompts) and ranks [N, W)
the trainer role (the policy sharded with FSDP2 over a mesh of the trainer ranks, reference and critic
with it). Each role sees itself as a world of its own (`local`: rank and size within the role, `mesh`:
the role's data-parallel mesh, None for a role of one rank), so the code of a colocated run runs on it
unchanged; what crosses roles goes over three process groups made here:

    data:   every rank; finished rollouts, point to point, rollout rank -> trainer rank
    push:   the rollout ranks and the trainer leader (rank N); weight pushes, broadcast from the leader
    val:    rollout rank 0 and the trainer leader; validation results

With tensor or sequence parallelism (colocated; under split, tp on the trainer ranks), the tp x sp ranks of one data-parallel coordinate
are *peers*: they hold one model split between them and train one batch, so `local` is the
data-parallel coordinate (rank and size of `mesh`, the dp_shard axis) that picks the prompts and the
sampling seeds, `shard_mesh` is what FSDP2 shards over (dp_shard, flattened with sp: sp ranks hold the
same parameters and sum their gradients), and `peers` is the group whose first rank's batch every peer
trains (`rlcore.step.collect`).

With expert parallelism the trainer ranks, data-parallel as without it, also form groups of ep
neighbours that split every MoE layer's experts: `ep_mesh` is (ep_replicate, ep), or (ep,) for one group.

Every rank calls `place` (creating groups is collective), with the same arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from torch import arange
from torch.distributed.device_mesh import DeviceMesh

from rlcore.dist.mesh import DistInfo, MeshAxis, build_mesh

WAIT = timedelta(hours=2)
"""How long a rank of split placement may wait for the other role (a rollout rank for the next weights
while the trainer updates, a trainer rank for its batch) before the group's operation times out."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """This rank's role and the groups of the run (see the module docstring)."""

    role: Literal["both", "rollout", "trainer"]
    """both (colocate), or this rank's role under split placement."""
    rollout_ranks: tuple[int, ...]
    """Global ranks that generate (every rank when colocated)."""
    trainer_ranks: tuple[int, ...]
    """Global ranks that train (every rank when colocated)."""
    local: DistInfo
    """This rank within its role: rank and world size of the role, the global rank's device."""
    mesh: DeviceMesh | None
    """The role's data-parallel mesh (reductions; FSDP2 for the trainer); None for one rank. Under tp / sp
    the dp_shard axis, kept (of size 1 too) so reductions never fall back to the model's mesh."""
    shard_mesh: DeviceMesh | None = None
    """What FSDP2 shards the trained models over (`mesh`, or dp_shard x sp flattened); None: unsharded."""
    tp_mesh: DeviceMesh | None = None
    """The tensor-parallel axis (None: tp 1)."""
    sp_mesh: DeviceMesh | None = None
    """The sequence-parallel axis (None: sp 1)."""
    ep_mesh: DeviceMesh | None = None
    """Expert parallelism: (ep_replicate, ep) over the trainer ranks, or (ep,) for one group (None: ep 1)."""
    peers: Any = None
    """tp / sp: the process group of this rank's peers (the ranks sharing its batch); None without."""
    trainers: Any = None
    """split: the trainer ranks' process group (checkpoints of the sharded model)."""
    data: Any = None
    """split: the group rollouts travel in (every rank)."""
    push: Any = None
    """split: the rollout ranks and the trainer leader (weight pushes)."""
    val: Any = None
    """split: rollout rank 0 and the trainer leader (validation results)."""
    rollouts: Any = None
    """split: the rollout ranks' process group (the world an in-process vLLM engine sees)."""
    peer_size: int = 1
    """tp x sp: how many trainer ranks share one data-parallel coordinate's batch (consecutive ranks)."""

    @property
    def split(self) -> bool:
        return self.role != "both"

    @property
    def leader(self) -> int:
        """The global rank that writes the run's files and logs: the first trainer rank."""
        return self.trainer_ranks[0]

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's logs, config and final model."""
        if not dist.is_initialized():
            return True
        return dist.get_rank() == (self.leader if self.split else 0)

    @property
    def trains(self) -> bool:
        return self.role != "rollout"

    @property
    def generates(self) -> bool:
        return self.role != "trainer"


def place(
    info: DistInfo, *, split: bool = False, rollout_ranks: int = 1, tp: int = 1, sp: int = 1, ep: int = 1
) -> Placement:
    """The placement of this rank (a collective under torchrun: every rank calls it alike)."""
    everyone = tuple(range(info.world_size))
    if ep > 1 and tp * sp > 1:
        raise ValueError("expert parallelism with tp or sp is not built; use --trainer.ep with FSDP2 alone")
    if not split:
        if tp * sp > 1:
            return _model_parallel(info, tp=tp, sp=sp)
        mesh = build_mesh(info)
        return Placement(role="both", rollout_ranks=everyone, trainer_ranks=everyone, local=info, mesh=mesh,
                         shard_mesh=mesh, ep_mesh=_ep_mesh(info, everyone, ep))  # fmt: skip
    n, w = rollout_ranks, info.world_size
    if not 1 <= n < w:
        raise ValueError(f"split placement needs 1 <= rollout ranks ({n}) < world size ({w})")
    rollout, trainer = everyone[:n], everyone[n:]
    if (w - n) % (tp * sp):
        raise ValueError(f"split placement: tp ({tp}) x sp ({sp}) must divide the trainer ranks ({w - n})")
    if sp > 1:  # its flattened axes make process groups that the rollout ranks, outside the mesh, cannot join
        raise ValueError("sequence parallelism with split placement is not built; use colocate, or tp")
    meshes = {"rollout": _mesh(info.device.type, rollout)}
    axes = _model_axes(info, trainer, tp=tp, sp=sp)  # every rank builds them: making groups is collective
    meshes["trainer"] = None if tp * sp > 1 else _mesh(info.device.type, trainer)  # tp: in `axes`
    experts = _ep_mesh(info, trainer, ep)
    groups = {
        "trainers": dist.new_group(list(trainer), timeout=WAIT),
        "data": dist.new_group(list(everyone), timeout=WAIT),
        "push": dist.new_group([*rollout, trainer[0]], timeout=WAIT),
        "val": dist.new_group([rollout[0], trainer[0]], timeout=WAIT),
        "rollouts": dist.new_group(list(rollout), timeout=WAIT),
    }
    role = "rollout" if info.rank < n else "trainer"
    if role == "trainer" and tp * sp > 1:  # the trainer ranks' own (dp_shard, sp, tp) mesh, as colocated
        return Placement(role=role, rollout_ranks=rollout, trainer_ranks=trainer, peer_size=tp * sp, **axes,
                         **groups)  # fmt: skip
    ranks = rollout if role == "rollout" else trainer
    local = dataclasses.replace(info, rank=ranks.index(info.rank), world_size=len(ranks))
    return Placement(role=role, rollout_ranks=rollout, trainer_ranks=trainer, local=local, mesh=meshes[role],
                     shard_mesh=meshes[role] if role == "trainer" else None, peer_size=tp * sp,
                     ep_mesh=experts if role == "trainer" else None, **groups)  # fmt: skip


def _model_parallel(info: DistInfo, *, tp: int, sp: int) -> Placement:
    """Colocated on the mesh (dp_shard, sp, tp): this rank's data-parallel coordinate, axes and peers."""
    everyone = tuple(range(info.world_size))
    axes = _model_axes(info, everyone, tp=tp, sp=sp)
    return Placement(role="both", rollout_ranks=everyone, trainer_ranks=everyone, peer_size=tp * sp, **axes)


def _model_axes(info: DistInfo, ranks: tuple[int, ...], *, tp: int, sp: int) -> dict[str, Any]:
    """The mesh (dp_shard, sp, tp) over `ranks` (consecutive, tp fastest) and, for a member, its
    Placement fields: `local` (the data-parallel coordinate), `mesh`, `shard_mesh`, `tp_mesh`, `sp_mesh`,
    `peers`. Every rank of the world calls it alike (a non-member, and tp = sp = 1, get {})."""
    if tp * sp == 1:
        return {}
    if len(ranks) == info.world_size:
        full = build_mesh(info, sp=sp, tp=tp)
    else:
        dims = [(MeshAxis.DP_SHARD, len(ranks) // (tp * sp)), (MeshAxis.SP, sp), (MeshAxis.TP, tp)]
        kept = [(axis, size) for axis, size in dims if size > 1 or axis == MeshAxis.DP_SHARD]
        layout = arange(ranks[0], ranks[-1] + 1).reshape(tuple(size for _, size in kept))
        full = DeviceMesh(info.device.type, layout, mesh_dim_names=tuple(a.value for a, _ in kept))
    if info.rank not in ranks:  # slicing needs a member (with sp, the flattened axes: see `place`)
        return {}
    model_axes = tuple(a.value for a, n in ((MeshAxis.SP, sp), (MeshAxis.TP, tp)) if n > 1)
    peers = full[model_axes] if len(model_axes) == 1 else full[model_axes]._flatten("sp_tp")
    dp = full[MeshAxis.DP_SHARD.value]
    shard = full[(MeshAxis.DP_SHARD.value, MeshAxis.SP.value)]._flatten("dp_shard_sp") if sp > 1 else dp
    return {
        "local": dataclasses.replace(info, rank=dp.get_local_rank(), world_size=dp.size()),
        "mesh": dp,
        "shard_mesh": shard if shard.size() > 1 else None,
        "tp_mesh": full[MeshAxis.TP.value] if tp > 1 else None,
        "sp_mesh": full[MeshAxis.SP.value] if sp > 1 else None,
        "peers": peers.get_group(),
    }


@contextlib.contextmanager
def as_world(group: Any) -> Iterator[None]:
    """Within the block, `group` (of global ranks 0..n-1) is torch.distributed's default group: for
    libraries that take the whole default world as theirs. vLLM in this process builds its groups over
    `range(get_world_size())` and runs collectives on them, which under split placement only the
    rollout ranks would enter; inside this block its world is the rollout ranks. None: no change.
    Groups it creates stay its own; rlcore creates none after it (their names count per process)."""
    if group is None:
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    if dist.get_process_group_ranks(group) != list(range(dist.get_world_size(group))):
        raise ValueError("as_world: the group must hold global ranks 0..n-1")
    world = c10d._world.default_pg  # torch keeps no public setter for the default group
    c10d._world.default_pg = group
    try:
        yield
    finally:
        if c10d._world.default_pg is group:  # a library that destroyed its world leaves None
            c10d._world.default_pg = world


def _ep_mesh(info: DistInfo, ranks: tuple[int, ...], ep: int) -> DeviceMesh | None:
    """(ep_replicate, ep) over `ranks` (consecutive, ep neighbours per group), (ep,) for one group; None
    for ep 1. Built on every rank of the world, members or not (making its groups is collective)."""
    if ep == 1:
        return None
    if len(ranks) % ep:
        raise ValueError(f"expert parallelism: ep ({ep}) must divide the trainer ranks ({len(ranks)})")
    layout = arange(ranks[0], ranks[-1] + 1).reshape(-1, ep)
    if layout.shape[0] == 1:
        return DeviceMesh(info.device.type, layout[0], mesh_dim_names=(MeshAxis.EP.value,))
    return DeviceMesh(info.device.type, layout, mesh_dim_names=(MeshAxis.EP_REPLICATE.value, MeshAxis.EP.value))


def _mesh(device_type: str, ranks: tuple[int, ...]) -> DeviceMesh | None:
    """A 1-D data-parallel mesh over `ranks` (built on every rank, members or not); None for one rank."""
    if len(ranks) == 1:
        return None
    return DeviceMesh(device_type, arange(ranks[0], ranks[-1] + 1), mesh_dim_names=(MeshAxis.DP_SHARD.value,))


__all__ = ["WAIT", "Placement", "as_world", "place"]
