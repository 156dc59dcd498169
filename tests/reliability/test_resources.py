"""Resource use: every step records its memory, memory stays flat over a run, and a run leaves no file
handle, child process or thread behind. (The 200-step default run: experiments/long_run.py.)"""

from __future__ import annotations

import os
import statistics
import threading
from pathlib import Path

from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import SMALL, ok

FLAT_STEPS = 40
MEDIAN_SLACK_MB, PEAK_SLACK_MB = 4.0, 8.0
"""Measured on 2 cores: the medians of steps 6-15 and 31-40 differ by < 1 MB, their highest by < 1.5 MB."""


def test_every_step_records_current_and_peak_memory(reference):
    records = read_metrics(reference / "metrics.jsonl")
    for r in records:
        assert r["perf/rss_mb"] > 50 and r["perf/max_memory_mb"] > 50, r  # a process with torch loaded
        assert r["perf/rss_mb"] <= r["perf/max_memory_mb"] + 1.0, r  # the peak is a high-water mark
    peaks = [r["perf/max_memory_mb"] for r in records]
    assert peaks == sorted(peaks)


def test_memory_stays_flat_over_a_run(launch, tmp_path):
    """No growth step over step: after a warm-up of 10 steps, resident memory stays within a few MB."""
    args = ["grpo", *SMALL, "--trainer.steps", str(FLAT_STEPS), "--trainer.val-every", "10"]
    ok(launch.run(args, out=tmp_path))
    rss = [r["perf/rss_mb"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    early, late = rss[5:15], rss[-10:]  # steps 6-15 (after the warm-up) and the last ten
    assert statistics.median(late) - statistics.median(early) <= MEDIAN_SLACK_MB, (early, late)
    assert max(late) - max(early) <= PEAK_SLACK_MB, (early, late)


def _descendants(pid: int | str = "self") -> set[int]:
    """Every process below `pid` (reward workers are children of multiprocessing's fork server)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        children = {int(child) for task in tasks for child in (task / "children").read_text().split()}
    except OSError:  # it just ended
        return set()
    return children.union(*(_descendants(child) for child in children))


def _resources() -> tuple[int, set[int], int]:
    import matplotlib.pyplot as plt

    return len(os.listdir("/proc/self/fd")), _descendants(), threading.active_count() + len(plt.get_fignums())


def test_a_run_leaves_no_file_handle_child_process_or_thread(tmp_path, one_thread):
    """In this process: reward workers (--reward.num-workers 2), checkpoints, validation and the plot."""
    from rlcore.trainer.cli import parse
    from rlcore.trainer.run import run

    argv = ["grpo", *SMALL, "--trainer.steps", "2", "--trainer.save-every", "1", "--trainer.val-every", "1",
            "--reward.num-workers", "2"]  # fmt: skip
    assert run(parse([*argv, "--out-dir", str(tmp_path / "warm")])) == 0  # lazy imports, the fork server
    before = _resources()
    assert run(parse([*argv, "--out-dir", str(tmp_path / "run")])) == 0
    assert _resources() == before
