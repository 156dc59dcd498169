"""Split placement for the Tinker server (`--rollout-ranks N` under torchrun): ranks 0..N-1 hold engine copies
and rank 0 samples; the other ranks train (FSDP2 among themselves). What crosses between the roles:

- a training operation's result, from the trainer leader (the first trainer rank) to rank 0, which answers
  the request (`send_result` / `receive_result`, over the placement's `val` group);
- a push (`save_weights_for_sampler`): `rlcore.dist.push`, the same protocol as train.py's split
  placement. The leader announces the version and whether the weights changed, then broadcasts them
  (gathered over the trainer ranks; LoRA: the adapter tensors only) to the rollout ranks, which load them
  into their engine (a LoRA copy first takes the adapter, then refreshes its engine as a colocated push
  does: `rlcore.step.weights.AdapterRelay`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rlcore.dist import push
from rlcore.models.lora import push_state
from rlcore.step.weights import into_engine


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
    push.send_push(model if changed else None, step=version, version=version, src=placement.leader,
                   group=placement.push, bucket_bytes=bucket_bytes,
                   state=push_state(model) if model is not None else None)  # fmt: skip


def receive_push(engine: Any, relay: Any, placement: Any) -> int:
    """Every rollout rank: the announced version, its weights loaded into `engine` when they changed."""
    note = push.receive_announcement(src=placement.leader, group=placement.push)
    push.receive_push(note, into_engine(engine, relay), src=placement.leader, group=placement.push)
    return note.version
