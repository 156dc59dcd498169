"""Batches between ranks, point to point, without pickle: what split placement moves from rollout ranks
to trainer ranks (issue 16).

    send_batch(batch, dst=1)              # rank 0
    batch = recv_batch(src=0)             # rank 1: the same fields, dtypes, shapes, values and meta

A batch travels as a JSON header (field names, dtypes, shapes, the per-row non-tensor values and the
meta dict, which must be JSON-able: strings, numbers, lists, dicts, None) and then its tensors, each
as one send. Tensors go over the group's device (CPU for gloo, the current CUDA device for nccl) and
arrive on the CPU. Sends are blocking unless `async_op`: a sender that must enter a collective before
its receiver reads (a weight push) keeps the returned works and waits on them later.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore.batch import Batch

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                                       torch.int8, torch.int16, torch.int32, torch.int64,
                                                       torch.uint8, torch.bool)}  # fmt: skip


def _device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def header(batch: Batch) -> bytes:
    """The JSON description of `batch` (everything but the tensors' values); ValueError names a field
    whose values are not JSON-able."""
    fields = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in batch.tensors.items()]
    for name, values in batch.non_tensors.items():
        try:
            json.dumps(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"send_batch: field {name!r} holds values JSON cannot carry ({e})") from None
    doc = {"tensors": fields, "rows": dict(batch.non_tensors), "meta": dict(batch.meta)}
    return json.dumps(doc).encode()


def send_batch(batch: Batch, dst: int, *, group: Any = None, async_op: bool = False) -> list[Any]:
    """Send `batch` to global rank `dst` (see the module docstring); returns the works when `async_op`."""
    device = _device(group)
    text = torch.frombuffer(bytearray(header(batch)), dtype=torch.uint8)
    pieces = [torch.tensor([text.numel()], dtype=torch.int64), text]
    pieces += [t.detach().contiguous() for t in batch.tensors.values() if t.numel()]  # empty ones: shape only
    send = dist.isend if async_op else dist.send
    works = [send(p.to(device), dst, group=group) for p in pieces]
    return [w for w in works if w is not None]


def recv_batch(src: int, *, group: Any = None) -> Batch:
    """Receive a batch that global rank `src` sent with `send_batch`; tensors on the CPU."""
    device = _device(group)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    text = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(text, src, group=group)
    doc = json.loads(text.cpu().numpy().tobytes().decode())
    tensors: dict[str, Tensor] = {}
    for name, dtype, shape in doc["tensors"]:
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        if tensor.numel():
            dist.recv(tensor, src, group=group)
        tensors[name] = tensor.cpu()
    return Batch(tensors=tensors, non_tensors=doc["rows"], meta=doc["meta"])


__all__ = ["header", "recv_batch", "send_batch"]
