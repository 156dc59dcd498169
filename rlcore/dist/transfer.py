"""Batches and weights between ranks without pickle: what split placement moves between its roles
(issue 16): rollouts from rollout ranks to trainer ranks, weights back.

    send_batch(batch, dst=1)              # rank 0
    batch = recv_batch(src=0)             # rank 1: the same fields, dtypes, shapes, values and meta
    with WeightPush(model) as push:       # a trainer rank (src)
        broadcast_weights(model, push, src=1, group=group)
    engine.load_weights(receive_weights(src=1, group=group))   # each rollout rank: one engine update

A batch travels as a JSON header (field names, dtypes, shapes, the per-row non-tensor values and the
meta dict, which must be JSON-able: strings, numbers, lists, dicts, None) and then its tensors, each
as one send. Tensors go over the group's device (CPU for gloo, the current CUDA device for nccl) and
arrive on the CPU. Sends are blocking unless `async_op`: a sender that must enter a collective before
its receiver reads (a weight push) keeps the returned works and waits on them later.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
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


def header(batch: Batch) -> Tensor:
    """The JSON description of `batch` (everything but the tensors' values) as `json_tensor`; ValueError
    names a field whose values are not JSON-able."""
    fields = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in batch.tensors.items()]
    for name, values in batch.non_tensors.items():
        try:
            json.dumps(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"send_batch: field {name!r} holds values JSON cannot carry ({e})") from None
    return json_tensor({"tensors": fields, "rows": dict(batch.non_tensors), "meta": dict(batch.meta)})


def send_batch(batch: Batch, dst: int, *, group: Any = None, async_op: bool = False) -> list[Any]:
    """Send `batch` to global rank `dst` (see the module docstring); returns the works when `async_op`."""
    device = group_device(group)
    text = header(batch)
    pieces = [torch.tensor([text.numel()], dtype=torch.int64), text]
    pieces += [t.detach().contiguous() for t in batch.tensors.values() if t.numel()]  # empty ones: shape only
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
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        if tensor.numel():
            dist.recv(tensor, src, group=group)
        tensors[name] = tensor.cpu()
    return Batch(tensors=tensors, non_tensors=doc["rows"], meta=doc["meta"])


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
