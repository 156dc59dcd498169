"""Metrics out of the trainer: metrics.jsonl (orjson), an optional W&B run, and live progress: a tqdm
bar with ETA when stderr is a terminal, one plain line per step when it is not (a log file, a pipe).

Rank 0 alone writes and prints; other ranks get a logger whose methods do nothing. Every record also
gets the process's memory: `perf/rss_mb` (resident now) and `perf/max_memory_mb` (peak resident so
far, the kernel's high-water mark), each phase's peak since the last record (`perf/mem/<phase>_peak_mb`)
and the free memory glibc holds (`perf/mem/slack_mb`). A record that cannot be appended (disk full) ends the run with
one `error:` line and exit code 2 (`StopRun`); a record torn by a crash mid-append is dropped when read back.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from rlcore.dist import memory
from rlcore.trainer.errors import StopRun


class MetricsLogger:
    """Appends one JSON object per step to `out_dir/metrics.jsonl`, mirrors it to W&B, prints progress."""

    def __init__(
        self,
        out_dir: Path,
        *,
        total_steps: int,
        enabled: bool = True,
        wandb_mode: str = "off",
        wandb_project: str = "rlcore",
        run_name: str = "rlcore",
        config: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> None:
        self.enabled, self.progress, self.total = enabled, progress and enabled, total_steps
        self.path = out_dir / "metrics.jsonl"
        self.started = time.monotonic()
        self.first_step: int | None = None
        self._wandb = None
        self._pending: dict[str, float] = {}
        self.terminal = self.progress and sys.stderr.isatty()
        """A live progress bar (tqdm) on a terminal; one plain line per step when stderr is piped."""
        self._bar: Any = None
        if enabled and wandb_mode != "off":
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, name=run_name, dir=str(out_dir), mode=wandb_mode, config=config or {}
            )

    @property
    def wandb_run(self) -> Any:
        """The W&B run (None when W&B is off or this rank does not write)."""
        return self._wandb

    def once(self, metrics: dict[str, float]) -> None:
        """Add `metrics` to the next record only (run-level facts: the data report's counts)."""
        self._pending |= metrics

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` of `step` (plain floats; non-finite values are written as null)."""
        if not self.enabled:
            return
        metrics, self._pending = self._pending | metrics | memory_metrics(), {}
        record = {"step": step} | {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        try:
            with self.path.open("ab") as f:
                f.write(orjson.dumps(record) + b"\n")
        except OSError as e:
            raise StopRun(
                f"cannot append step {step} to {self.path} ({e.strerror}); free disk space or make "
                f"{self.path.parent} writable, then rerun with --resume auto"
            ) from None
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self.progress:
            self._print(step, metrics)

    def begin(self, step: int) -> None:
        """Training starts after `step` steps (0, or where a resumed run left off): ETAs count from now."""
        self.first_step, self.started = step, time.monotonic()
        if self.terminal and step < self.total:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=step, unit="step", file=sys.stderr, **_width())

    def _print(self, step: int, metrics: dict[str, float]) -> None:
        parts = progress_parts(metrics)
        if self._bar is not None:
            self._bar.update(max(step - self._bar.n, 0))
            self._bar.set_postfix_str(" | ".join(parts), refresh=True)
            return
        line = [f"step {step}/{self.total}", *parts]
        done = step - self.first_step if self.first_step is not None else 0
        if done > 0:  # not before training (a step-0 validation)
            eta = (time.monotonic() - self.started) / done * max(self.total - step, 0)
            line.append(f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        print(" | ".join(line), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


PROGRESS = (
    ("train/reward_mean", "reward"),
    ("val/reward_mean", "val"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/kl_loss", "kl_ref"),
    ("actor/reward_kl_penalty", "kl_ref"),
    ("actor/entropy", "entropy"),
    ("timing/step_s", "s/step"),
)
"""What the progress shows: `ppo_kl` is the update's KL between the old and the current policy (0 on
the first pass of an on-policy step), `kl_ref` the KL to the reference (the KL loss, else the reward
penalty's KL), when there is a reference."""


def progress_parts(metrics: dict[str, float]) -> list[str]:
    """The progress fields present in `metrics`, as `label value` (one `kl_ref`: the loss's first)."""
    parts, seen = [], set()
    for key, label in PROGRESS:
        if key in metrics and label not in seen:
            parts.append(f"{label} {metrics[key]:.3f}")
            seen.add(label)
    return parts


def _width() -> dict[str, Any]:
    """tqdm's size: the terminal's, followed; a terminal of unknown size (0 x 0, where tqdm would draw
    nothing): $COLUMNS x $LINES, else 120 x 24."""
    try:
        if os.get_terminal_size(sys.stderr.fileno()).columns > 0:
            return {"dynamic_ncols": True}
    except OSError:
        pass
    size = shutil.get_terminal_size((120, 24))
    return {"ncols": size.columns, "nrows": size.lines}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a last line without its newline (torn by a crash) is dropped."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def memory_metrics() -> dict[str, float]:
    """`perf/max_memory_mb`: peak resident memory of this process; `perf/rss_mb`: resident now (Linux);
    on CUDA also `perf/gpu_max_allocated_mb` (the peak since the previous record, which resets it) and
    `perf/gpu_reserved_mb` (held by the caching allocator now)."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    peak = max(peak_kb / (2**20 if sys.platform == "darwin" else 1024), memory.peak_mb() or 0.0)
    metrics = {"perf/max_memory_mb": peak} | memory.take_phase_peaks() | memory.process_mb()
    slack = memory.allocator_slack_mb()
    if slack is not None:
        metrics["perf/mem/slack_mb"] = slack
    metrics |= gpu_memory_metrics()
    now = memory.resident_mb()
    return metrics if now is None else metrics | {"perf/rss_mb": now}


def gpu_memory_metrics() -> dict[str, float]:
    """This process's CUDA memory (empty without CUDA); resets the peak, so each record has its own."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**20
    torch.cuda.reset_peak_memory_stats()
    return {"perf/gpu_max_allocated_mb": peak, "perf/gpu_reserved_mb": gpu_reserved_mb()}


def gpu_reserved_mb() -> float:
    """MiB the CUDA caching allocator holds now (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    return torch.cuda.memory_reserved() / 2**20
