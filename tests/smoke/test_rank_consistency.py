"""What must agree across torchrun ranks does (issue 15): 2 gloo ranks, the real train.py.

Each rank writes the run state it ends with (RLCORE_TEST_DUMP_STATE, rlcore/step/faults.py): KL
coefficient, data cursor, step, bad-update count. Before issue 15 the adaptive KL controller read each
rank's own KL (the coefficients drifted apart) and DAPO's dynamic sampling let a rank that filled up
early stop drawing (its cursor fell behind the others').
"""

from __future__ import annotations

import json

import pytest

from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import KEYS, assert_same_run
from tests.smoke.test_torchrun import ARGS, torchrun

DAPO_KL = ["dapo", *ARGS, "--trainer.steps", "4", "--algo.kl-coef", "0.05", "--algo.kl-ctrl", "adaptive",
           "--algo.kl-target", "3", "--algo.kl-horizon", "10"]  # fmt: skip


def states(directory) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_dapo_with_adaptive_kl_in_lag_mode_agrees_across_ranks_and_resumes_exactly(tmp_path) -> None:
    """DAPO (dynamic sampling) with the adaptive KL controller, K = 2 on 2 ranks: a rank may need more
    sampling rounds than another (rounds of different widths are joined; a rank left with nothing makes
    every rank skip the step together instead of hanging); the ranks end with the same KL coefficient
    (moved by the controller), data cursor and policy version; each checkpoints its
    own slice of the batches generated ahead, and a run killed after step 3's update resumes into the
    uninterrupted run (metrics, KL coefficient, staleness, final weights)."""
    args = [*DAPO_KL, "--pipeline.max-staleness", "2", "--trainer.save-every", "1"]
    reference, dump = tmp_path / "reference", tmp_path / "state"
    proc = torchrun(*args, "--out-dir", str(reference), env={"RLCORE_TEST_DUMP_STATE": str(dump)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = states(dump)
    assert rank0 == rank1 and rank0["policy_version"] == 4
    assert rank0["kl_coef"] != 0.05  # the controller moved it
    killed = tmp_path / "killed"
    proc = torchrun(*args, "--out-dir", str(killed), env={"RLCORE_TEST_KILL_AT": "3:update"})
    assert proc.returncode != 0, proc.stderr[-3000:]  # both ranks SIGKILLed themselves after step 3's update
    proc = torchrun(*args, "--out-dir", str(killed), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(reference, killed)
    a, b = read_metrics(reference / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    for ra, rb in zip(a, b, strict=True):
        for key in (*KEYS, "actor/reward_kl_penalty_coeff", "actor/reward_kl_penalty"):
            assert rb.get(key) == pytest.approx(ra.get(key), abs=1e-6, rel=0), (ra["step"], key)
    assert [r["pipeline/staleness_max"] for r in b] == [0.0, 1.0, 2.0, 2.0]


def test_sft_under_torchrun_validates_the_trained_weights(tmp_path) -> None:
    """Validation runs on each rank's engine copy: it must be synced after the SFT updates."""
    args = ["sft", *ARGS, "--trainer.steps", "2", "--trainer.val-every", "1", "--data.builtin-val-size", "8",
            "--optim.lr", "3e-2"]  # fmt: skip
    dump = tmp_path / "state"
    proc = torchrun(*args, "--out-dir", str(tmp_path / "run"), env={"RLCORE_TEST_DUMP_STATE": str(dump)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, _ = states(dump)
    # each rank's engine copy equals the trained (sharded) policy at the end of the run
    assert rank0["engine_matches_policy"] is True
    assert states(dump)[1]["engine_matches_policy"] is True
