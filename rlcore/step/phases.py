"""The named phases of a step: profiler ranges and traces, and a watchdog that turns a hang into an exit.

    watch = Watchdog(timeout_s=600, rank=0, world=2)   # --trainer.hang-timeout-s; one per process
    with watching(watch):                              # armed while the loop runs
        at_step(step)
        with phase("rollout"):                         # a torch.profiler range, and progress
            ...

`phase(name)` records its peak resident memory (`rlcore.dist.memory`: `perf/mem/<phase>_peak_mb`), is a
`torch.profiler.record_function` range (so a trace from --trainer.profile-steps
shows rollout, scoring, logprobs, update, sync, ... per step) and, when a watchdog is armed, a
heartbeat: entering or leaving a phase is progress. The watchdog thread checks every second; when
nothing has progressed for `timeout_s` (a phase that never ends, or a collective some rank never
joins), it prints this rank's step, phase and main-thread stack, names the rank that stalled, and
exits the process with code 4 (`os._exit`: the main thread may be stuck in C).

Naming the stalled rank: each rank also writes its position (step, how many phase entries and exits
it has made in the step, where it is) into the process group's store under `rlcore/watchdog/<rank>`; the rank
furthest behind is the one that stalled (the others wait for it in a collective). Without a store (one
process) the rank names itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from rlcore.dist.memory import phase_peak

HANG_EXIT_CODE = 4
"""The exit code of a run the watchdog stopped."""

_ACTIVE: Watchdog | None = None
"""The armed watchdog of this process (`watching`), which `phase` reports to."""


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A named phase of the current step (a profiler range; progress for the watchdog)."""
    watch = _ACTIVE
    with torch.profiler.record_function(name), phase_peak(name):
        if watch is not None:
            watch.enter(name)
        try:
            yield
        finally:
            if watch is not None:
                watch.leave(name)


def at_step(step: int) -> None:
    """The loop starts step `step` (progress, and the step the watchdog reports)."""
    if _ACTIVE is not None:
        _ACTIVE.at_step(step)


@contextlib.contextmanager
def watching(watch: Watchdog | None) -> Iterator[None]:
    """Arm `watch` (None: no watchdog) for the block: its thread runs, `phase` reports to it."""
    global _ACTIVE
    if watch is None:
        yield
        return
    _ACTIVE = watch
    watch.start()
    try:
        yield
    finally:
        watch.stop()
        _ACTIVE = None


class Watchdog:
    """Exits the process when no phase has started or ended for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, *, rank: int = 0, world: int = 1, out: TextIO | None = None) -> None:
        self.timeout_s, self.rank, self.world, self.out = timeout_s, rank, world, out or sys.stderr
        self.step, self.events = 0, 0  # the position: the step, and the phase entries and exits in it
        self.last = "the start of the loop"
        self.progress = time.monotonic()
        self._store = _default_store() if world > 1 else None
        self._main = threading.main_thread()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the main thread's reports ----------------------------------------------------------

    def at_step(self, step: int) -> None:
        self.step, self.events = step, 0
        self._advance(f"the start of step {step}")

    def enter(self, name: str) -> None:
        self._advance(f"phase {name!r}")

    def leave(self, name: str) -> None:
        self._advance(f"after phase {name!r}")

    def _advance(self, where: str) -> None:
        self.last, self.progress, self.events = where, time.monotonic(), self.events + 1
        if self._store is not None:
            position = {"step": self.step, "events": self.events, "where": where}
            with contextlib.suppress(Exception):  # the watchdog must never break the run
                self._store.set(f"rlcore/watchdog/{self.rank}", json.dumps(position))

    # -- the watchdog thread ----------------------------------------------------------------

    def start(self) -> None:
        self.progress = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="rlcore-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self.progress >= self.timeout_s:
                self.fire()

    def fire(self) -> None:
        """Report this rank's position and stack, name the stalled rank, exit with HANG_EXIT_CODE."""
        frame = sys._current_frames().get(self._main.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)\n"
        print(
            f"rank {self.rank}: no progress for {self.timeout_s:g} s at step {self.step}, {self.last}; its main "
            f"thread:\n{stack}",
            file=self.out,
            flush=True,
        )
        print(self.verdict(), file=self.out, flush=True)
        os._exit(HANG_EXIT_CODE)

    def verdict(self) -> str:
        """The one line naming the rank that stalled (the furthest behind) and where the others are."""
        positions = self._positions()
        mine = {"step": self.step, "events": self.events, "where": self.last}
        positions.setdefault(self.rank, mine)
        behind = min(positions, key=lambda r: (positions[r]["step"], positions[r]["events"], r))
        late = positions[behind]
        others = sorted(r for r in positions if r != behind and positions[r] != late)
        waiting = "; ".join(
            f"rank {r} at step {positions[r]['step']}, {positions[r]['where']}" for r in others
        )
        if not others and len(positions) > 1:
            waiting = "every rank is at the same place: a collective or an external call that never returns"
        return (
            f"error: hang: rank {behind} made no progress for {self.timeout_s:g} s at step {late['step']}, "
            f"{late['where']}" + (f" ({waiting})" if waiting else "") + "; raise --trainer.hang-timeout-s "
            "if that phase is legitimately this slow"
        )

    def _positions(self) -> dict[int, dict[str, Any]]:
        """Each rank's last reported position (from the store; the ranks it cannot read are left out)."""
        if self._store is None:
            return {}
        out = {}
        for rank in range(self.world):
            key = f"rlcore/watchdog/{rank}"
            with contextlib.suppress(Exception):  # check first: a get of a missing key would wait
                if self._store.check([key]):
                    out[rank] = json.loads(self._store.get(key))
        return out


def disarm() -> None:
    """Stop this process's watchdog (test-only: a rank stuck holding the GIL, whose watchdog cannot run)."""
    if _ACTIVE is not None:
        _ACTIVE.stop()


def _default_store() -> Any:
    """The default process group's key-value store, or None (not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private helper: without it, the watchdog names only its own rank
        return None


class StepProfiler:
    """--trainer.profile-steps A:B: a torch.profiler trace of steps A..B (inclusive) per rank, written as a
    Chrome trace to `out_dir/profile/rank<R>-steps<A>-<B>.json` (chrome://tracing, Perfetto), with each
    step's phases as named ranges."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int) -> None:
        self.steps, self.out_dir, self.rank = steps, out_dir, rank
        self._profile: Any = None

    def before(self, step: int) -> None:
        if self.steps is None or step != self.steps[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities)
        self._profile.__enter__()

    def after(self, step: int) -> Path | None:
        """Stop and write the trace after the last profiled step; its path, else None."""
        if self._profile is None or self.steps is None or step != self.steps[1]:
            return None
        self._profile.__exit__(None, None, None)
        path = self.out_dir / "profile" / f"rank{self.rank}-steps{self.steps[0]}-{self.steps[1]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(path))
        self._profile = None
        return path


def profile_steps(spec: str) -> tuple[int, int] | None:
    """--trainer.profile-steps "A:B" as (A, B); "" as None. ValueError for anything else."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"--trainer.profile-steps {spec!r}: expected A:B, e.g. 3:4 (steps A to B, inclusive)"
        )
    first, last = int(parts[0]), int(parts[1])
    if not 1 <= first <= last:
        raise ValueError(f"--trainer.profile-steps {spec!r}: need 1 <= A <= B")
    return first, last
