"""train.py on a real pretrained model (issue 34): SmolLM2-135M-Instruct from its Q4_1 GGUF file
(tests/real_model.py), GRPO on a reasoning-gym task, two steps with each engine. The native run trains
LoRA adapters, whose final/adapter must load with peft onto the dequantized base; the vLLM run trains
every weight. Both: the rollout/trainer log-prob gap within 1e-4 in fp32, samples that decode to the
file's ChatML template, responses that stop where the template's turn ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlcore.models.policy import load_model, load_tokenizer
from tests.real_model import smollm2_gguf
from tests.rollout.test_vllm_engine import require_vllm
from tests.smoke.test_train import ok, train

RUN = [
    "--data.train-files", "reasoning_gym:chain_sum?max_terms=2&answer=raw",
    "--data.builtin-train-size", "32", "--data.batch-size", "2", "--rollout.n", "4", "--rollout.max-tokens", "24",
    "--trainer.steps", "2", "--trainer.val-every", "0", "--optim.lr", "5e-6", "--log.no-progress",
]  # fmt: skip


def _check_run(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/logprob_diff_max"] <= 1e-4, r["rollout/logprob_diff_max"]
        assert r["model/params" if r["step"] == 1 else "actor/lr"] > 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        assert s["prompt"].startswith("<|im_start|>system\n") and s["prompt"].endswith(
            "<|im_start|>assistant\n"
        )
        assert "<|im_start|>user\nState the final answer to the following arithmetic problem:" in s["prompt"]
        if (
            s["finish_reason"] == "stop"
        ):  # the turn ends with the template's end-of-turn, and nothing after it
            assert s["response"].endswith("<|im_end|>") and s["response"].count("<|im_end|>") == 1, s[
                "response"
            ]
        else:
            assert s["finish_reason"] == "length" and "<|im_end|>" not in s["response"]
    return records


def test_grpo_on_the_real_model_native_lora_and_its_adapter_loads_with_peft(tmp_path):
    from peft import PeftModel

    gguf = smollm2_gguf()
    ok(train("grpo", "--model.path", str(gguf), *RUN, "--model.lora-rank", "8", out=tmp_path, timeout=600))
    records = _check_run(tmp_path)
    assert records[0]["model/trainable_params"] < records[0]["model/params"] / 50  # the adapters only
    base, tokenizer = load_model(str(gguf)), load_tokenizer(str(gguf))
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "final" / "adapter")).eval()
    merged = load_model(str(tmp_path / "final"))
    ids = torch.tensor([tokenizer("<|im_start|>user\n3 + 4 =<|im_end|>\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(
            adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-4
        )


def test_grpo_on_the_real_model_with_vllm(tmp_path):
    require_vllm()
    gguf = smollm2_gguf()
    ok(train("grpo", "--model.path", str(gguf), *RUN, "--rollout.engine", "vllm", out=tmp_path, timeout=600))
    records = _check_run(tmp_path)
    assert records[0]["model/trainable_params"] == records[0]["model/params"]
    assert records[0]["sync/bytes"] > 4 * 100e6  # every weight pushed into vLLM, in fp32


@pytest.fixture(autouse=True)
def _converted_once():
    """Convert the file before the runs (once per cache; the runs then load the cached directory)."""
    from rlcore.models.gguf import dequantized_directory

    dequantized_directory(smollm2_gguf())
