"""A prompt dataset with a seeded shuffle per epoch and a resumable cursor.

Epoch e visits the rows in the order `torch.randperm(n, generator=Generator().manual_seed(
mix(seed, e)))`, so the order depends on (seed, epoch) only. A `Cursor(epoch, position)` says
where the next batch starts; a batch that runs past the end of an epoch continues at the start of
the next one (no row is skipped, unlike a `drop_last` loader). Resuming from a saved cursor
therefore yields exactly the rows an uninterrupted run would.

    ds = PromptDataset.from_files(["train.parquet"], tokenizer, max_prompt_length=512)
    batch = ds.next_batch(32)                     # or, purely: batch, cursor = ds.take(cursor, 32)
    state = ds.state_dict()                       # {"epoch", "position", "seed", "num_rows"}
    ds.load_state_dict(state)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.batch import Batch
from rlcore.data.prompts import Overlong, encode_rows_keeping_lengths, pad_token_id, prompt_batch
from rlcore.data.rows import DataError, Row, read_rows
from rlcore.data.vision import VisionProcessor


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where the next batch starts: row `position` of epoch `epoch`'s shuffled order."""

    epoch: int = 0
    """Passes completed over the data."""
    position: int = 0
    """Index into this epoch's order, in [0, num_rows)."""


def percentile(ordered: Sequence[int], q: float) -> int:
    """The q-th percentile of sorted values (nearest rank: the smallest value with >= q% at or below it)."""
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100)
    return ordered[int(rank) - 1]


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed that depends on (seed, epoch) only."""
    digest = hashlib.blake2b(f"rlcore-data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class PromptDataset:
    """Validated, tokenized prompt rows; batches come out as prompt Batches (see `rlcore.data.prompts`).

    The rows and their token ids never change after construction; the only state is `cursor`, used
    by `next_batch` / `state_dict` / `load_state_dict`. `take` is the same without the state.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        tokenizer: Any,
        *,
        max_prompt_length: int | None = None,
        overlong: Overlong = "error",
        seed: int = 0,
        shuffle: bool = True,
        name: str = "dataset",
        tools: Sequence[dict] = (),
        vision: VisionProcessor | None = None,
    ) -> None:
        if not rows:
            raise DataError(f"{name}: no rows")
        self.bad_images: list[str] = []  # with overlong="drop": the errors of rows dropped for their images
        self.rows, self.token_ids, self.dropped_lengths = encode_rows_keeping_lengths(
            rows, tokenizer, max_prompt_length=max_prompt_length, overlong=overlong, tools=tools, vision=vision,
            bad=self.bad_images,
        )  # fmt: skip
        self.n_dropped, self.max_prompt_length = len(self.dropped_lengths), max_prompt_length
        self.vision = vision
        if not self.rows:
            raise DataError(
                f"{name}: no rows left after dropping {self.n_dropped} prompts longer than "
                f"max_prompt_length={max_prompt_length}"
                + (f" and {len(self.bad_images)} with unreadable images" if self.bad_images else "")
            )
        self.pad_id = pad_token_id(tokenizer)
        self.seed, self.shuffle, self.name = seed, shuffle, name
        self.cursor = Cursor()

    @classmethod
    def from_files(
        cls, paths: str | Path | Sequence[str | Path], tokenizer: Any, **kwargs: Any
    ) -> PromptDataset:
        """Read, validate and tokenize the rows of `paths` (see `PromptDataset.__init__` for kwargs)."""
        names = [str(paths)] if isinstance(paths, str | Path) else [str(p) for p in paths]
        return cls(read_rows(paths), tokenizer, name=kwargs.pop("name", ", ".join(names)), **kwargs)

    def prompt_lengths(self) -> list[int]:
        """The token count of every kept prompt (chat template and tools rendered)."""
        return [len(ids) for ids in self.token_ids]

    def report(self) -> str:
        """One line on what was read: rows, prompts dropped for length, prompt-length percentiles."""
        kept = self.prompt_lengths()
        every = sorted(kept + self.dropped_lengths)
        cut = "" if self.max_prompt_length is None else f" (max prompt length {self.max_prompt_length})"
        dropped = f"{self.n_dropped} dropped as too long{cut}" + (
            f", longest kept {max(kept)} tokens, longest dropped {max(self.dropped_lengths)}"
            if self.n_dropped
            else ""
        )
        spread = ", ".join(f"p{q} {percentile(every, q)}" for q in (50, 90, 99)) + f", max {every[-1]}"
        bad = ""
        if self.bad_images:
            bad = f", {len(self.bad_images)} dropped for their images (first: {self.bad_images[0]})"
        return f"{len(every) + len(self.bad_images)} rows, {dropped}{bad}; prompt tokens {spread}"

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return list(range(len(self)))
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(len(self), generator=generator).tolist()

    def take(self, cursor: Cursor, batch_size: int) -> tuple[Batch, Cursor]:
        """The `batch_size` rows starting at `cursor`, as a prompt Batch, and the cursor after them."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        picked, uids = [], []
        epoch, position = cursor.epoch, cursor.position
        order = self.order(epoch)
        while len(picked) < batch_size:
            if position == len(self):
                epoch, position = epoch + 1, 0
                order = self.order(epoch)
            picked.append(order[position])
            uids.append(f"e{epoch}.{position}")  # unique over the whole run
            position += 1
        batch = prompt_batch([self.rows[i] for i in picked], [self.token_ids[i] for i in picked], pad_id=self.pad_id,
                             uids=uids, vision=self.vision)  # fmt: skip
        return batch, Cursor(epoch, position)

    def next_batch(self, batch_size: int) -> Batch:
        """`take` at the stored cursor, advancing it."""
        batch, self.cursor = self.take(self.cursor, batch_size)
        return batch

    def iter_batches(self, batch_size: int) -> Iterator[Batch]:
        """One pass over all rows in file order (for validation); the last batch may be shorter."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            rows, ids = self.rows[start:stop], self.token_ids[start:stop]
            uids = [f"r{i}" for i in range(start, stop)]
            yield prompt_batch(rows, ids, pad_id=self.pad_id, uids=uids, vision=self.vision)

    def state_dict(self) -> dict[str, int]:
        """The stored cursor as `cursor_state` writes it."""
        return self.cursor_state(self.cursor)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the stored cursor from `cursor_state`'s dict (checked as `cursor_from_state`)."""
        self.cursor = self.cursor_from_state(state)

    def cursor_state(self, cursor: Cursor) -> dict[str, int]:
        """`cursor`, plus the seed and row count that make it meaningful (JSON-able)."""
        return {"epoch": cursor.epoch, "position": cursor.position, "seed": self.seed, "num_rows": len(self)}

    def cursor_from_state(self, state: dict[str, int]) -> Cursor:
        """The cursor of a `cursor_state` dict; refuses one saved with another seed or number of rows."""
        for key, mine in (("seed", self.seed), ("num_rows", len(self))):
            if state[key] != mine:
                raise ValueError(
                    f"{self.name}: saved data state has {key}={state[key]} but this dataset has {mine}"
                )
        if not 0 <= state["position"] <= len(self) or state["epoch"] < 0:
            raise ValueError(f"{self.name}: saved data state {state} is out of range for {len(self)} rows")
        return Cursor(state["epoch"], state["position"])
