"""Split placement for the Tinker server (`--rollout-ranks N` under torchrun): ranks 0..N-1 hold engine copies
and rank 0 samples; the other ranks train (FSDP2 among themselves). What crosses between the roles:

- a training operation's result, from the trainer leader (the first trainer rank) to rank 0, which answers
  the request (`send_result` / `receive_result`, over the placement's `val` group);
- a push (`save_weights_for_sampler`): the leader announces the version and whether the weights changed,
  then broadcasts them (gathered over the trainer ranks; LoRA: the adapter tensors only) to the rollout
  ranks, which load them into their engine (a LoRA copy first takes the adapter, then refreshes its engine
  as a colocated push does: `rlcore.step.weights.AdapterRelay`). The same transfer as train.py's split
  placement (`rlcore.dist.transfer`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore.dist.mesh import group_device
from rlcore.dist.stream import WeightPush
from rlcore.dist.transfer import broadcast_weights, receive_weights
from rlcore.step.weights import push_state


def send_result(result: Any, placement: Any) -> None:
    """The trainer leader: hand rank 0 the result of an operation only the trainer ranks ran."""
    if dist.get_rank() == placement.leader:
        dist.broadcast_object_list([result], src=placement.leader, group=placement.val)


def receive_result(placement: Any) -> Any:
    """Rank 0: the result the trainer leader sends (`send_result`)."""
    box = [None]
    dist.broadcast_object_list(box, src=placement.leader, group=placement.val)
    return box[0]


def push_to_rollouts(model: Any, placement: Any, *, version: int, changed: bool, bucket_bytes: int) -> None:
    """Every trainer rank: announce `version` to the rollout ranks and, when `changed`, send the weights."""
    leads = dist.get_rank() == placement.leader
    if leads:
        announce = torch.tensor([version, int(changed)], device=group_device(placement.push))
        dist.broadcast(announce, placement.leader, group=placement.push)
    if not changed:
        return
    state = push_state(model)
    with WeightPush(model, bucket_bytes=bucket_bytes, all_ranks=True, state=state) as push:
        if leads:
            broadcast_weights(model, push, src=placement.leader, group=placement.push, state=state)
        else:
            for _ in push:  # the gathers are collectives of the trainer ranks; only the leader sends
                pass


def receive_push(engine: Any, relay: Any, placement: Any) -> int:
    """Every rollout rank: the announced version, its weights loaded into `engine` when they changed."""
    announce = torch.zeros(2, dtype=torch.int64, device=group_device(placement.push))
    dist.broadcast(announce, placement.leader, group=placement.push)
    version, changed = announce.cpu().tolist()
    if changed:
        stream = receive_weights(src=placement.leader, group=placement.push)
        if relay is not None:
            relay.load(engine, stream)
        else:
            engine.load_weights(stream)
        if sum(1 for _ in stream):  # read the rest, so the broadcasts stay matched; then refuse
            raise RuntimeError("the engine's load_weights left tensors of the push unread")
    return int(version)
