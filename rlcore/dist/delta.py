"""Delta weight pushes: per tensor, only what changed since the copy the receiver holds.

    records = encode_all(new, base)            # the sender: {name: CPU tensor} now and as last pushed
    [r.entry for r in records]                 # the manifest (Entry.to_json), then each r.payload
    tensors, bad = decode_all(zip(entries, payloads), mirror)   # a receiver: the new tensors, what failed

Encoding "xor": the new tensor's bytes XOR the base's (both viewed as the integer dtype of their width,
`torch.bitwise_xor`), cut into chunks of `CHUNK_BYTES`; each chunk regrouped into byte planes (every
element's lowest byte, then the next, ...), each plane zlib-compressed where that pays, the planes'
lengths in the entry. An update moves a float's low mantissa bits and leaves its sign and exponent, so
the high planes of the XOR are zeros that compress to nearly nothing, and an unchanged element is zeros in
every plane; a plane whose sample does not compress below `WORTH` of its size (the low mantissa bytes of
fp32 weights that all moved: random bits) travels raw without spending zlib's time on it. Encoding "raw":
the tensor's bytes themselves, where there is no base (the first push), the base has another dtype or
shape, or the delta would not be smaller.

Every entry carries the CRC-32 of the new tensor's bytes, which the receiver checks after decoding: a
mirror that drifted from the sender's base, a corrupted payload, a lost chunk all disagree (zlib's own
stream check catches some of these first; `decode_all` reports both the same way). Chunks of every tensor
are encoded and decoded in a thread pool (zlib, CRC-32 and torch's bitwise ops release the GIL).

torch and the standard library only.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch import Tensor

Encoding = Literal["raw", "xor"]

CHUNK_BYTES = 4 * 2**20
"""The raw bytes of one chunk: a unit of work for the pool (a large tensor is several)."""
LEVEL = 1
"""zlib's compression level: 1, the fastest (on SmolLM2 deltas level 3 saves 1-7% of the bytes at 1.1-1.2x
the time, level 6 3-32% at 1.8-2.9x: experiments/bench_delta_push.py; the codec, not the wire, bounds a push)."""
SAMPLE = 64 * 2**10
"""The bytes of a plane compressed first, to decide whether the whole plane is worth compressing."""
WORTH = 0.9
"""A plane whose sample compresses to more than this share of its bytes travels raw."""

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                                     torch.int8, torch.int16, torch.int32, torch.int64,
                                                     torch.uint8, torch.bool)}  # fmt: skip
"""The dtypes a push carries, by the name a manifest gives them."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a push as its manifest describes it."""

    name: str
    dtype: str
    """The tensor's dtype as `DTYPES` names it."""
    shape: tuple[int, ...]
    encoding: Encoding
    length: int
    """Bytes of its payload."""
    checksum: int
    """CRC-32 of the new tensor's bytes."""
    planes: tuple[int, ...] = ()
    """"xor": the length of each chunk's byte planes, chunk by chunk (they add up to `length`); a plane as
    long as its chunk has elements travels raw, a shorter one zlib-compressed."""

    def to_json(self) -> list[Any]:
        return [
            self.name,
            self.dtype,
            list(self.shape),
            self.encoding,
            self.length,
            self.checksum,
            list(self.planes),
        ]

    @classmethod
    def from_json(cls, doc: Sequence[Any]) -> Entry:
        name, dtype, shape, encoding, length, checksum, planes = doc
        return cls(name, dtype, tuple(shape), encoding, length, checksum, tuple(planes))

    @property
    def raw_bytes(self) -> int:
        """Bytes of the tensor itself (what a full push sends of it)."""
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One tensor of a push: its entry and its payload (uint8, `entry.length` bytes)."""

    entry: Entry
    payload: Tensor


class PushCopy:
    """What one end of delta pushes holds: the tensors as last pushed (the sender's base) or as last
    received (a receiver's mirror), on the CPU. Empty until the first push, so that one is full. Costs
    one copy of everything a push carries in CPU memory, on each end."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def replace(self, tensors: dict[str, Tensor]) -> None:
        """Hold `tensors` from now on (never changed in place: the receiver's engine may be loading them)."""
        self.tensors = tensors


def as_bytes(t: Tensor) -> Tensor:
    """The bytes of `t` (a CPU tensor) as a flat uint8 tensor (a view where `t` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def checksum(t: Tensor) -> int:
    """CRC-32 of the bytes of `t` (a CPU tensor)."""
    data = as_bytes(t)
    return zlib.crc32(data.numpy()) if data.numel() else 0


def _ints(t: Tensor) -> Tensor:
    """`t`'s elements as a flat tensor of the integer dtype of their width (the same bits)."""
    return t.contiguous().reshape(-1).view(_INTS[t.element_size()])


def _spans(numel: int, width: int) -> list[slice]:
    """The element ranges of the chunks of a tensor of `numel` elements of `width` bytes."""
    step = max(1, CHUNK_BYTES // width)
    return [slice(a, min(a + step, numel)) for a in range(0, numel, step)]


def _pack(new: Tensor, base: Tensor, level: int) -> list[bytes]:
    """One chunk (integer views of equal length): the byte planes of its XOR, each compressed or raw.
    (A strided copy per plane: 4x faster here than a transpose of the (elements, width) bytes.)"""
    width = new.element_size()
    xor = torch.bitwise_xor(new, base).view(torch.uint8)
    return [_squeeze(xor[k::width].contiguous().numpy(), level) for k in range(width)]


def _squeeze(plane: Any, level: int) -> bytes:
    """`plane` (a uint8 array) zlib-compressed where that is worth it and shorter, else its bytes."""
    if len(plane) > SAMPLE and len(zlib.compress(plane[:SAMPLE], level)) > WORTH * SAMPLE:
        return plane.tobytes()
    packed = zlib.compress(plane, level)
    return packed if len(packed) < len(plane) else plane.tobytes()


def _unpack(blob: Tensor, lengths: Sequence[int], base: Tensor, out: Tensor) -> None:
    """Decode one chunk (`blob`: its planes, of `lengths`) against `base` into `out` (integer views)."""
    n, width, into = base.numel(), len(lengths), out.view(torch.uint8)
    for k, (a, b) in enumerate(itertools.pairwise(_offsets(lengths))):
        part = blob[a:b]
        if b - a != n:
            part = zlib.decompress(part.numpy())
            if len(part) != n:
                raise ValueError(f"a plane of {len(part)} bytes in a chunk of {n} elements")
            part = torch.frombuffer(bytearray(part), dtype=torch.uint8)
        into[k::width] = part
    torch.bitwise_xor(out, base, out=out)


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _raw(name: str, t: Tensor, crc: int) -> Encoded:
    data = as_bytes(t)
    entry = Entry(name, _dtype_name(t), tuple(t.shape), "raw", data.numel(), crc)
    return Encoded(entry, data)


def _deltable(new: Tensor, base: Tensor | None) -> bool:
    return base is not None and base.dtype == new.dtype and base.shape == new.shape and new.numel() > 0


def _pool(workers: int | None) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1, thread_name_prefix="delta")


def encode_all(
    new: Mapping[str, Tensor], base: Mapping[str, Tensor], *, workers: int | None = None, level: int = LEVEL
) -> list[Encoded]:
    """Each tensor of `new` (CPU, contiguous) against the tensor of the same name in `base`, in `new`'s
    order: "xor" where that is smaller than the tensor's bytes, else "raw" (a raw payload is a view of the
    tensor itself). `workers` threads (default: one per CPU)."""
    with _pool(workers) as pool:
        crcs = {name: pool.submit(checksum, t) for name, t in new.items()}
        packed: dict[str, list[Future[list[bytes]]]] = {}
        for name, t in new.items():
            if _deltable(t, base.get(name)):
                a, b = _ints(t), _ints(base[name])
                packed[name] = [
                    pool.submit(_pack, a[s], b[s], level) for s in _spans(t.numel(), t.element_size())
                ]
        return [_record(name, t, crcs[name].result(), packed.get(name)) for name, t in new.items()]


def _record(name: str, t: Tensor, crc: int, chunks: list[Future[list[bytes]]] | None) -> Encoded:
    """An "xor" record of the packed `chunks` where smaller than the tensor's bytes, else a "raw" one."""
    if chunks is None:
        return _raw(name, t, crc)
    blobs = [blob for c in chunks for blob in c.result()]
    lengths = tuple(len(b) for b in blobs)
    if sum(lengths) >= t.numel() * t.element_size():
        return _raw(name, t, crc)
    payload = torch.frombuffer(bytearray().join(blobs), dtype=torch.uint8)
    entry = Entry(name, _dtype_name(t), tuple(t.shape), "xor", sum(lengths), crc, lengths)
    return Encoded(entry, payload)


def _decode_chunks(
    entry: Entry, payload: Tensor, base: Tensor | None, submit: Callable
) -> tuple[Tensor, list[Future]]:
    """The tensor `entry` describes, filled by the returned futures ("xor"; "raw": the payload's own storage,
    at once); ValueError where the pair cannot be decoded."""
    dtype, shape = DTYPES[entry.dtype], entry.shape
    if payload.numel() != entry.length:
        raise ValueError(f"{payload.numel()} payload bytes, the manifest says {entry.length}")
    if entry.encoding == "raw":
        if entry.length != entry.raw_bytes:
            raise ValueError(f"a raw payload of {entry.length} bytes for a tensor of {entry.raw_bytes}")
        return payload.view(dtype).reshape(shape), []
    if base is None or base.dtype != dtype or tuple(base.shape) != shape:
        raise ValueError("a delta against a base this side does not hold")
    out = torch.empty(shape, dtype=dtype)
    ints, base_ints, width = _ints(out), _ints(base), out.element_size()
    spans, offsets = _spans(out.numel(), width), _offsets(entry.planes)
    if len(spans) * width != len(entry.planes) or offsets[-1] != entry.length:
        raise ValueError(f"{len(entry.planes)} planes for a tensor of {len(spans)} chunks of {width}")
    futures = []
    for i, s in enumerate(spans):
        a, b = offsets[i * width], offsets[(i + 1) * width]
        lengths = entry.planes[i * width : (i + 1) * width]
        futures.append(submit(_unpack, payload[a:b], lengths, base_ints[s], ints[s]))
    return out, futures


def _offsets(lengths: Sequence[int]) -> list[int]:
    """Where each of the consecutive blobs of `lengths` starts, and the end of the last."""
    return [0, *itertools.accumulate(lengths)]


def decode_all(
    records: Iterable[tuple[Entry, Tensor]], base: Mapping[str, Tensor], *, workers: int | None = None
) -> tuple[dict[str, Tensor], list[str]]:
    """(the new tensors, in order; why each tensor that could not be decoded or whose checksum disagrees
    failed, by name) from (entry, payload) pairs against `base`, the tensors this side holds. Decoding
    starts as each pair is read (`records` may be an iterator over payloads still arriving); nothing in
    `base` changes. A raw tensor keeps its payload's storage."""
    tensors: dict[str, Tensor] = {}
    chunks: list[tuple[Entry, list[Future]]] = []
    failed: dict[str, str] = {}
    with _pool(workers) as pool:
        for entry, payload in records:
            try:
                tensors[entry.name], futures = _decode_chunks(
                    entry, payload, base.get(entry.name), pool.submit
                )
                chunks.append((entry, futures))
            except (ValueError, KeyError, RuntimeError) as e:  # KeyError: a dtype no push carries
                failed[entry.name] = str(e)
        crcs = {}
        for entry, futures in chunks:  # every chunk decoded (waited for here: no task waits on another)
            error = _first_error(futures)
            if error:
                failed[entry.name] = error
            else:
                crcs[entry.name] = (entry.checksum, pool.submit(checksum, tensors[entry.name]))
        failed |= {name: "checksum disagrees" for name, (want, got) in crcs.items() if got.result() != want}
    kept = {name: t for name, t in tensors.items() if name not in failed}
    return kept, [f"{name}: {why}" for name, why in failed.items()]


def _first_error(futures: list[Future]) -> str:
    """'' when every future finished, else the first one's exception."""
    for f in futures:
        error = f.exception()
        if error is not None:
            return str(error) or type(error).__name__
    return ""


__all__ = ["CHUNK_BYTES", "DTYPES", "LEVEL", "Encoded", "Entry", "PushCopy", "as_bytes", "checksum", "decode_all",
           "encode_all"]  # fmt: skip
