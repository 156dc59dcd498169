"""What one client may ask of the server (`--max-*`, `--op-timeout-s`), and the deadline an operation runs
against. Each bound answers a request sized to exhaust the server's memory or time; a request past one is
refused in one line naming the flag that raises it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rlcore.tinker.errors import UserError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """The server's bounds (its `--max-*` flags, `--op-timeout-s`, `--model-roots`)."""

    max_samples: int = 256
    """num_samples of one sample request."""
    max_lora_rank: int = 256
    """LoRA rank of a training client."""
    max_models: int = 16
    """Training clients the server holds (each its weights, optimizer and engine)."""
    max_sampling_sessions: int = 1024
    """Sampling sessions kept; past it the oldest is forgotten."""
    max_futures: int = 10_000
    """Request results kept (the oldest finished one is dropped past it) and requests waiting to run."""
    op_timeout_s: float = 600.0
    """Seconds one operation may run; forward_backward stops between micro-batches and sampling between
    decode steps once past it, failing that operation alone."""
    model_roots: tuple[Path, ...] = ()
    """Directories local base models may be loaded from (none: built-in models and hub ids only)."""


def check_samples(n: int, limits: Limits) -> None:
    if n < 1:
        raise UserError(f"num_samples {n}: ask for at least one sample")
    if n > limits.max_samples:
        raise UserError(f"num_samples {n} is over this server's limit of {limits.max_samples}: ask for fewer, or "
                        "start the server with a larger --max-samples")  # fmt: skip


def check_rank(rank: int, limits: Limits) -> None:
    if rank < 0:
        raise UserError(f"LoRA rank {rank}: use a positive rank, or 0 for full fine-tuning")
    if rank > limits.max_lora_rank:
        raise UserError(f"LoRA rank {rank} is over this server's limit of {limits.max_lora_rank}: use a smaller "
                        "rank, or start the server with a larger --max-lora-rank")  # fmt: skip


def check_models(held: int, limits: Limits) -> None:
    if held >= limits.max_models:
        raise UserError(f"this server holds {held} models, its limit: start it with a larger --max-models (each "
                        "model holds its weights, optimizer and engine in memory)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When the running operation must stop (`--op-timeout-s` after it started)."""

    at: float
    timeout_s: float

    @classmethod
    def start(cls, limits: Limits) -> Deadline:
        return cls(time.monotonic() + limits.op_timeout_s, limits.op_timeout_s)

    def passed(self) -> bool:
        return time.monotonic() > self.at

    def message(self, what: str, done: str) -> str:
        return (f"{what} ran past the server's --op-timeout-s ({self.timeout_s:g} s) and was stopped {done}: send "
                "less in one request, or start the server with a larger --op-timeout-s")  # fmt: skip
