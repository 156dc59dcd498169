"""Tensor parallelism (rlcore.dist.tp) on 2 gloo ranks: the log-probs and every gradient of a tp-2 Llama
and Qwen3 (alone and composed with FSDP2) equal the unsplit model's in one process, and the full state
gathers back exactly; the divisibility check names the factor that fails."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from rlcore.dist.tp import tp_problem
from tests.dist import workers


@pytest.mark.parametrize(("kind", "fsdp"), [("qwen3", True), ("llama-tied", False)])
def test_tp2_equals_one_process(kind, fsdp, tmp_path):
    """Log-probs and entropies at temperature 0.7, from vocab-parallel logits (lm_head split 25 + 24)
    or, with lm_head tied to the embeddings, whole ones; with FSDP2 over a dp_shard of 1 and without
    (the trainer's tp runs: tests/smoke/test_mesh_train.py)."""
    workers.spawn("tp_logprobs_and_grads", tmp_path, kind, fsdp)
    diffs = torch.load(tmp_path / f"tp-{kind}-{fsdp}.pt")
    assert diffs["logprobs"] < 1e-5 and diffs["entropy"] < 1e-5 and diffs["grads"] < 1e-5, diffs
    assert diffs["vocab_parallel"] == (not kind.endswith("-tied"))
    assert diffs["state"] == 0.0  # the full weights gather back exactly from the tp (and FSDP) shards
    assert diffs["sharded"] == 2 * 7 + (not kind.endswith("-tied"))  # q, k, v, o, gate, up, down (+ lm_head)


def test_tp_problem_names_the_factor():
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, intermediate_size=64, hidden_size=48)
    assert tp_problem(config, 1) is None and tp_problem(config, 2) is None
    assert tp_problem(config, 4) == (
        "num_attention_heads 6, num_key_value_heads 2 not divisible by tp(4); use a tp that divides them"
    )
    config.model_type = "gpt2"
    assert tp_problem(config, 2).startswith("no tensor-parallel plan for model_type 'gpt2' (plans: llama")
