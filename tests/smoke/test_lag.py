"""Lag mode (issue 16, item 3): step t's batch is generated with policy version max(0, t - 1 - K)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import assert_same_run
from tests.smoke.test_train import ROOT, SMALL, ok, train


def kill_and_resume(args: list[str], tmp_path) -> None:
    """`train.py ARGS` uninterrupted (tmp_path/reference), and SIGKILLed in step 3's update then resumed with
    --resume auto (tmp_path/killed): the two runs end alike (metrics, final weights)."""
    ok(train(*args, out=tmp_path / "reference"))
    env = os.environ | {"RLCORE_TEST_KILL_AT": "3:update", "TRANSFORMERS_VERBOSITY": "error"}
    killed = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(tmp_path / "killed")],
                            cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ok(train(*args, "--resume", "auto", out=tmp_path / "killed"))
    assert_same_run(tmp_path / "reference", tmp_path / "killed")


def test_staleness_follows_the_lag_schedule(tmp_path) -> None:
    ok(train("grpo", *SMALL, "--pipeline.max-staleness", "2", "--trainer.steps", "4", "--trainer.val-every", "0",
             out=tmp_path))  # fmt: skip
    records = read_metrics(tmp_path / "metrics.jsonl")
    # trained at version t - 1, generated with max(0, t - 3): 0, 1, 2, then 3 - 1 = 2
    assert [r["pipeline/staleness_max"] for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert [r["pipeline/staleness_mean"] for r in records] == [0.0, 1.0, 2.0, 2.0]


def test_a_lagged_run_killed_and_resumed_equals_the_uninterrupted_one(tmp_path) -> None:
    """The checkpoint holds the batches already generated for the next K steps (and their versions), here
    a mixture of experts' with the routes recorded for replay (R3, issue 36): the resumed run replays them
    as the uninterrupted one does."""
    args = ["grpo", *SMALL, "--pipeline.max-staleness", "2", "--trainer.steps", "5", "--trainer.save-every", "1",
            "--trainer.val-every", "0", "--model.path", "builtin:tiny-moe", "--algo.router-replay", "replay"]  # fmt: skip
    kill_and_resume(args, tmp_path)
    a, b = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("reference", "killed"))
    assert [r["pipeline/staleness_max"] for r in b] == [r["pipeline/staleness_max"] for r in a]
    assert [r["rollout/router_agreement"] for r in b] == [r["rollout/router_agreement"] for r in a]
    # sampled two versions back, the recorded routes are not all the trainer's own any more
    assert min(r["rollout/router_agreement"] for r in a[2:]) < 1.0


def test_one_step_behind_learns_the_default_task(tmp_path) -> None:
    ok(train("--pipeline.max-staleness", "1", "--log.no-progress", out=tmp_path, timeout=400))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["val/reward_mean"] < 0.3 and records[-1]["val/reward_mean"] >= 0.9


def test_bad_staleness_is_one_line(tmp_path) -> None:
    proc = train("grpo", *SMALL, "--pipeline.max-staleness", "-1", out=tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "error: --pipeline.max-staleness -1: must be >= 0 (0 is synchronous)"
    )
    proc = train("sft", *SMALL, "--pipeline.max-staleness", "1", out=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --pipeline.max-staleness 1: --algo.objective sft has no rollouts"
    )
