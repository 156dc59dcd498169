"""Batches and weights between ranks without pickle: what split placement moves between its roles:
rollouts from rollout ranks to trainer ranks, weights back.

    send_batch(batch, dst=1)              # rank 0
    batch = recv_batch(src=0)             # rank 1: the same fields, dtypes, shapes, values and meta
    with WeightPush(model) as push:       # a trainer rank (src)
        broadcast_weights(model, push, src=1, group=group)
    engine.load_weights(receive_weights(src=1, group=group))   # each rollout rank: one engine update
    sent = broadcast_delta(encode_all(new, base), new, src=1, group=group)   # delta pushes (rlcore.dist.delta)
    tensors, fallbacks = receive_delta(mirror, src=1, group=group)           # each rollout rank

A batch travels as a JSON header (field names, dtypes, shapes, the per-row non-tensor values and the
meta dict, which must be JSON-able: strings, numbers, lists, dicts, None) and then its tensors, each
as one send. Tensors inside the per-row values (a vision-language batch's `multi_modal_inputs`) travel
after them, each tensor once however many rows share it (`rows_to_json`), and arrive shared again. Tensors go over the group's device (CPU for gloo, the current CUDA device for nccl) and
arrive on the CPU. Sends are blocking unless `async_op`: a sender that must enter a collective before
its receiver reads (a weight push) keeps the returned works and waits on them later.

A delta push is a manifest of `rlcore.dist.delta.Entry` (name, dtype, shape, encoding, payload length,
checksum, chunk lengths), one uint8 broadcast per payload, then one all-reduce (MAX) of every receiver's
"a checksum disagreed" flag (the sender's is 0): if any receiver disagrees, the sender broadcasts every
tensor raw, and every receiver takes that instead. It always blocks (the sender waits for the reply).

Weight pushes between the roles of split placement use these through `rlcore.dist.push` (announcement,
full / adapter / delta kinds, both ends).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore.batch import Batch
from rlcore.dist.delta import DTYPES, Encoded, Entry, decode_all, encode_all
from rlcore.dist.mesh import group_device
from rlcore.dist.reduce import world_max
from rlcore.dist.stream import unique_state

StateFn = Callable[[torch.nn.Module], Iterable[tuple[str, Tensor]]]
"""Which (name, tensor) pairs of a model a push sends (rlcore.dist.stream.iter_full_state's `state`)."""

_DTYPES = DTYPES  # the dtypes a push or a batch carries, by name


def json_tensor(doc: Any) -> Tensor:
    """`doc` as a uint8 tensor of its JSON text (TypeError / ValueError when JSON cannot carry it)."""
    return torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)


def tensor_json(text: Tensor) -> Any:
    """The value `json_tensor` encoded."""
    return json.loads(text.cpu().numpy().tobytes().decode())


_TENSOR = "__tensor__"


def rows_to_json(rows: Mapping[str, list]) -> tuple[dict[str, list], list[Tensor]]:
    """(the per-row values with every tensor in them replaced by `{"__tensor__": k}`, the tensors): a
    tensor several rows share (a prompt's images, shared by its samples) is listed once."""
    tensors: list[Tensor] = []
    index: dict[int, int] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            if id(value) not in index:
                index[id(value)] = len(tensors)
                tensors.append(value)
            return {_TENSOR: index[id(value)]}
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v) for v in value]
        return value

    return {name: walk(values) for name, values in rows.items()}, tensors


def rows_from_json(doc: Mapping[str, list], tensors: Sequence[Tensor]) -> dict[str, list]:
    """The per-row values `rows_to_json` encoded, its tensors put back (shared where they were)."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                return tensors[value[_TENSOR]]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return {name: walk(values) for name, values in doc.items()}


def _described(tensors: Iterable[Tensor]) -> list[list[Any]]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def header(batch: Batch) -> tuple[Tensor, list[Tensor]]:
    """(the JSON description of `batch` (everything but the tensors' values) as `json_tensor`, the tensors
    held in its per-row values); ValueError names a field whose values are not JSON-able."""
    fields = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in batch.tensors.items()]
    rows, row_tensors = rows_to_json(batch.non_tensors)
    for name, values in rows.items():
        try:
            json.dumps(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"send_batch: field {name!r} holds values JSON cannot carry ({e})") from None
    doc = {"tensors": fields, "rows": rows, "row_tensors": _described(row_tensors), "meta": dict(batch.meta)}
    return json_tensor(doc), row_tensors


def send_batch(batch: Batch, dst: int, *, group: Any = None, async_op: bool = False) -> list[Any]:
    """Send `batch` to global rank `dst` (see the module docstring); returns the works when `async_op`."""
    device = group_device(group)
    text, row_tensors = header(batch)
    pieces = [torch.tensor([text.numel()], dtype=torch.int64), text]
    tensors = [*batch.tensors.values(), *row_tensors]
    pieces += [t.detach().contiguous() for t in tensors if t.numel()]  # empty ones: shape only
    send = dist.isend if async_op else dist.send
    works = [send(p.to(device), dst, group=group) for p in pieces]
    return [w for w in works if w is not None]


def recv_batch(src: int, *, group: Any = None) -> Batch:
    """Receive a batch that global rank `src` sent with `send_batch`; tensors on the CPU."""
    device = group_device(group)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    text = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(text, src, group=group)
    doc = tensor_json(text)
    tensors: dict[str, Tensor] = {}
    for name, dtype, shape in doc["tensors"]:
        tensors[name] = _recv_tensor(dtype, shape, src, group, device)
    row_tensors = [_recv_tensor(dtype, shape, src, group, device) for dtype, shape in doc["row_tensors"]]
    return Batch(tensors=tensors, non_tensors=rows_from_json(doc["rows"], row_tensors), meta=doc["meta"])


def _recv_tensor(dtype: str, shape: list[int], src: int, group: Any, device: torch.device) -> Tensor:
    tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    if tensor.numel():
        dist.recv(tensor, src, group=group)
    return tensor.cpu()


def weight_manifest(model: torch.nn.Module, state: StateFn | None = None) -> list[list[Any]]:
    """[name, dtype, full shape] of each tensor a `WeightPush` of `model` with `state` sends, in its
    order (default: the whole state, tied tensors once; DTensors by their global shape, nothing
    gathered)."""
    return [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        for name, t in (state or unique_state)(model)
    ]


def broadcast_weights(
    model: torch.nn.Module,
    weights: Any,
    *,
    src: int,
    group: Any = None,
    async_op: bool = False,
    state: StateFn | None = None,
) -> list[Any]:
    """Send a push of `model` (`weights`: its `WeightPush` with `state`, iterated here) from `src` to
    every other rank of `group`, whose `receive_weights` feeds its engine; one broadcast per tensor after
    a manifest.
    With `async_op` nothing waits for the receivers: the works are returned (each holds a copy of its
    tensor, so the model may change meanwhile)."""
    device = group_device(group)
    text = json_tensor(weight_manifest(model, state))
    pieces = [torch.tensor([text.numel()], dtype=torch.int64, device=device), text.to(device)]
    works = [dist.broadcast(piece, src, group=group, async_op=async_op) for piece in pieces]
    for _, tensor in weights:
        tensor = tensor.detach().to(device).contiguous()
        works.append(
            dist.broadcast(tensor.clone() if async_op else tensor, src, group=group, async_op=async_op)
        )
    return [w for w in works if w is not None]


def receive_weights(*, src: int, group: Any = None) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs `broadcast_weights` sends, as they arrive: give the iterator to one
    `engine.load_weights` call (one update of the engine). It must be read to the end."""
    device = group_device(group)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    text = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(text, src, group=group)
    for name, dtype, shape in tensor_json(text):
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        dist.broadcast(tensor, src, group=group)
        yield name, tensor


@dataclasses.dataclass(frozen=True)
class DeltaSent:
    """What one delta push sent (the sender's account)."""

    bytes: int
    """Payload bytes broadcast (a fallback's full push included)."""
    full_bytes: int
    """What a full push of the same tensors sends."""
    fallbacks: int
    """Full pushes sent because a receiver's checksum disagreed (0 or 1)."""


def broadcast_delta(
    records: Sequence[Encoded], new: Mapping[str, Tensor], *, src: int, group: Any = None
) -> DeltaSent:
    """Send a delta push from `src` to every other rank of `group` (their `receive_delta`): `records`
    (`rlcore.dist.delta.encode_all` of `new` against the base the receivers hold), then, if any receiver's
    checksum disagrees, `new` whole. Blocks until every receiver has replied."""
    sent = _broadcast_records(records, src, group)
    full = sum(r.entry.raw_bytes for r in records)
    if not _disagreed(False, group):
        return DeltaSent(sent, full, 0)
    return DeltaSent(sent + _broadcast_records(encode_all(new, {}), src, group), full, 1)


def receive_delta(
    base: Mapping[str, Tensor], *, src: int, group: Any = None, workers: int | None = None
) -> tuple[dict[str, Tensor], int]:
    """(the tensors of `broadcast_delta`'s push, decoded against `base` (what this rank last received) and
    checked; the full pushes taken: 1 where some receiver's checksum disagreed, else 0). A full push that
    disagrees too raises: the transport itself corrupts what it carries."""
    tensors, bad = decode_all(_received_records(src, group), base, workers=workers)
    if not _disagreed(bool(bad), group):
        return tensors, 0
    tensors, still = decode_all(_received_records(src, group), {}, workers=workers)
    if still:
        raise RuntimeError(f"a full weight push arrived corrupted ({still[0]}): the transport is at fault")
    return tensors, 1


def _disagreed(mine: bool, group: Any) -> bool:
    """Whether any rank of `group` says its checksums disagree (a collective of the whole group)."""
    return world_max([int(mine)], group)[0] > 0


def _broadcast_records(records: Sequence[Encoded], src: int, group: Any) -> int:
    """A manifest of `records`, then each payload; the payload bytes sent."""
    device = group_device(group)
    text = json_tensor([r.entry.to_json() for r in records])
    for piece in (torch.tensor([text.numel()], dtype=torch.int64), text):
        dist.broadcast(piece.to(device), src, group=group)
    for r in records:
        if r.entry.length:
            dist.broadcast(r.payload.to(device), src, group=group)
    return sum(r.entry.length for r in records)


def _received_records(src: int, group: Any) -> Iterator[tuple[Entry, Tensor]]:
    """The (entry, payload) pairs `_broadcast_records` sends, payloads on the CPU, as they arrive."""
    device = group_device(group)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    text = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(text, src, group=group)
    for doc in tensor_json(text):
        entry = Entry.from_json(doc)
        payload = torch.empty(entry.length, dtype=torch.uint8, device=device)
        if entry.length:
            dist.broadcast(payload, src, group=group)
        yield entry, payload.cpu()


__all__ = [
    "DeltaSent", "broadcast_delta", "broadcast_weights", "group_device", "header", "json_tensor", "receive_delta",
    "receive_weights", "recv_batch", "send_batch", "tensor_json", "weight_manifest",
]  # fmt: skip
