"""SIGKILL at a random point of a run, then `--resume auto`: the result equals an uninterrupted run's.

Ten seeds each pick a (step, phase); the run kills itself there (RLCORE_TEST_KILL_AT, see
rlcore/step/faults.py): after the rollout (data cursor advanced, nothing learned), after the update
(weights changed in memory, nothing logged) or inside a checkpoint save (files written, not committed).
A fresh process then resumes from what is on disk and must end with the same metrics and weights.
"""

from __future__ import annotations

import random
import re
import signal

import pytest

from rlcore.dist.checkpoint import latest_checkpoint
from rlcore.step.faults import PHASES
from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import RUN, STEPS, assert_same_run, ok

SEEDS = range(10)


def kill_plan(seed: int) -> tuple[int, str]:
    rng = random.Random(seed)
    return rng.randint(1, STEPS), rng.choice(PHASES)


def test_the_seeds_kill_in_every_phase_and_at_first_and_last_steps():
    plans = [kill_plan(seed) for seed in SEEDS]
    assert {phase for _, phase in plans} == set(PHASES)
    assert {step for step, _ in plans} >= {1, STEPS}


@pytest.mark.parametrize("seed", SEEDS)
def test_killed_run_resumes_to_the_uninterrupted_result(seed, launch, reference, tmp_path):
    step, phase = kill_plan(seed)
    killed = launch.run(RUN, out=tmp_path, env={"RLCORE_TEST_KILL_AT": f"{step}:{phase}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    checkpoints = tmp_path / "checkpoints"
    # where the kill landed: step-1 is the newest complete checkpoint; inside a save, step's .tmp is left
    assert latest_checkpoint(checkpoints) == (checkpoints / f"step_{step - 1}" if step > 1 else None)
    assert (checkpoints / f"step_{step}.tmp").is_dir() == (phase == "save")
    metrics = tmp_path / "metrics.jsonl"
    logged = [r["step"] for r in read_metrics(metrics)] if metrics.exists() else []
    assert logged == list(range(1, step + (phase == "save")))
    ok(launch.run([*RUN, "--resume", "auto"], out=tmp_path))
    assert_same_run(reference, tmp_path)
    assert not list(checkpoints.glob("*.tmp"))  # the resumed run's saves pruned the leftover


def test_a_native_crash_prints_every_threads_python_stack(launch, tmp_path):
    """A rank that dies in native code (here SIGABRT, as `terminate called ...` does) leaves the Python
    stack of each of its threads in stderr (train.py enables faulthandler), not just an exit code."""
    env = {"RLCORE_TEST_KILL_AT": "1:update", "RLCORE_TEST_KILL_SIGNAL": "SIGABRT"}
    crashed = launch.run(RUN, out=tmp_path, env=env)
    assert crashed.returncode == -signal.SIGABRT, crashed.stderr[-2000:]
    assert "Fatal Python error: Aborted" in crashed.stderr, crashed.stderr[-2000:]
    assert re.search(r'File ".*rlcore/step/faults\.py", line \d+ in kill_point', crashed.stderr)
