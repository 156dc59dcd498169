"""A model whose vocabulary is larger than its tokenizer (issue 61), as Qwen2.5 pads 151,643 tokens to
151,936 ids: a random-init model of that vocabulary samples ids past the tokenizer's, decodes them without
failing, and trains a step through train.py. The tokenizer is SmolLM2's (49,152 ids), so about two thirds
of a random model's ids lie beyond it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import Row
from rlcore.models.policy import load_policy, load_tokenizer
from rlcore.rollout import NativeEngine, SamplingParams
from tests.real_model import smollm2_gguf
from tests.smoke.test_train import ok, train

VOCAB = 151_936


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("wide-vocab")
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True,
                         max_position_embeddings=2048)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(str(smollm2_gguf())).save_pretrained(path)
    return path


def test_ids_past_the_tokenizer_are_sampled_and_decoded(wide):
    model, tokenizer = load_policy(str(wide))
    assert model.config.vocab_size == VOCAB > len(tokenizer) == 49_152
    rows = [Row(data_source="t", prompt=[{"role": "user", "content": t}]) for t in ("reverse 4021", "hi")]
    prompts = make_prompt_batch(rows, tokenizer, uids=["a", "b"])
    out = NativeEngine(model, tokenizer).generate(prompts, SamplingParams(n=4, max_tokens=16, seed=0))
    ids = out["responses"][out["response_attention"].bool()]
    assert (ids >= len(tokenizer)).sum() > ids.numel() // 3  # most of a random model's ids lie past it
    texts = tokenizer.batch_decode(out["responses"].tolist(), skip_special_tokens=False)
    assert len(texts) == 8 and all(isinstance(t, str) for t in texts)


def test_a_step_trains_and_its_samples_are_written(wide, tmp_path):
    proc = train("grpo", "--model.path", str(wide), "--data.batch-size", "4", "--rollout.n", "2",
                 "--rollout.max-tokens", "12", "--trainer.steps", "1", "--trainer.val-every", "0",
                 "--data.builtin-val-size", "4", out=tmp_path)  # fmt: skip
    ok(proc)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and record["response/length_mean"] > 0  # (a random model scores 0: no gradient)
    assert math.isfinite(record["actor/pg_loss"]) and record["perf/mem/saved_tensors_mb"] > 0
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["response"], str) for s in samples)
