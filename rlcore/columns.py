"""The batch schema: which side of `[prompt | response]` each per-token field lies on, its column axis and its
pad value, and the three column operations written once over it.

    padded = pad_columns(batch, prompt_width, response_width, pad_id)   # to wider prompts and responses
    aligned = left_pad_prompts(batch, extra, pad_id)                     # `extra` more prompt columns
    cut = cut_columns(batch, first, width)                               # prompt from `first`, `width` responses

A rolled-out batch's prompt fields are left-padded (their real tokens end at the last column) and its response
fields right-padded. `COLUMNS` names every field whose rule is not the default; any other 2-D tensor as wide
as `responses` is a per-token response field padded with 0 (log-probs, masks, scores, advantages). A new
per-token field with another pad value or axis is a new row, not a new branch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor

from rlcore.batch import Batch

PAD_ID = "pad id"
"""A `Column.pad` standing for the tokenizer's pad id (given to each operation)."""


@dataclasses.dataclass(frozen=True)
class Column:
    """How one per-token field is laid out."""

    side: Literal["prompt", "response"]
    """Prompt fields are left-padded, response fields right-padded."""
    axis: int
    """The field's column (sequence) axis."""
    pad: int | str
    """The value on padding columns (`PAD_ID`: the tokenizer's pad id)."""


COLUMNS: dict[str, Column] = {
    "input_ids": Column("prompt", 1, PAD_ID),
    "attention_mask": Column("prompt", 1, 0),
    "position_ids": Column("prompt", 1, 0),
    "prompt_routes": Column("prompt", 1, -1),  # (b, p, L, k): a mixture of experts' recorded experts, -1: none
    "rope_positions": Column("prompt", 2, 0),  # (b, 3, p): a vision-language prompt's M-RoPE positions
    "responses": Column("response", 1, PAD_ID),
    "response_routes": Column("response", 1, -1),  # (b, t, L, k)
    "response_rope_positions": Column("response", 2, 0),  # (b, 3, t): where observations brought images
}
"""Field -> its layout, for every field whose layout is not the default `RESPONSE_TOKENS`."""

RESPONSE_TOKENS = Column("response", 1, 0)
"""The layout of any other 2-D tensor as wide as `responses`."""


def columns_of(batch: Batch) -> Iterator[tuple[str, Column]]:
    """The batch's per-token tensor fields with their layouts (see the module docstring)."""
    width = batch["responses"].shape[1] if "responses" in batch else None
    for key in batch.keys():  # noqa: SIM118  (iterating a Batch would go over rows)
        value = batch[key]
        if not isinstance(value, Tensor):
            continue
        if key in COLUMNS:
            yield key, COLUMNS[key]
        elif value.dim() == 2 and value.shape[1] == width:
            yield key, RESPONSE_TOKENS


def _pad(x: Tensor, column: Column, before: int, after: int, pad_id: int) -> Tensor:
    value = pad_id if column.pad == PAD_ID else column.pad
    widths = (0, 0) * (x.dim() - 1 - column.axis) + (before, after)
    return torch.nn.functional.pad(x, widths, value=value)


def pad_columns(batch: Batch, prompt_width: int, response_width: int, pad_id: int) -> Batch:
    """`batch` with its prompt fields left-padded to `prompt_width` columns and its response fields
    right-padded to `response_width`."""
    padded = {}
    for key, column in columns_of(batch):
        x = batch[key]
        have = x.shape[column.axis]
        if column.side == "prompt" and have < prompt_width:
            padded[key] = _pad(x, column, prompt_width - have, 0, pad_id)
        elif column.side == "response" and have < response_width:
            padded[key] = _pad(x, column, 0, response_width - have, pad_id)
    return batch.with_(**padded, overwrite=True) if padded else batch


def left_pad_prompts(batch: Batch, extra: int, pad_id: int) -> Batch:
    """`batch` with `extra` more padding columns before its prompt fields."""
    if not extra:
        return batch
    padded = {key: _pad(batch[key], column, extra, 0, pad_id) for key, column in columns_of(batch)
              if column.side == "prompt"}  # fmt: skip
    return batch.with_(**padded, overwrite=True)


def cut_columns(batch: Batch, first: int, width: int) -> Batch:
    """`batch` with its prompt fields from column `first` on and its response fields cut to `width` columns."""
    cut = {}
    for key, column in columns_of(batch):
        index = [slice(None)] * batch[key].dim()
        index[column.axis] = slice(first, None) if column.side == "prompt" else slice(None, width)
        cut[key] = batch[key][tuple(index)]
    return batch.with_(**cut, overwrite=True) if cut else batch
