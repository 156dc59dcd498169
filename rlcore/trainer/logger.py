"""Metrics out of the trainer: metrics.jsonl (orjson), an optional W&B run, and a live progress line.

Rank 0 alone writes and prints; other ranks get a logger whose methods do nothing. Every record also
gets the process's memory: `perf/rss_mb` (resident now) and `perf/max_memory_mb` (peak resident so
far, the kernel's high-water mark). A record that cannot be appended (disk full) ends the run with
one `error:` line and exit code 2 (`StopRun`); a record torn by a crash mid-append is dropped when read back.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import orjson

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
        if enabled and wandb_mode != "off":
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, name=run_name, dir=str(out_dir), mode=wandb_mode, config=config or {}
            )

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

    def _print(self, step: int, metrics: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step, self.started = step, time.monotonic()
        done = step - self.first_step + 1
        per_step = (time.monotonic() - self.started) / max(done, 1)
        eta = per_step * max(self.total - step, 0)
        parts = [f"step {step}/{self.total}"]
        for key, label in (
            ("train/reward_mean", "reward"),
            ("val/reward_mean", "val"),
            ("actor/ppo_kl", "kl"),
            ("actor/entropy", "entropy"),
            ("timing/step_s", "s/step"),
        ):
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.3f}")
        parts.append(f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a last line without its newline (torn by a crash) is dropped."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def memory_metrics() -> dict[str, float]:
    """`perf/max_memory_mb`: peak resident memory of this process; `perf/rss_mb`: resident now (Linux)."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    metrics = {"perf/max_memory_mb": peak_kb / (2**20 if sys.platform == "darwin" else 1024)}
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except OSError:  # not Linux
        return metrics
    return metrics | {"perf/rss_mb": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20}
