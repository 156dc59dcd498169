"""train.py on a mixture of experts (issue 36): builtin:tiny-moe learns the default task with its routes
recorded or replayed (R3). A lagged run with routes in its pending batches resumes exactly: test_lag.py."""

from __future__ import annotations

import pytest

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ok, train

MOE = ["--model.path", "builtin:tiny-moe"]


@pytest.mark.parametrize("mode", ["record", "replay"])
def test_tiny_moe_learns_the_default_task(mode, tmp_path) -> None:
    """val <= 0.3 -> >= 0.9 in 12 steps; colocated, the engine samples with the trained module itself,
    so its routes are the trainer's own: agreement 1 and a rollout/trainer gap at float32 rounding (< 1e-4)."""
    ok(train(*MOE, "--algo.router-replay", mode, "--algo.router-aux-coef", "0.001", "--trainer.steps", "12",
             "--trainer.val-every", "12", "--log.no-progress", out=tmp_path))  # fmt: skip
    records = read_metrics(tmp_path / "metrics.jsonl")
    val = [r["val/reward_mean"] for r in records if "val/reward_mean" in r]
    assert val[0] <= 0.3 and val[-1] >= 0.9, val
    trained = [r for r in records if "rollout/router_agreement" in r]
    assert len(trained) == 12
    assert all(r["rollout/router_agreement"] == 1.0 for r in trained)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in trained)
    assert all(r["router/aux_loss"] >= 2.0 - 1e-4 for r in trained)  # top-2: 2 when balanced, more otherwise
