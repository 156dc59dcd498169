"""Segments, samples and the Batch built from recorded calls, against tensors written out by hand."""

import pytest
import torch

from rlcore.gateway.record import Call, extends, sample, segments, splits, to_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

PAD = 0
# turn 1 samples [4, 5]; turn 2's prompt is turn 1's context + observation [6, 7]; it samples [8]
A = Call((1, 2, 3), (4, 5), (-0.5, -0.25), "stop", 0)
B = Call((1, 2, 3, 4, 5, 6, 7), (8,), (-1.0,), "stop", 1)
# an edited history (turn 1's tokens dropped, as a template that drops a past <think> block does)
C = Call((1, 9), (10, 11, 12), (-0.125, -0.0625, -0.375), "length", 1)


def test_extends_is_a_token_exact_prefix():
    assert extends(A, B)
    assert not extends(A, C)
    assert extends(A, Call((1, 2, 3, 4, 5), (6,), (0.0,), "stop", 0))  # no observation between: still one
    assert not extends(A, Call((1, 2, 3, 4), (5,), (0.0,), "stop", 0))  # shorter than A's context
    assert not extends(A, Call((1, 2, 3, 5, 4, 6), (7,), (0.0,), "stop", 0))  # same tokens, other order


def test_segments_split_where_the_prefix_breaks():
    assert segments([A, B]) == [[A, B]] and splits([A, B]) == 0
    assert segments([A, B, C]) == [[A, B], [C]] and splits([A, B, C]) == 1
    assert segments([A, C, B]) == [[A], [C], [B]] and splits([A, C, B]) == 2  # B extends A, not C
    assert segments([]) == [] and splits([]) == 0


def test_sample_interleaves_sampled_ids_and_observations():
    s = sample([A, B])
    assert s.prompt == (1, 2, 3)
    assert s.response == (4, 5, 6, 7, 8)  # A.ids | observation B.prompt[5:] | B.ids
    assert s.mask == (1.0, 1.0, 0.0, 0.0, 1.0)
    assert s.logprobs == (-0.5, -0.25, 0.0, 0.0, -1.0)
    assert s.versions == (0, 0, 1, 1, 1)  # an observation carries the version of the call it precedes
    assert s.finish_reason == "stop" and s.num_turns == 2


def test_to_batch_matches_hand_built_tensors():
    samples = [sample(seg) for seg in segments([A, B, C])]
    batch = to_batch(samples, pad_id=PAD, max_response=4, uids=["s", "s"])
    # prompts left-padded as rlcore.data.prompts.left_pad: position = clip(cumsum(mask) - 1, 0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [PAD, 1, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    # row 0 has 5 response tokens, cut to the budget of 4 (finish "length"); row 1 right-padded
    assert batch["responses"].tolist() == [[4, 5, 6, 7], [10, 11, 12, PAD]]
    expected_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    expected_attention = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    expected_logprobs = torch.tensor([[-0.5, -0.25, 0.0, 0.0], [-0.125, -0.0625, -0.375, 0.0]])
    torch.testing.assert_close(batch["response_mask"], expected_mask, rtol=0, atol=0)
    torch.testing.assert_close(batch["response_attention"], expected_attention, rtol=0, atol=0)
    torch.testing.assert_close(batch["rollout_logprobs"], expected_logprobs, rtol=0, atol=0)
    assert batch["rollout_versions"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert batch["finish_reason"] == ["length", "length"] and batch["uid"] == ["s", "s"]
    assert batch["num_turns"].tolist() == [2, 1]
    assert batch["num_observation_tokens"].tolist() == [2, 0]  # row 0: [6, 7]; row 1: none


def test_to_batch_keeps_a_sample_within_the_budget_as_it_is():
    batch = to_batch([sample([A, B])], pad_id=PAD, max_response=5, uids=["s"])
    assert batch["responses"].tolist() == [[4, 5, 6, 7, 8]] and batch["finish_reason"] == ["stop"]


def test_to_batch_checks_its_uids():
    with pytest.raises(ValueError, match="1 samples but 2 uids"):
        to_batch([sample([A])], pad_id=PAD, max_response=4, uids=["a", "b"])
