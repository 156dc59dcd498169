"""Batches and weights between ranks without pickle: what split placement moves between its roles
(issue 16): rollouts from rollout ranks to trainer ranks, weights back.

    send_batch(batch, dst=1)              # rank 0
    batch = recv_batch(src=0)             # rank 1: the same fields, dtypes, shapes, values and meta
    with WeightPush(model) as push:       # a trainer rank (src)
        broadcast_weights(model, push, src=1, group=group)
    engine.load_weights(receive_weights(src=1, group=group))   # each rollout rank: one engine update

A batch travels as a JSON header (field names, dtypes, shapes, the per-row non-tensor values and the
meta dict, which must be JSON-able: strings, numbers, lists, dicts, None) and then its tensors, each
as one send. Tensors inside the per-row values (a vision-language batch's `multi_modal_inputs`) travel
after them, each tensor once however many rows share it (`rows_to_json`), and arrive shared again. Tensors go over the group's device (CPU for gloo, the current CUDA device for nccl) and
arrive on the CPU. Sends are blocking unless `async_op`: a sender that must enter a collective before
its receiver reads (a weight push) keeps the returned works and waits on them later.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore.batch import Batch
from rlcore.dist.mesh import group_device
from rlcore.dist.stream import unique_state

StateFn = Callable[[torch.nn.Module], Iterable[tuple[str, Tensor]]]
"""Which (name, tensor) pairs of a model a push sends (rlcore.dist.stream.iter_full_state's `state`)."""

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                                       torch.int8, torch.int16, torch.int32, torch.int64,
                                                       torch.uint8, torch.bool)}  # fmt: skip


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


__all__ = [
    "broadcast_weights", "group_device", "header", "json_tensor", "receive_weights", "recv_batch", "send_batch", "tensor_json",
    "weight_manifest",
]  # fmt: skip
