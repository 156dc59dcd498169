"""Tensor parallelism (rlcore.dist.tp) on 2 gloo ranks: the log-probs and every gradient of a tp-2 Llama
and Qwen3 (alone and composed with FSDP2) equal the unsplit model's in one process, and the full state
gathers back exactly; the divisibility check names the factor that fails."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from rlcore.models.parallel import tp_problem
from tests.dist import workers


@pytest.mark.parametrize(
    ("kind", "fsdp", "lora"),
    [("qwen3", True, False), ("llama-tied", False, False), ("llama", False, True), ("qwen3-tied", True, True)],
)
def test_tp2_equals_one_process(kind, fsdp, lora, tmp_path):
    """Log-probs and entropies at temperature 0.7, from vocab-parallel logits (lm_head split 25 + 24)
    or, with lm_head tied to the embeddings, whole ones; with FSDP2 over a dp_shard of 1 and without
    (the trainer's tp runs: tests/smoke/test_mesh_train.py). With LoRA on every linear layer, the
    adapters split with their base layers (rlcore.dist.tp.ADAPTER_PLANS): only they get gradients, and
    the merged weights (W + scale B A, what a push to a plain engine copy sends) equal the unsplit ones."""
    workers.spawn("tp_logprobs_and_grads", tmp_path, kind, fsdp, lora)
    diffs = torch.load(tmp_path / f"tp-{kind}-{fsdp}-{lora}.pt")
    assert diffs["logprobs"] < 1e-5 and diffs["entropy"] < 1e-5 and diffs["grads"] < 1e-5, diffs
    assert diffs["vocab_parallel"] == (not kind.endswith("-tied"))
    assert diffs["state"] == 0.0  # the full weights gather back exactly from the tp (and FSDP) shards
    layers = 2 * 7  # q, k, v, o, gate, up, down of 2 layers
    if lora:  # per layer: the base weight, and B of a column-wise layer or A of a row-wise one
        assert diffs["trained"] == 2 * layers and diffs["merged"] < 1e-6, diffs
        assert diffs["sharded"] == 2 * layers + (not kind.endswith("-tied"))
    else:
        assert diffs["sharded"] == layers + (not kind.endswith("-tied"))  # (+ lm_head)


def test_tp_problem_names_the_factor():
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, intermediate_size=64, hidden_size=48)
    assert tp_problem(config, 1) is None and tp_problem(config, 2) is None
    assert tp_problem(config, 4) == (
        "num_attention_heads 6, num_key_value_heads 2 not divisible by tp(4); use a tp that divides them"
    )
    config.model_type = "gpt2"
    assert tp_problem(config, 2).startswith("no tensor-parallel plan for model_type 'gpt2' (plans: llama")
