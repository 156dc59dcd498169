"""Fault injection for the reliability tests, driven by environment variables (all unset: no effect).

    RLCORE_TEST_KILL_AT=3:update       SIGKILL this process at step 3's phase: rollout (rollout and rewards
                                       done, nothing learned), update (optimizer stepped, nothing logged),
                                       or save (checkpoint files written, not yet committed)
    RLCORE_TEST_KILL_SIGNAL=SIGABRT    with RLCORE_TEST_KILL_AT: die of this signal instead (a native crash)
    RLCORE_TEST_PAUSE_IN_SAVE=60       stall every checkpoint save for 60 s before its commit
    RLCORE_TEST_SAVE_ERROR=2:1         the checkpoint save of step 2 fails on rank 1 only (disk full)
    RLCORE_TEST_SIGNAL_IN_SAVE=4:critic:SIGINT
                                       every rank sends itself SIGINT inside DCP's write of step 4's critic
                                       checkpoint (or `policy`'s): an interrupt landing mid-write, on cue
    RLCORE_TEST_NAN_AT_STEPS=2,3       make the advantages of steps 2 and 3 NaN (the update must be skipped)
    RLCORE_TEST_DUMP_STATE=DIR         at the end of the run, every rank writes DIR/rank<r>.json: its run state
                                       (KL coefficient, data cursor, step, bad updates) and whether its
                                       engine holds the trained weights (what must agree across ranks)
    RLCORE_TEST_SYNC_PER_BUCKET=1      push weights with one load_weights call per bucket (the issue-24 bug:
                                       vLLM then runs a half-loaded policy; the step-1 gap check must say so)
    RLCORE_TEST_SLOW_ROLLOUT_S=1.5     every batch takes 1.5 s longer to generate (a slow rollout role, for
                                       stream mode's timing)
    RLCORE_TEST_STALL=1:2:scoring      rank 1 sleeps (for an hour) inside step 2's scoring phase: a stalled
                                       rank, for the hang watchdog; with RLCORE_TEST_STALL_MUTE=1 its own
                                       watchdog stops first (as if stuck in C holding the GIL)
    RLCORE_TEST_SLOW_DECODE_S=0.2      with partial rollouts, every decode step takes 0.2 s longer (pushes
                                       then arrive while a batch is being generated)

The run loop calls `kill_point` at its phase boundaries, `checkpoints.save` calls `before_commit`,
`signal_in_save` from inside DCP's write, `learn` passes the advantages through `poison`, the weight push asks `push_per_bucket`, and
`collect.generate` calls `slow_rollout`, `collect.collect` calls `stall`. tests/reliability drives them.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.batch import Batch

if TYPE_CHECKING:
    from rlcore.trainer.handles import Handles

PHASES = ("rollout", "update", "save")


def stall(rank: int, step: int, phase: str) -> None:
    """Sleep for an hour if RLCORE_TEST_STALL names (rank, step, phase)."""
    if os.environ.get("RLCORE_TEST_STALL") == f"{rank}:{step}:{phase}":
        if os.environ.get("RLCORE_TEST_STALL_MUTE") == "1":
            from rlcore.trainer.phases import disarm

            disarm()
        time.sleep(3600)


def kill_point(step: int, phase: str) -> None:
    """SIGKILL (or RLCORE_TEST_KILL_SIGNAL) this process if RLCORE_TEST_KILL_AT names (step, phase)."""
    assert phase in PHASES, phase
    if os.environ.get("RLCORE_TEST_KILL_AT") == f"{step}:{phase}":
        os.kill(os.getpid(), signal.Signals[os.environ.get("RLCORE_TEST_KILL_SIGNAL", "SIGKILL")])


def before_commit(step: int) -> None:
    """Inside a checkpoint save, with its files written and not yet committed: pause, maybe die or fail."""
    pause = os.environ.get("RLCORE_TEST_PAUSE_IN_SAVE")
    if pause:
        time.sleep(float(pause))
    kill_point(step, "save")
    if os.environ.get("RLCORE_TEST_SAVE_ERROR") == f"{step}:{os.environ.get('RANK', '0')}":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def signal_in_save(step: int, part: str) -> None:
    """Send this process the signal RLCORE_TEST_SIGNAL_IN_SAVE names if it names (step, part)."""
    spec = os.environ.get("RLCORE_TEST_SIGNAL_IN_SAVE", "").split(":")
    if len(spec) == 3 and spec[:2] == [str(step), part]:
        os.kill(os.getpid(), signal.Signals[spec[2]])


def slow_rollout() -> None:
    """Sleep RLCORE_TEST_SLOW_ROLLOUT_S seconds, if set."""
    delay = os.environ.get("RLCORE_TEST_SLOW_ROLLOUT_S")
    if delay:
        time.sleep(float(delay))


def slow_decode() -> None:
    """Sleep RLCORE_TEST_SLOW_DECODE_S seconds, if set."""
    delay = os.environ.get("RLCORE_TEST_SLOW_DECODE_S")
    if delay:
        time.sleep(float(delay))


def poison(batch: Batch, step: int) -> Batch:
    """The batch with NaN advantages if RLCORE_TEST_NAN_AT_STEPS lists `step`, else the batch itself."""
    steps = os.environ.get("RLCORE_TEST_NAN_AT_STEPS", "")
    if str(step) not in steps.split(","):
        return batch
    return batch.with_(advantages=batch["advantages"] * math.nan, overwrite=True)


def push_per_bucket(engine: object, push: object) -> bool:
    """With RLCORE_TEST_SYNC_PER_BUCKET=1, feed `push` to `engine` one bucket per `load_weights` call (the
    old, broken sync) and return True; else do nothing and return False."""
    if os.environ.get("RLCORE_TEST_SYNC_PER_BUCKET") != "1":
        return False
    for bucket in push._buckets:  # type: ignore[attr-defined]
        engine.load_weights(bucket)  # type: ignore[attr-defined]
    return True


def dump_state(state: Any, h: Handles, engine_holds: Callable[[Any, Any], bool]) -> None:
    """RLCORE_TEST_DUMP_STATE=DIR: this rank writes DIR/rank<r>.json, the run state that must agree
    across ranks and whether its engine holds the trained weights, as `engine_holds(model, engine)` says
    (a collective: every rank calls it)."""
    directory = os.environ.get("RLCORE_TEST_DUMP_STATE")
    if not directory or state.actor is None:  # a rollout rank of split placement holds no policy
        return
    record = {"step": state.step, "kl_coef": state.kl_coef, "data": h.train_ds.cursor_state(state.cursor),
              "bad_updates": state.bad_updates, "policy_version": state.policy_version,
              "engine_matches_policy": engine_holds(state.actor.model, h.engine)}  # fmt: skip
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / f"rank{h.dist.rank}.json").write_text(json.dumps(record, sort_keys=True))
