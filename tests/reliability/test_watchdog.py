"""The hang watchdog (issue 18, item 7): a stalled rank ends the run with one line naming it."""

from __future__ import annotations

import os
import time

from tests.smoke.test_torchrun import ARGS, torchrun
from tests.smoke.test_train import SMALL, train

HANG = ["--trainer.hang-timeout-s", "10"]  # well above any phase of these tiny runs, even on a loaded machine


def test_a_stalled_phase_in_one_process_exits_4_with_its_stack_and_one_line(tmp_path) -> None:
    os.environ["RLCORE_TEST_STALL"] = "0:2:scoring"
    try:
        started = time.monotonic()
        proc = train("grpo", *SMALL, "--trainer.steps", "3", "--trainer.val-every", "0", *HANG, out=tmp_path)
    finally:
        del os.environ["RLCORE_TEST_STALL"]
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert time.monotonic() - started < 120  # not the injected hour
    assert "rank 0: no progress for 10 s at step 2, phase 'scoring'; its main thread:" in proc.stderr
    assert "in stall" in proc.stderr  # the main thread's stack, down to the injected sleep
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line == (
        "error: hang: rank 0 made no progress for 10 s at step 2, phase 'scoring'; raise "
        "--trainer.hang-timeout-s if that phase is legitimately this slow"
    )


def test_two_ranks_the_waiting_rank_names_the_one_that_stalled(tmp_path) -> None:
    """Rank 1 stalls in step 2's scoring with its own watchdog stopped (as a rank stuck in C holding the
    GIL would be); rank 0 waits for it in the next collective, and its watchdog names rank 1."""
    env = dict(os.environ) | {"RLCORE_TEST_STALL": "1:2:scoring", "RLCORE_TEST_STALL_MUTE": "1"}
    started = time.monotonic()
    # the stalled rank takes torchrun's SIGTERM as a preemption: a short grace ends it (not torchrun's SIGKILL 30 s on)
    grace = ["--trainer.preempt-grace-s", "1"]
    proc = torchrun(*ARGS, *HANG, *grace, "--out-dir", str(tmp_path), env=env, timeout=240)
    assert proc.returncode != 0 and time.monotonic() - started < 200, proc.stderr[-3000:]
    assert "rank 0: no progress for 10 s at step 2, after phase 'scoring'" in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "error: hang:" in x]
    assert line.endswith(
        "error: hang: rank 1 made no progress for 10 s at step 2, phase 'scoring' (rank 0 at step 2, after phase "
        "'scoring'); raise --trainer.hang-timeout-s if that phase is legitimately this slow"
    ), line
