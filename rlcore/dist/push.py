"""Weight pushes between ranks: the ranks that train (the senders; the first of them, `src`, sends)
hand a policy's weights to the ranks that sample (the receivers), one engine update per push. Both
split placements use it: train.py's (`rlcore.step.split`) and the Tinker server's (`rlcore.tinker.split`).

    # every sender rank (gathering the weights is a collective of theirs)
    sent = send_push(model, step=s, version=v, src=leader, group=push, bucket_bytes=...)
    sent = send_push(None, step=s, version=v, src=leader, group=push, bucket_bytes=...)  # nothing changed
    # every receiver rank
    note = receive_announcement(src=leader, group=push)        # (or one received in the background)
    receive_push(note, engine.load_weights, src=leader, group=push)

A push is an `Announcement` (one int64 tensor: step, version, changed, kind), then, when the weights
changed, the weights in one of three kinds:

- full: every tensor of the model whole (`rlcore.dist.transfer.broadcast_weights`);
- adapters: a LoRA policy's adapter tensors only, whole (the receivers hold the base: `rlcore.models.lora.push_state`);
- delta: per tensor the XOR of its bytes against what the receivers last got, compressed, with a full
  push where any receiver's checksum disagrees (`rlcore.dist.transfer.broadcast_delta`). The sender
  keeps a `PushCopy` of what it last pushed (`base`), each receiver one of what it last got (`mirror`);
  a LoRA policy's delta carries its adapter tensors.

Only `src` sends; the other sender ranks take part in gathering the weights. With `async_op` (full and
adapter pushes) the sender does not wait for the receivers: the works come back in `PushSent.works`,
each holding a copy of its tensor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlcore.dist.delta import Encoded, PushCopy, encode_all
from rlcore.dist.mesh import group_device
from rlcore.dist.stream import WeightPush
from rlcore.dist.transfer import StateFn, broadcast_delta, broadcast_weights, receive_delta, receive_weights

Kind = Literal["full", "adapters", "delta"]
"""How a push's weights travel (see the module docstring)."""

KINDS: tuple[Kind, ...] = get_args(Kind)
Load = Callable[[Iterator[tuple[str, Tensor]]], None]
"""A receiver's one engine update from a push's (name, tensor) pairs (e.g. `engine.load_weights`)."""


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What the sender tells the receivers before each push."""

    step: int
    """The steps trained when the push was made (the Tinker server: its version)."""
    version: int
    """The policy version the receivers sample with once they took it."""
    changed: bool
    """Whether weights follow (False: the receivers' weights are still current, e.g. an empty step)."""
    kind: Kind
    """How the weights travel."""

    def to_tensor(self, device: torch.device) -> Tensor:
        """The announcement on the wire: int64 [step, version, changed, kind]."""
        wire = [self.step, self.version, int(self.changed), KINDS.index(self.kind)]
        return torch.tensor(wire, device=device)

    @staticmethod
    def buffer(device: torch.device) -> Tensor:
        """An empty tensor that receives one (`dist.broadcast` into it, then `from_tensor`)."""
        return torch.zeros(4, dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, wire: Tensor) -> Announcement:
        """The announcement `to_tensor` encoded."""
        step, version, changed, kind = wire.cpu().tolist()
        return cls(step=step, version=version, changed=bool(changed), kind=KINDS[kind])


@dataclasses.dataclass(frozen=True)
class PushSent:
    """What one push sent, on one sender rank (bytes and fallbacks of a delta push: `src`'s account)."""

    note: Announcement
    announce_s: float
    """Seconds `src` spent announcing it (blocking: until the receivers took the announcement)."""
    tensors: int = 0
    """Tensors gathered (every sender rank)."""
    bytes: int = 0
    """Bytes on the wire (full and adapter pushes: every sender rank counts what it gathered)."""
    full_bytes: int = 0
    """What a full push of the same tensors sends."""
    fallbacks: int = 0
    """Delta pushes: full pushes sent because a receiver's checksum disagreed (0 or 1)."""
    encode_s: float = 0.0
    """Delta pushes: seconds `src` spent encoding."""
    works: tuple[Any, ...] = ()
    """`async_op`: the sends still in flight (wait on them before the process group goes)."""


def push_kind(model: nn.Module | None, base: PushCopy | None, state: StateFn | None) -> Kind:
    """How a push of `model` travels: delta where the sender keeps a `base`, else adapters where `state`
    picks some tensors (a LoRA policy's: `rlcore.models.lora.push_state`), else full (`model` None, no
    weights: full)."""
    if base is not None:
        return "delta"
    return "adapters" if model is not None and state is not None else "full"


def send_push(
    model: nn.Module | None,
    *,
    step: int,
    version: int,
    src: int,
    group: Any,
    bucket_bytes: int,
    state: StateFn | None = None,
    base: PushCopy | None = None,
    async_op: bool = False,
    corrupt: Callable[[list[Encoded]], list[Encoded]] | None = None,
) -> PushSent:
    """Every sender rank: announce `step` and `version` to the receivers of `group` and send `model`'s
    weights (None: nothing changed, only the announcement): the tensors `state` yields (None: every one; a
    LoRA policy's adapters: `rlcore.models.lora.push_state`). With `base` (on `src`; an empty `PushCopy`
    on the others) a delta push against it, which then holds what was pushed; `corrupt` (a test's)
    alters `src`'s encoded records before they are sent."""
    if base is not None and async_op:
        raise ValueError("a delta push waits for the receivers' checksums: it cannot be sent without waiting")
    leads = dist.get_rank() == src
    note = Announcement(step=step, version=version, changed=model is not None, kind=push_kind(model, base, state))
    started = time.perf_counter()
    works = []
    if leads:
        work = dist.broadcast(note.to_tensor(group_device(group)), src, group=group, async_op=async_op)
        works += [work] if work is not None else []
    announced = time.perf_counter() - started
    if model is None:
        return PushSent(note, announced, works=tuple(works))
    with WeightPush(model, bucket_bytes=bucket_bytes, all_ranks=True, state=state) as push:
        if leads and base is not None:
            return _send_delta(push, note, announced, src=src, group=group, base=base, corrupt=corrupt)
        if leads:
            works += broadcast_weights(model, push, src=src, group=group, async_op=async_op, state=state)
        else:
            for _ in push:  # the gathers are collectives of the sender ranks; only `src` sends
                pass
    sent = push.bytes if base is None else 0
    return PushSent(note, announced, push.tensors, sent, sent, works=tuple(works))


def _send_delta(
    push: WeightPush,
    note: Announcement,
    announced: float,
    *,
    src: int,
    group: Any,
    base: PushCopy,
    corrupt: Callable[[list[Encoded]], list[Encoded]] | None,
) -> PushSent:
    """`src`'s delta push of `push`'s tensors against `base`, which holds them afterwards."""
    new = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in push}
    started = time.perf_counter()
    records = encode_all(new, base.tensors)
    if corrupt is not None:
        records = corrupt(records)
    encoded = time.perf_counter() - started
    sent = broadcast_delta(records, new, src=src, group=group)
    base.replace(new)
    return PushSent(note, announced, push.tensors, sent.bytes, sent.full_bytes, sent.fallbacks, encoded)


def receive_announcement(*, src: int, group: Any) -> Announcement:
    """Every receiver rank: the next push's announcement (blocks until `src` sends it)."""
    wire = Announcement.buffer(group_device(group))
    dist.broadcast(wire, src, group=group)
    return Announcement.from_tensor(wire)


def receive_push(
    note: Announcement, load: Load, *, src: int, group: Any, mirror: PushCopy | None = None
) -> None:
    """Every receiver rank, after `note`: when weights follow, receive them and `load` them all (one
    engine update). A delta push (`mirror`: what this rank last got, which then holds the new tensors)
    is decoded and checked whole before `load` sees any of it."""
    if not note.changed:
        return
    if (note.kind == "delta") != (mirror is not None):
        raise ValueError(f"a {note.kind} push arrived at a receiver that expects "
                         f"{'delta' if mirror is not None else 'full or adapter'} pushes")  # fmt: skip
    if mirror is None:
        stream = receive_weights(src=src, group=group)
    else:
        tensors, _ = receive_delta(mirror.tensors, src=src, group=group)
        mirror.replace(tensors)
        stream = iter(tensors.items())
    load(stream)
    if sum(1 for _ in stream):  # read the rest, so the broadcasts stay matched; then refuse
        raise RuntimeError("the engine's load_weights left tensors of the push unread")


__all__ = [
    "KINDS", "Announcement", "Kind", "Load", "PushSent", "push_kind", "receive_announcement",
    "receive_push", "send_push",
]  # fmt: skip
