"""samples.jsonl records (issue 18, item 1): decoding, unicode, scores, advantages, multi-turn turns."""

from __future__ import annotations

import orjson
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from rlcore.batch import Batch
from rlcore.trainer.samples import SampleWriter, sample_records


@pytest.fixture(scope="module")
def tokenizer():
    """A real byte-level BPE tokenizer (multi-byte characters span several tokens), trained here."""
    bpe = ByteLevelBPETokenizer()
    corpus = ["reverse 123 héllo 漢字 ✓ 🎉 call tool result done", "<pad> <eos>"]
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<pad>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rolled_out(tokenizer) -> Batch:
    """Row 0: a single-turn unicode answer; row 1: model text, an observation, model text (multi-turn)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = [ids(tokenizer, "héllo 漢字"), ids(tokenizer, "reverse 123")]
    turns = [(ids(tokenizer, " call"), 1), (ids(tokenizer, " result 🎉"), 0), (ids(tokenizer, " done"), 1)]
    responses = [[*ids(tokenizer, " ✓ 漢字"), eos], [*(t for part, _ in turns for t in part), eos]]
    policy = [[1] * len(responses[0]), [m for part, m in turns for _ in part] + [1]]
    p, t = max(map(len, prompts)), max(map(len, responses))
    tensors = {
        "input_ids": torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
        "attention_mask": torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts]),
        "responses": torch.tensor([x + [pad] * (t - len(x)) for x in responses]),
        "response_mask": torch.tensor([m + [0] * (t - len(m)) for m in policy], dtype=torch.float32),
        "response_attention": torch.tensor([[1.0] * len(x) + [0.0] * (t - len(x)) for x in responses]),
    }
    scores = torch.zeros(2, t)
    scores[0, len(responses[0]) - 1], scores[1, len(responses[1]) - 1] = 0.5, 1.0
    advantages = torch.arange(2 * t, dtype=torch.float32).reshape(2, t)
    return Batch.from_dict(tensors | {
        "token_scores": scores, "advantages": advantages, "data_source": ["s0", "s1"],
        "finish_reason": ["stop", "stop"], "ground_truth": ["漢字", {"answer": 321}],
    })  # fmt: skip


def test_records_decode_unicode_and_carry_score_advantage_and_turns(tokenizer):
    batch = rolled_out(tokenizer)
    first, second = sample_records(batch, tokenizer, step=7)
    assert first == {
        "step": 7, "prompt": "héllo 漢字", "response": " ✓ 漢字<eos>", "score": 0.5,
        # the mean of row 0's advantages over its policy tokens (all its real tokens)
        "advantage": pytest.approx(sum(range(int(batch["response_attention"][0].sum()))) / batch["response_attention"][0].sum().item()),
        "data_source": "s0", "finish_reason": "stop", "ground_truth": "漢字",
    }  # fmt: skip
    assert second["response"] == " call result 🎉 done<eos>"
    assert second["turns"] == [
        {"role": "model", "text": " call"},
        {"role": "observation", "text": " result 🎉"},
        {"role": "model", "text": " done<eos>"},
    ]
    mask, adv = batch["response_mask"][1], batch["advantages"][1]
    assert second["advantage"] == pytest.approx(float((adv * mask).sum() / mask.sum()))
    assert "turns" not in first and second["ground_truth"] == {"answer": 321}


def test_the_writer_appends_the_first_k_and_validation_has_no_advantage(tokenizer, tmp_path):
    writer = SampleWriter(tmp_path, tokenizer, k=1)
    batch = rolled_out(tokenizer)
    writer.write(1, batch)
    writer.write(2, batch)
    writer.write(2, batch.select("input_ids", "attention_mask", "responses", "response_mask",
                                 "response_attention", "token_scores", "data_source"), validation=True)  # fmt: skip
    train = [orjson.loads(x) for x in (tmp_path / "samples.jsonl").read_bytes().splitlines()]
    assert [(r["step"], r["prompt"]) for r in train] == [(1, "héllo 漢字"), (2, "héllo 漢字")]
    (val,) = [orjson.loads(x) for x in (tmp_path / "val_samples.jsonl").read_bytes().splitlines()]
    assert "advantage" not in val and val["score"] == 0.5 and val["finish_reason"] is None
    SampleWriter(tmp_path / "off", tokenizer, k=0).write(1, batch)  # --log.samples 0 writes nothing
    assert not (tmp_path / "off").exists()
