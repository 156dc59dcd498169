"""Batch: the one data container passed between steps (the role of verl's `DataProto`).

A `Batch` holds named tensors that share their leading (row) dimension, per-row Python values
(`non_tensors`: strings, ground truths, dicts, one list entry per row) and a small `meta` dict.
It is frozen: every operation returns a new Batch. Tensors are shared with the source, not
copied, so never write into them in place; lists are copied, their elements are shared.

    prompts = Batch.from_dict({"input_ids": ids, "uid": ["a", "b"]}, meta={"split": "train"})
    rollouts = prompts.repeat_interleave(4)            # 4 samples per prompt, same uid each
    rollouts = rollouts.with_(responses=resp)          # union; existing keys need overwrite=True
    for micro in rollouts.split(8): ...

Departures from DataProto: fields live in one namespace (`batch["key"]` finds tensors and lists
alike), `chunk(n)` requires `len % n == 0` (as DataProto does) while `split(size)` allows a short
last piece, and mixing dtypes in `concat` raises instead of promoting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

Index = slice | Tensor | Sequence[int] | Sequence[bool]


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """Named row-aligned tensors, per-row Python values and a meta dict; see the module docstring."""

    tensors: Mapping[str, Tensor] = dataclasses.field(default_factory=dict)
    """Tensors sharing their leading dimension (the rows)."""
    non_tensors: Mapping[str, list] = dataclasses.field(default_factory=dict)
    """Per-row Python values: one list entry per row."""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Batch-level values (not per row); carried through every operation."""

    def __post_init__(self) -> None:
        tensors = dict(self.tensors)
        non_tensors = {k: list(v) for k, v in self.non_tensors.items()}
        for key, value in tensors.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"Batch tensor {key!r} is a {type(value).__name__}, not a torch.Tensor")
            if value.dim() == 0:
                raise ValueError(f"Batch tensor {key!r} is 0-dimensional; it needs a leading row dimension")
        for key in non_tensors.keys() & tensors.keys():
            raise ValueError(f"Batch field {key!r} is both a tensor and a non-tensor")
        lengths = {k: v.shape[0] for k, v in tensors.items()} | {k: len(v) for k, v in non_tensors.items()}
        if lengths:
            first, n = next(iter(lengths.items()))
            for key, m in lengths.items():
                if m != n:
                    raise ValueError(f"Batch field {key!r} has {m} rows but {first!r} has {n}")
        object.__setattr__(self, "tensors", MappingProxyType(tensors))
        object.__setattr__(self, "non_tensors", MappingProxyType(non_tensors))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as plain dicts (mapping proxies do not pickle), e.g. for `broadcast_object_list`."""
        return Batch, (dict(self.tensors), dict(self.non_tensors), dict(self.meta))

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None) -> Batch:
        """Sort `fields` into tensors (torch.Tensor) and non-tensors (list, tuple, numpy array)."""
        tensors, non_tensors = {}, {}
        for key, value in fields.items():
            if isinstance(value, Tensor):
                tensors[key] = value
            elif isinstance(value, list | tuple | np.ndarray):
                non_tensors[key] = list(value)
            else:
                raise TypeError(
                    f"Batch field {key!r} is a {type(value).__name__}; use a Tensor or a list with one "
                    "entry per row (batch-level values go in meta)"
                )
        return cls(tensors=tensors, non_tensors=non_tensors, meta=meta or {})

    # -- inspection ---------------------------------------------------------------------------

    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        for value in self.non_tensors.values():
            return len(value)
        return 0

    def keys(self) -> tuple[str, ...]:
        """Field names: tensors first, then non-tensors."""
        return (*self.tensors, *self.non_tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __repr__(self) -> str:
        parts = [
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items()
        ]
        parts += [f"{k}: list" for k in self.non_tensors]
        meta = f", meta={sorted(self.meta)}" if self.meta else ""
        return f"Batch(len={len(self)}, {', '.join(parts)}{meta})"

    def __getitem__(self, index: str | Index) -> Any:
        """`batch["key"]` is a field; `batch[i:j]`, `batch[long_tensor]`, `batch[[0, 2]]`, `batch[bool_mask]` are rows."""
        if isinstance(index, str):
            if index in self.tensors:
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise KeyError(f"Batch has no field {index!r}; fields: {list(self.keys())}")
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
            return self._take(index, rows)
        if isinstance(index, int | np.integer):
            raise TypeError(f"Batch[{index}]: index rows with a slice (batch[{index}:{index + 1}]) or a list")
        idx = self._row_indices(index)
        return self._take(idx, idx.tolist())

    def _row_indices(self, index: Tensor | Sequence[int] | Sequence[bool]) -> Tensor:
        """Validated 1-D int64 row indices from a long/bool tensor or a list of ints/bools."""
        idx = index if isinstance(index, Tensor) else torch.as_tensor(list(index))
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        if idx.dim() != 1:
            raise ValueError(f"Batch row index must be 1-D, got shape {tuple(idx.shape)}")
        if idx.dtype == torch.bool:
            if idx.shape[0] != len(self):
                raise ValueError(
                    f"Batch boolean row mask has {idx.shape[0]} entries but the batch has {len(self)} rows"
                )
            return idx.nonzero().flatten().cpu()
        if idx.is_floating_point() or idx.is_complex():
            raise ValueError(f"Batch row index must hold integers or bools, got {idx.dtype}")
        idx = idx.to(torch.long).cpu()
        n = len(self)
        if bool(((idx < -n) | (idx >= n)).any()):  # negative indices count from the end, as in Python
            raise IndexError(f"Batch row index out of range for {n} rows: {idx.tolist()}")
        return idx

    def _take(self, tensor_index: slice | Tensor, rows: list[int]) -> Batch:
        tensors = {}
        for key, value in self.tensors.items():
            index = tensor_index if isinstance(tensor_index, slice) else tensor_index.to(value.device)
            tensors[key] = value[index]
        non_tensors = {k: [v[i] for i in rows] for k, v in self.non_tensors.items()}
        return Batch(tensors=tensors, non_tensors=non_tensors, meta=self.meta)

    # -- field operations ---------------------------------------------------------------------

    def select(self, *keys: str) -> Batch:
        """A Batch with only `keys` (tensors or non-tensors); meta is kept."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch.select: no field {missing[0]!r}; fields: {list(self.keys())}")
        return Batch(
            tensors={k: self.tensors[k] for k in keys if k in self.tensors},
            non_tensors={k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            meta=self.meta,
        )

    def with_(self, other: Batch | None = None, *, overwrite: bool = False, **fields: Any) -> Batch:
        """Union of this Batch, `other` and `fields` (tensors or lists); an existing key needs overwrite=True."""
        add = Batch.from_dict(fields)
        if other is not None:
            add = other._merged(add, overwrite=False, what="with_ (other vs keyword fields)")
        return self._merged(add, overwrite=overwrite, what="with_")

    def with_meta(self, **meta: Any) -> Batch:
        """This Batch with `meta` updated (meta keys may be replaced)."""
        return dataclasses.replace(self, meta={**self.meta, **meta})

    def _merged(self, add: Batch, *, overwrite: bool, what: str) -> Batch:
        if not overwrite:
            for key in (*add.tensors, *add.non_tensors):
                if key in self:
                    raise ValueError(
                        f"Batch.{what}: field {key!r} already exists (pass overwrite=True to replace it)"
                    )
            for key, value in add.meta.items():
                if key in self.meta and not _same(self.meta[key], value):
                    raise ValueError(
                        f"Batch.{what}: meta {key!r} already exists with another value (overwrite=True)"
                    )
        tensors = {k: v for k, v in self.tensors.items() if k not in add.non_tensors} | dict(add.tensors)
        non_tensors = {k: v for k, v in self.non_tensors.items() if k not in add.tensors} | dict(
            add.non_tensors
        )
        return Batch(tensors=tensors, non_tensors=non_tensors, meta={**self.meta, **add.meta})

    # -- row operations -----------------------------------------------------------------------

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of `size` rows; the last one may be shorter."""
        if size < 1:
            raise ValueError(f"Batch.split: size must be >= 1, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """`n` consecutive pieces of equal size; `len(self)` must divide by `n`."""
        if n < 1 or len(self) % n:
            raise ValueError(f"Batch.chunk({n}): {len(self)} rows do not split into {n} equal chunks")
        return self.split(len(self) // n) if len(self) else [self] * n

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated `n` times consecutively (n samples per prompt); `uid` repeats with its row."""
        if n < 1:
            raise ValueError(f"Batch.repeat_interleave: n must be >= 1, got {n}")
        return Batch(
            tensors={k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()},
            non_tensors={k: [x for x in v for _ in range(n)] for k, v in self.non_tensors.items()},
            meta=self.meta,
        )

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of all `batches` in order; keys, dtypes and trailing shapes must match."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat: no batches given")
        first = batches[0]
        meta = dict(first.meta)
        for i, b in enumerate(batches[1:], start=1):
            for key in sorted(set(first.keys()) ^ set(b.keys())):
                has, lacks = ("batch 0", f"batch {i}") if key in first else (f"batch {i}", "batch 0")
                raise ValueError(f"Batch.concat: field {key!r} is in {has} but missing from {lacks}")
            for key in first.tensors:
                if key not in b.tensors:
                    raise ValueError(
                        f"Batch.concat: field {key!r} is a tensor in batch 0 but a list in batch {i}"
                    )
                a, c = first.tensors[key], b.tensors[key]
                if a.dtype != c.dtype:
                    raise ValueError(
                        f"Batch.concat: field {key!r} is {a.dtype} in batch 0 but {c.dtype} in batch {i}"
                    )
                if a.shape[1:] != c.shape[1:]:
                    raise ValueError(
                        f"Batch.concat: field {key!r} has row shape {tuple(a.shape[1:])} in batch 0 "
                        f"but {tuple(c.shape[1:])} in batch {i}"
                    )
            for key, value in b.meta.items():
                if key in meta and not _same(meta[key], value):
                    raise ValueError(f"Batch.concat: meta {key!r} differs between batch 0 and batch {i}")
                meta.setdefault(key, value)
        return Batch(
            tensors={k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            non_tensors={k: [x for b in batches for x in b.non_tensors[k]] for k in first.non_tensors},
            meta=meta,
        )

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """All tensors moved to `device`."""
        tensors = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        return dataclasses.replace(self, tensors=tensors)


def _same(a: Any, b: Any) -> bool:
    """Whether two meta values agree (identity, or equality for non-tensors)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def group_ids(batch: Batch) -> Tensor:
    """A LongTensor (b,) labelling rows by prompt `uid` (samples of one prompt share a label, numbered in
    order of first appearance); without `uid`, every row is its own group."""
    if "uid" not in batch:
        return torch.arange(len(batch))
    labels: dict[Any, int] = {}
    return torch.tensor([labels.setdefault(uid, len(labels)) for uid in batch["uid"]], dtype=torch.long)
