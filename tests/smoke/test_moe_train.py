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
    """torchrun, 2 gloo ranks, lag mode K = 1 with routes replayed: --trainer.ep 2 (each rank holds 4 of
    each layer's 8 experts, tokens moved by all-to-all) trains as FSDP2 alone does: the same rewards,
    losses and router agreement, gradient norms within 1e-4 relative and final weights within 1e-5 after
    3 steps. The ep run is killed after step 3's update and resumes from its step-2 checkpoint: the
    expert shards saved and loaded by DCP, and the batch generated ahead with its recorded routes (R3:
    resume with routes in pending batches). Step 3's batch is sampled after a push (version 1), so its
    rewards check that the engine copies received the experts whole.
    Adam's eps is 1e-3: with 1e-8 its first steps are ~lr sign(g), and round-off-level gradients of
    opposite signs would be amplified to lr (see tests/dist/test_update_dist.py)."""
    import os

    from safetensors.torch import load_file

    from tests.smoke.test_torchrun import torchrun

    args = ["--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--trainer.steps", "3",
            "--trainer.val-every", "0", "--log.no-progress", "--optim.lr", "1e-2", "--optim.eps", "1e-3", *MOE,
            "--algo.router-replay", "replay", "--algo.router-aux-coef", "0.01", "--pipeline.max-staleness", "1"]  # fmt: skip
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
        for key in ("actor/pg_loss", "router/aux_loss", "router/entropy", "rollout/router_agreement"):
            assert rb[key] == pytest.approx(ra[key], abs=1e-5, rel=0), (ra["step"], key)
        # a norm summed over every gradient in another order: measured 1.1e-5 apart at step 3 (8.64)
        assert rb["actor/grad_norm"] == pytest.approx(ra["actor/grad_norm"], rel=1e-4)
    assert b[0]["rollout/logprob_diff_max"] < 1e-4
    assert [r["pipeline/staleness_max"] for r in b] == [0.0, 1.0, 1.0]
    assert min(r["rollout/router_agreement"] for r in b[1:]) < 1.0  # sampled a version back: replayed
    x, y = load_file(fsdp / "final" / "model.safetensors"), load_file(ep / "final" / "model.safetensors")
    assert set(x) == set(y) and any(".experts." in k for k in x)
    for key in x:
        assert (x[key] - y[key]).abs().max() <= 1e-5, key


def test_lora_on_the_experts_pushes_merged_experts_to_the_engine(tmp_path) -> None:
    """One process, --model.lora-rank on builtin:tiny-moe: the adapters (one pair per expert on the fused
    expert tensors, and the linear layers) train; the engine samples from a plain copy into which each
    push merges them, so from step 2 on (B no longer 0) a wrong expert merge would show in the rollout/
    trainer gap; final/ holds the merged experts and final/adapter/ their adapters."""
    from safetensors.torch import load_file

    from rlcore.models import load_policy

    ok(train(*MOE, "--model.lora-rank", "8", "--optim.lr", "1e-2", "--trainer.steps", "3", "--trainer.val-every", "0",
             "--data.batch-size", "4", "--rollout.n", "4", "--log.no-progress", out=tmp_path))  # fmt: skip
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records), records
    adapter = load_file(tmp_path / "final" / "adapter" / "adapter_model.safetensors")
    assert (
        sum(".experts.lora_" in k or ".experts.base_layer.lora_" in k for k in adapter) == 4 * 4
    )  # layers x A,B x 2
    final = load_file(tmp_path / "final" / "model.safetensors")
    base = dict(load_policy("builtin:tiny-moe")[0].named_parameters())
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    assert (final[expert] - base[expert]).abs().max() > 1e-4  # merged: the experts moved


def test_expert_parallel_trainer_ranks_under_split_placement(tmp_path) -> None:
    """torchrun, 3 gloo ranks, split placement: 1 rollout rank and 2 trainer ranks splitting the experts
    (the ep mesh is built over the trainer ranks, on every rank). K = 0: the rollout rank samples from
    the weights the trainer ranks pushed (their expert shards gathered whole), so the rollout/trainer gap
    stays at float32 rounding and the replayed routes are the trainer's own at every step."""
    from tests.smoke.test_torchrun import torchrun

    proc = torchrun("--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--trainer.steps", "3",
                    "--trainer.val-every", "0", "--log.no-progress", "--optim.lr", "1e-2", *MOE, "--algo.router-replay",
                    "replay", "--trainer.ep", "2", "--pipeline.placement", "split", "--out-dir", str(tmp_path), nproc=3)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["sync/bytes"] > 0 for r in records)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records), records
    assert all(r["rollout/router_agreement"] == 1.0 for r in records)
