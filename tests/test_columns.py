"""The batch schema (rlcore.columns): each per-token field padded, aligned and cut on its own side, axis and pad
value, checked against tensors written out by hand."""

from __future__ import annotations

import torch

from rlcore.batch import Batch
from rlcore.columns import COLUMNS, cut_columns, left_pad_prompts, pad_columns
from rlcore.step.steps import concat_rollouts

PAD = 7


def rollout() -> Batch:
    """2 rows, prompts of 2 columns (row 0 left-padded), responses of 3 (row 1 right-padded), one MoE layer
    with k = 1, M-RoPE positions, a per-token float field and a per-row one."""
    return Batch.from_dict({
        "input_ids": torch.tensor([[PAD, 1], [2, 3]]),
        "attention_mask": torch.tensor([[0, 1], [1, 1]]),
        "position_ids": torch.tensor([[0, 0], [0, 1]]),
        "prompt_routes": torch.tensor([[-1, 4], [5, 6]])[:, :, None, None],  # (b, p, L=1, k=1)
        "rope_positions": torch.tensor([[0, 0], [0, 1]])[:, None, :].expand(-1, 3, -1),  # (b, 3, p)
        "responses": torch.tensor([[8, 9, 10], [11, 12, PAD]]),
        "response_routes": torch.tensor([[1, 2, 3], [4, 5, -1]])[:, :, None, None],
        "response_rope_positions": torch.tensor([[1, 2, 3], [2, 3, 0]])[:, None, :].expand(-1, 3, -1),
        "rollout_logprobs": torch.tensor([[-0.5, -0.25, -1.0], [-2.0, -0.125, 0.0]]),
        "rewards": torch.tensor([1.0, 0.0]),  # per row: no columns
    })  # fmt: skip


def test_every_field_is_padded_on_its_side_with_its_value():
    out = pad_columns(rollout(), 4, 5, PAD)
    assert out["input_ids"].tolist() == [[PAD, PAD, PAD, 1], [PAD, PAD, 2, 3]]
    assert out["attention_mask"].tolist() == [[0, 0, 0, 1], [0, 0, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    assert out["prompt_routes"][:, :, 0, 0].tolist() == [[-1, -1, -1, 4], [-1, -1, 5, 6]]
    assert out["rope_positions"][:, 2].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    assert out["responses"].tolist() == [[8, 9, 10, PAD, PAD], [11, 12, PAD, PAD, PAD]]
    assert out["response_routes"][:, :, 0, 0].tolist() == [[1, 2, 3, -1, -1], [4, 5, -1, -1, -1]]
    assert out["response_rope_positions"][:, 0].tolist() == [[1, 2, 3, 0, 0], [2, 3, 0, 0, 0]]
    assert out["rollout_logprobs"].tolist() == [[-0.5, -0.25, -1.0, 0.0, 0.0], [-2.0, -0.125, 0.0, 0.0, 0.0]]
    assert out["rewards"].tolist() == [1.0, 0.0]


def test_aligning_pads_the_prompt_side_only_and_cutting_takes_both_sides():
    batch = rollout()
    aligned = left_pad_prompts(batch, 2, PAD)
    for key, column in COLUMNS.items():
        grown = aligned[key].shape[column.axis] - batch[key].shape[column.axis]
        assert grown == (2 if column.side == "prompt" else 0), key
    cut = cut_columns(aligned, 3, 2)  # the last prompt column, the first two response columns
    assert cut["input_ids"].tolist() == [[1], [3]] and cut["rope_positions"][:, 1].tolist() == [[0], [1]]
    assert cut["prompt_routes"][:, :, 0, 0].tolist() == [[4], [6]]
    assert cut["responses"].tolist() == [[8, 9], [11, 12]]
    assert cut["response_rope_positions"][:, 2].tolist() == [[1, 2], [2, 3]]
    assert cut["rollout_logprobs"].tolist() == [[-0.5, -0.25], [-2.0, -0.125]] and len(cut["rewards"]) == 2


def test_rollouts_of_other_widths_concatenate_aligned():
    wide = pad_columns(rollout(), 3, 4, PAD)
    both = concat_rollouts([rollout(), wide], PAD)
    assert both["input_ids"].shape == (4, 3) and both["responses"].shape == (4, 4)
    assert torch.equal(both[:2]["input_ids"], wide["input_ids"]) and torch.equal(both[2:]["input_ids"], wide["input_ids"])
    assert torch.equal(both[:2]["prompt_routes"], both[2:]["prompt_routes"])
    assert torch.equal(both[:2]["response_rope_positions"], both[2:]["response_rope_positions"])
