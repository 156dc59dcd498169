"""Numerical faults: NaN advantages (RLCORE_TEST_NAN_AT_STEPS) make the update non-finite; it is skipped
(the weights stay finite), counted in `actor/bad_updates`, and K in a row (--trainer.max-bad-updates)
abort with exit code 3 and one line — also when the streak spans a kill and a resume."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import RUN, ok


def test_nan_updates_are_skipped_and_counted(launch, tmp_path):
    ok(launch.run(RUN, out=tmp_path, env={"RLCORE_TEST_NAN_AT_STEPS": "2,3"}))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["actor/bad_updates"] for r in records] == [0, 1, 1, 0]
    assert [r["actor/pg_loss"] is None for r in records] == [False, True, True, False]  # NaN: null
    weights = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_k_consecutive_bad_updates_abort_with_exit_3_and_one_line(launch, tmp_path):
    proc = launch.run(
        [*RUN, "--trainer.max-bad-updates", "2"], out=tmp_path, env={"RLCORE_TEST_NAN_AT_STEPS": "2,3,4"}
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(
        "error: step 4: 3 consecutive updates had a non-finite loss or gradient (--trainer.max-bad-updates 2); "
        "last finite metrics: "
    ), lines[0]


def test_the_bad_update_streak_survives_a_resume(launch, tmp_path):
    env = {"RLCORE_TEST_NAN_AT_STEPS": "2,3,4", "RLCORE_TEST_KILL_AT": "4:rollout"}
    killed = launch.run([*RUN, "--trainer.max-bad-updates", "2"], out=tmp_path, env=env)
    assert killed.returncode == -9, killed.stderr[-3000:]  # two bad updates, checkpointed at step 3
    env = {"RLCORE_TEST_NAN_AT_STEPS": "2,3,4"}
    resumed = launch.run([*RUN, "--trainer.max-bad-updates", "2", "--resume", "auto"], out=tmp_path, env=env)
    assert resumed.returncode == 3, resumed.stderr[-3000:]
    assert resumed.stderr.startswith("error: step 4: 3 consecutive updates"), resumed.stderr
