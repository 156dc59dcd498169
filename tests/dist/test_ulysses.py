"""Ulysses sequence parallelism (rlcore.dist.ulysses): on 2 gloo ranks the log-probs, entropies and every
gradient of an sp-2 model equal the unsplit model's; the row layout it computes in, and its checks."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from rlcore.dist.ulysses import SequenceLayout, sp_problem
from tests.dist import workers


@pytest.mark.parametrize(
    ("kind", "fsdp", "kv_heads"), [("qwen3", True, 2), ("llama", False, 1)]
)
def test_sp2_equals_one_process(kind, fsdp, kv_heads, tmp_path):
    """kv_heads 1 < sp 2: each rank's query heads get copies of the one KV head before the all-to-all."""
    workers.spawn("sp_logprobs_and_grads", tmp_path, kind, fsdp, kv_heads)
    diffs = torch.load(tmp_path / f"sp-{kind}-{fsdp}-{kv_heads}.pt")
    assert diffs["logprobs"] < 1e-5 and diffs["entropy"] < 1e-5, diffs
    assert diffs["grads"] < 1e-5 * diffs["grad_scale"], diffs  # the sp ranks' partial gradients sum to it


def test_layout_moves_each_row_to_column_zero_and_back():
    attention = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    ids = torch.arange(18).reshape(3, 6)
    layout = SequenceLayout.of(attention, sp=4)
    assert layout.offset.tolist() == [2, 0, 1] and layout.width == 8  # 6 real tokens at most, up to 4k
    shifted = layout.shift(ids, fill=-1)
    assert shifted.tolist() == [[2, 3, 4, 5, -1, -1, -1, -1], [6, 7, 8, 9, 10, 11, -1, -1],
                                [13, 14, 15, 16, 17, -1, -1, -1]]  # fmt: skip
    columns = torch.tensor([[2, 4], [0, 5], [1, 2]])  # back to the batch's columns
    assert layout.unshift(shifted, columns).tolist() == [[2, 4], [6, 11], [13, 14]]
    assert layout.local(shifted, 1).tolist() == [[4, 5], [8, 9], [15, 16]]


def test_layout_refuses_rows_with_holes():
    with pytest.raises(ValueError, match="one block"):
        SequenceLayout.of(torch.tensor([[1, 0, 1]]), sp=2)


def test_sp_problem_names_the_factor():
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    assert sp_problem(config, 1) is None and sp_problem(config, 2) is None and sp_problem(config, 3) is None
    assert sp_problem(config, 2, tp=2) == (
        "num_attention_heads 6 not divisible by tp(2) * sp(2); use an sp that divides them"
    )
    config.sliding_window = 64
    assert sp_problem(config, 2).startswith("sliding-window / chunked attention is not built")
