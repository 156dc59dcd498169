"""train.py with LoRA (issue 19): learns, resumes exactly, exports merged + adapter, refuses bad input."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from rlcore.models import load_policy
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import SMALL, ok, train

LORA = ["--model.lora-rank", "8"]


def test_lora_alone_learns_the_default_task(tmp_path) -> None:
    """`python train.py --model.lora-rank 16` (the default LoRA lr, 5e-3): val <= 0.3 -> >= 0.9 by step 10
    (0.964 there, 0.998 at the default 30 steps: experiments/README.md, bench_lora)."""
    ok(train("--model.lora-rank", "16", "--trainer.steps", "10", "--log.no-progress", out=tmp_path))
    val = [r["val/reward_mean"] for r in read_metrics(tmp_path / "metrics.jsonl") if "val/reward_mean" in r]
    assert val[0] <= 0.3 and val[-1] >= 0.9, val


def test_lora_ppo_with_kl_resumes_exactly_and_exports_merged_and_adapter(tmp_path) -> None:
    """PPO with KL: LoRA on the policy (the reference: its adapter disabled) and on the critic's backbone
    (the value head trains in full); both checkpoints hold the trained tensors only; 2 + resume + 2 steps
    equal 4 straight, bit for bit; final/ is the merged model, final/adapter the peft adapter."""
    common = [*SMALL, *LORA, "--critic.lora-rank", "8", "--trainer.val-every", "0", "--trainer.save-every", "1",
              "--algo.kl-coef", "0.05"]  # fmt: skip
    ok(train("ppo", *common, "--trainer.steps", "4", out=tmp_path / "straight"))
    ok(train("ppo", *common, "--trainer.steps", "2", out=tmp_path / "resumed"))
    ok(train("ppo", *common, "--trainer.steps", "4", "--resume", "auto", out=tmp_path / "resumed"))
    straight, resumed = (read_metrics(tmp_path / r / "metrics.jsonl") for r in ("straight", "resumed"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    keys = ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/reward_kl_penalty", "critic/vf_loss",
            "critic/grad_norm")  # fmt: skip
    for a, b in zip(straight, resumed, strict=True):
        for key in keys:
            assert a[key] == b[key], (a["step"], key)  # bit-exact
    assert straight[-1]["actor/reward_kl_penalty"] != 0  # the reference (adapter off) differs from the policy
    a, b = (
        load_file(tmp_path / r / "final" / "adapter" / "adapter_model.safetensors")
        for r in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoints hold the adapters (and the critic's value head) with their optimizer state only
    checkpoints = tmp_path / "straight" / "checkpoints"
    actor = FileSystemReader(str(checkpoints / "step_4" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in actor if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]
    assert all(".lora_" in k for k in actor if k.startswith("optim.state."))
    critic = (
        FileSystemReader(str(checkpoints / "critic" / "step_4" / "dcp")).read_metadata().state_dict_metadata
    )
    critic_keys = [k for k in critic if k.startswith("model.")]
    assert critic_keys and all(".lora_" in k or "value_head" in k for k in critic_keys), critic_keys
    assert any("value_head" in k for k in critic_keys)
    # final/ is the merged model; final/adapter on the base model computes the same
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final")
    base, _ = load_policy("builtin:tiny-reverse")
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "straight" / "final" / "adapter"))
    ids = torch.tensor([[1, 5, 9, 13, 4, 7, 2, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_resuming_with_another_lora_shape_is_refused(tmp_path) -> None:
    common = [*SMALL, "--trainer.val-every", "0", "--trainer.save-every", "1"]
    ok(train("grpo", *common, *LORA, "--trainer.steps", "1", out=tmp_path))
    proc = train("grpo", *common, "--model.lora-rank", "4", "--trainer.steps", "2", out=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert (
        "holds a model trained with path builtin:tiny-reverse, lora_rank 8" in line
        and "--model.lora-*" in line
    )


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--model.lora-rank", "-1"], "error: --model.lora-rank -1: must be >= 1 (or 0: no LoRA)"),
        (["--model.lora-rank", "4", "--model.lora-targets", "q_proj", "qkv_proj"],
         "error: --model.lora-targets q_proj qkv_proj: LoRA targets ['qkv_proj'] are not linear layers of the "
         "model; it has ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"),
        (["--model.lora-rank", "4", "--model.lora-alpha", "0"], "error: --model.lora-alpha 0.0: must be > 0"),
        (["--critic.lora-rank", "-2"], "error: --critic.lora-rank -2: must be >= 1 (or 0: no LoRA)"),
    ],
)  # fmt: skip
def test_bad_lora_flags_are_one_line(flags, line, tmp_path) -> None:
    proc = train("grpo", *SMALL, "--trainer.steps", "1", *flags, out=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == [line]


def test_lora_under_torchrun_syncs_the_adapter_only(tmp_path) -> None:
    """2 gloo ranks, FSDP2 over the adapted policy: each rank's native engine copy (with the same adapter
    layers) receives only the adapter tensors, and samples exactly what the trainer computes."""
    from tests.smoke.test_torchrun import ARGS, torchrun

    proc = torchrun(*ARGS, *LORA, "--algo.kl-coef", "0.05", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    adapter = records[0]["model/trainable_params"] * 4  # fp32 bytes
    assert 0 < adapter < 0.2 * records[0]["model/params"] * 4
    assert all(r["sync/bytes"] == adapter for r in records), [r["sync/bytes"] for r in records]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records), records
    assert records[-1]["actor/reward_kl_penalty"] > 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    base, _ = load_policy("builtin:tiny-reverse")
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "final" / "adapter"))
    ids = torch.tensor([[1, 5, 9, 13, 4, 7, 2, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5
        )
