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


def test_expert_parallel_ranks_train_as_fsdp_alone_and_resume(tmp_path) -> None:
    """torchrun, 2 gloo ranks: --trainer.ep 2 (each rank holds 4 of each layer's 8 experts, tokens moved
    by all-to-all) trains as FSDP2 alone does: the same rewards, gradient norms within 1e-5 and final
    weights within 1e-5 after 3 steps. The ranks' engine copies sample with the gathered experts (the
    rollout/trainer gap stays at float32 rounding). The ep run is killed after step 3's update and
    resumes from its step-2 checkpoint (the expert shards saved and loaded by DCP) into those weights.
    Adam's eps is 1e-3: with 1e-8 its first steps are ~lr sign(g), and round-off-level gradients of
    opposite signs would be amplified to lr (see tests/dist/test_update_dist.py)."""
    import os

    from safetensors.torch import load_file

    from tests.smoke.test_torchrun import torchrun

    args = ["--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--trainer.steps", "3",
            "--trainer.val-every", "0", "--log.no-progress", "--optim.lr", "1e-2", "--optim.eps", "1e-3", *MOE,
            "--algo.router-replay", "replay", "--algo.router-aux-coef", "0.01"]  # fmt: skip
    fsdp, ep = tmp_path / "fsdp", tmp_path / "ep"
    proc = torchrun(*args, "--out-dir", str(fsdp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ep_args = [*args, "--trainer.ep", "2", "--trainer.save-every", "1", "--out-dir", str(ep)]
    proc = torchrun(*ep_args, env=dict(os.environ) | {"RLCORE_TEST_KILL_AT": "3:update"})
    assert proc.returncode != 0, proc.stderr[-3000:]  # both ranks SIGKILLed themselves after step 3's update
    assert sorted(p.name for p in (ep / "checkpoints").iterdir()) == ["step_1", "step_2"]
    proc = torchrun(*ep_args, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(fsdp / "metrics.jsonl"), read_metrics(ep / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [r["train/reward_mean"] for r in b] == [r["train/reward_mean"] for r in a]
    for ra, rb in zip(a, b, strict=True):
        for key in ("actor/pg_loss", "router/aux_loss", "router/entropy"):
            assert rb[key] == pytest.approx(ra[key], abs=1e-5, rel=0), (ra["step"], key)
        # a norm summed over every gradient in another order: measured 1.1e-5 apart at step 3 (8.64)
        assert rb["actor/grad_norm"] == pytest.approx(ra["actor/grad_norm"], rel=1e-4)
        assert rb["rollout/logprob_diff_max"] < 1e-4
    x, y = load_file(fsdp / "final" / "model.safetensors"), load_file(ep / "final" / "model.safetensors")
    assert set(x) == set(y) and any(".experts." in k for k in x)
    for key in x:
        assert (x[key] - y[key]).abs().max() <= 1e-5, key
