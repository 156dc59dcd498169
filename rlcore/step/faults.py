"""Fault injection for the reliability tests, driven by environment variables (all unset: no effect).

    RLCORE_TEST_KILL_AT=3:update       SIGKILL this process at step 3's phase: rollout (rollout and rewards
                                       done, nothing learned; a split rollout rank: the batch generated,
                                       not yet sent), update (optimizer stepped, nothing logged), or save
                                       (checkpoint files written, not yet committed); `3:update:1`: only
                                       global rank 1. Under torchrun only the first attempt dies (a world
                                       torchrun restarts runs the step again, and must get past it)
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
    RLCORE_TEST_CORRUPT_DELTA=2        with --pipeline.push delta, the trainer leader flips one payload byte of
                                       one delta of step 2's push (after its checksum): the rollout ranks'
                                       checksums disagree and the full push is taken (sync/delta_fallbacks)

`Hooks.from_env()` is the only reader of these variables: the shell builds the hooks once
(`Handles.hooks`) and the library receives them as a value; `Hooks()` does nothing. The run loop calls
`kill_point` at its phase boundaries, `checkpoints.save` calls `before_commit`, `signal_in_save` from
inside DCP's write, `learn` passes the advantages through `poison`, the weight push asks `per_bucket`,
`collect.generate` calls `slow_rollout`, `collect.collect` calls `stall`, split placement's delta push
passes its records through `corrupt_delta`. tests/reliability drives them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.batch import Batch

if TYPE_CHECKING:
    from rlcore.dist.delta import Encoded

PHASES = ("rollout", "update", "save")


def _fields(spec: str, n: int) -> list[str] | None:
    parts = spec.split(":")
    return parts if spec and len(parts) == n else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hooks:
    """Test-only faults as a value (all defaults: none)."""

    kill_at: str = ""
    """"step:phase" or "step:phase:rank" at which this process dies of `kill_signal`."""
    attempt: int = 0
    """torchrun's restart count of this process's world (TORCHELASTIC_RESTART_COUNT): kills fire in the first."""
    kill_signal: str = "SIGKILL"
    pause_in_save_s: float = 0.0
    save_error: str = ""
    """"step:rank" whose checkpoint save fails with ENOSPC."""
    signal_in_save: str = ""
    """"step:part:SIGNAL" sent to this process inside DCP's write of that part's checkpoint."""
    nan_steps: frozenset[int] = frozenset()
    dump_state: Path | None = None
    sync_per_bucket: bool = False
    slow_rollout_s: float = 0.0
    slow_decode_s: float = 0.0
    stall_at: str = ""
    """"rank:step:phase" in which this process sleeps for an hour."""
    stall_mute: bool = False
    corrupt_delta_at: int = 0
    """The step whose delta push the trainer leader corrupts (0: none)."""
    rank: int = 0
    """This process's global rank (what `save_error` names)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Hooks:
        """The hooks the RLCORE_TEST_* variables ask for (the one place they are read)."""
        e = os.environ if env is None else env
        nan = {int(s) for s in e.get("RLCORE_TEST_NAN_AT_STEPS", "").split(",") if s.strip()}
        dump = e.get("RLCORE_TEST_DUMP_STATE")
        return cls(kill_at=e.get("RLCORE_TEST_KILL_AT", ""), kill_signal=e.get("RLCORE_TEST_KILL_SIGNAL", "SIGKILL"),
                   pause_in_save_s=float(e.get("RLCORE_TEST_PAUSE_IN_SAVE") or 0),
                   save_error=e.get("RLCORE_TEST_SAVE_ERROR", ""),
                   signal_in_save=e.get("RLCORE_TEST_SIGNAL_IN_SAVE", ""), nan_steps=frozenset(nan),
                   dump_state=Path(dump) if dump else None,
                   sync_per_bucket=e.get("RLCORE_TEST_SYNC_PER_BUCKET") == "1",
                   slow_rollout_s=float(e.get("RLCORE_TEST_SLOW_ROLLOUT_S") or 0),
                   slow_decode_s=float(e.get("RLCORE_TEST_SLOW_DECODE_S") or 0),
                   stall_at=e.get("RLCORE_TEST_STALL", ""), stall_mute=e.get("RLCORE_TEST_STALL_MUTE") == "1",
                   corrupt_delta_at=int(e.get("RLCORE_TEST_CORRUPT_DELTA") or 0),
                   rank=int(e.get("RANK", "0")), attempt=int(e.get("TORCHELASTIC_RESTART_COUNT", "0")))  # fmt: skip

    def stall(self, rank: int, step: int, phase: str) -> None:
        """Sleep for an hour if `stall_at` names (rank, step, phase)."""
        if self.stall_at == f"{rank}:{step}:{phase}":
            if self.stall_mute:
                from rlcore.step.phases import disarm

                disarm()
            time.sleep(3600)

    def kill_point(self, step: int, phase: str) -> None:
        """Die of `kill_signal` if `kill_at` names (step, phase) and this rank, in a world's first attempt."""
        assert phase in PHASES, phase
        if self.attempt == 0 and self.kill_at in (f"{step}:{phase}", f"{step}:{phase}:{self.rank}"):
            os.kill(os.getpid(), signal.Signals[self.kill_signal])

    def before_commit(self, step: int) -> None:
        """Inside a checkpoint save, its files written and not yet committed: pause, maybe die or fail."""
        if self.pause_in_save_s:
            time.sleep(self.pause_in_save_s)
        self.kill_point(step, "save")
        if self.save_error == f"{step}:{self.rank}":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def in_save(self, step: int, part: str) -> None:
        """Send this process the signal `signal_in_save` names if it names (step, part)."""
        spec = _fields(self.signal_in_save, 3)
        if spec is not None and spec[:2] == [str(step), part]:
            os.kill(os.getpid(), signal.Signals[spec[2]])

    def slow_rollout(self) -> None:
        if self.slow_rollout_s:
            time.sleep(self.slow_rollout_s)

    def slow_decode(self) -> None:
        if self.slow_decode_s:
            time.sleep(self.slow_decode_s)

    def corrupt_delta(self, step: int, records: list[Encoded]) -> list[Encoded]:
        """`records` (a delta push's) with one payload byte of the first "xor" record flipped (a copy;
        the checksum left as it was) if `corrupt_delta_at` is `step`, else `records` themselves."""
        if not self.corrupt_delta_at or step != self.corrupt_delta_at:
            return records
        k = next((i for i, r in enumerate(records) if r.entry.encoding == "xor"), None)
        if k is None:
            return records
        payload = records[k].payload.clone()
        payload[payload.numel() // 2] ^= 0xFF
        return [*records[:k], dataclasses.replace(records[k], payload=payload), *records[k + 1 :]]

    def poison(self, batch: Batch, step: int) -> Batch:
        """The batch with NaN advantages if `nan_steps` holds `step`, else the batch itself."""
        if step not in self.nan_steps:
            return batch
        return batch.with_(advantages=batch["advantages"] * math.nan, overwrite=True)

    def per_bucket(self, engine: object, push: object) -> bool:
        """With `sync_per_bucket`, feed `push` to `engine` one bucket per `load_weights` call (the old,
        broken sync) and return True; else do nothing and return False."""
        if not self.sync_per_bucket:
            return False
        for bucket in push._buckets:  # type: ignore[attr-defined]
            engine.load_weights(bucket)  # type: ignore[attr-defined]
        return True

    def dump(
        self, state: Any, *, rank: int, data: Callable[[], Any], holds: Callable[[], bool | None]
    ) -> None:
        """`dump_state`: this rank (`rank`) writes DIR/rank<r>.json, the run state that must agree across
        ranks (`data()`: the data cursor's record) and whether its engine holds the trained weights
        (`holds()`, a collective: every rank calls this)."""
        if (
            self.dump_state is None or state.actor is None
        ):  # a rollout rank of split placement holds no policy
            return
        record = {"step": state.step, "kl_coef": state.kl_coef, "data": data(), "bad_updates": state.bad_updates,
                  "policy_version": state.policy_version, "engine_matches_policy": holds()}  # fmt: skip
        self.dump_state.mkdir(parents=True, exist_ok=True)
        (self.dump_state / f"rank{rank}.json").write_text(json.dumps(record, sort_keys=True))
