"""Prompt rendering and left padding against hand-built token ids (character tokenizer: one id per char)."""

import pytest
import torch

from rlcore.data import DataError, Row, encode_prompt, encode_rows, left_pad, make_prompt_batch, read_rows
from tests.data.conftest import ASSISTANT, BOS, EOS, FIXTURES, PAD, SYSTEM, USER, char_ids


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_template_rendering(chat_tokenizer):
    # <|bos|><|user|>ab<|eos|><|assistant|>
    assert encode_prompt(chat_tokenizer, Row("d", user("ab"))) == [BOS, USER, *char_ids("ab"), EOS, ASSISTANT]
    # a string prompt goes in as one user message
    assert encode_prompt(chat_tokenizer, Row("d", "ab")) == [BOS, USER, *char_ids("ab"), EOS, ASSISTANT]
    two = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    expected = [BOS, SYSTEM, *char_ids("S"), EOS, USER, *char_ids("q"), EOS, ASSISTANT]
    assert encode_prompt(chat_tokenizer, Row("d", two)) == expected


def test_raw_text_without_chat_template(plain_tokenizer):
    assert encode_prompt(plain_tokenizer, Row("d", "ab")) == char_ids("ab")
    two = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert encode_prompt(plain_tokenizer, Row("d", two)) == char_ids("S\nq")  # contents joined by newlines


def test_raw_text_gets_the_tokenizers_own_special_tokens():
    """A base model's tokenizer (no chat template) adds its BOS to raw text; a chat template writes its own."""
    from tokenizers.processors import TemplateProcessing

    from rlcore.models import build_char_tokenizer

    base = build_char_tokenizer()
    base.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", BOS)]
    )
    chat_ids = encode_prompt(base, Row("d", "ab"))
    assert chat_ids == [BOS, USER, *char_ids("ab"), EOS, ASSISTANT]  # template's BOS only, not a second one
    base.chat_template = None
    assert encode_prompt(base, Row("d", "ab")) == [BOS, *char_ids("ab")]


def test_template_failure_names_the_row(chat_tokenizer):
    row = Row("d", [{"role": "tool", "content": "x"}], origin="f.jsonl line 4")
    with pytest.raises(DataError, match=r"^f\.jsonl line 4: chat template failed on field 'prompt': .*tool"):
        encode_prompt(chat_tokenizer, row)


def test_left_pad_by_hand():
    input_ids, attention_mask, position_ids = left_pad([[5, 6], [7, 8, 9, 10], [11]], pad_id=0)
    assert torch.equal(input_ids, torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]]))
    assert torch.equal(attention_mask, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]))
    assert torch.equal(position_ids, torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]))
    assert input_ids.dtype == attention_mask.dtype == position_ids.dtype == torch.long


def test_prompt_batch_by_hand(chat_tokenizer):
    rows = [
        Row("src_a", user("ab"), ground_truth="3", extra_info={"i": 0}),
        Row("src_b", user("xyz"), ground_truth=["4"], extra_info={}),
    ]
    batch = make_prompt_batch(rows, chat_tokenizer, uids=["p0", "p1"])
    row0 = [BOS, USER, *char_ids("ab"), EOS, ASSISTANT]  # 6 tokens
    row1 = [BOS, USER, *char_ids("xyz"), EOS, ASSISTANT]  # 7 tokens
    assert torch.equal(batch["input_ids"], torch.tensor([[PAD, *row0], row1]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[0] + [1] * 6, [1] * 7]))
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]))
    assert batch["uid"] == ["p0", "p1"]
    assert batch["data_source"] == ["src_a", "src_b"]
    assert batch["ground_truth"] == ["3", ["4"]]
    assert batch["extra_info"] == [{"i": 0}, {}]
    assert batch["raw_prompt"] == [user("ab"), user("xyz")]
    assert set(batch.keys()) == {
        "input_ids",
        "attention_mask",
        "position_ids",
        "uid",
        "data_source",
        "ground_truth",
        "extra_info",
        "raw_prompt",
    }


def test_default_uids_unique(chat_tokenizer):
    batch = make_prompt_batch([Row("d", "a"), Row("d", "a"), Row("d", "b")], chat_tokenizer)
    assert len(set(batch["uid"])) == 3
    with pytest.raises(ValueError, match="unique"):
        make_prompt_batch([Row("d", "a"), Row("d", "b")], chat_tokenizer, uids=["x", "x"])


def test_jsonl_file_to_batch_round_trip(chat_tokenizer):
    rows = read_rows(FIXTURES / "rows.jsonl")
    batch = make_prompt_batch(rows, chat_tokenizer, uids=["a", "b", "c"])
    decoded = [
        chat_tokenizer.decode(ids[mask.bool()])
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    assert decoded == [
        "<|bos|><|user|>1+2=?<|eos|><|assistant|>",
        "<|bos|><|user|>Say hi<|eos|><|assistant|>",
        "<|bos|><|system|>Be brief.<|eos|><|user|>9-4=?<|eos|><|assistant|>",
    ]
    assert batch["ground_truth"] == ["3", ["hi", "hello"], "5"]


def test_overlong_drop_counts_and_error_names_row(chat_tokenizer):
    # chat-rendered length = len(content) + 4 (bos, user, eos, assistant)
    rows = [Row("d", user("a" * k), origin=f"f.parquet row {k}") for k in (1, 4, 5, 2)]
    kept, ids, dropped = encode_rows(rows, chat_tokenizer, max_prompt_length=8, overlong="drop")
    assert [len(r.prompt[0]["content"]) for r in kept] == [1, 4, 2]  # 5 + 4 = 9 > 8 dropped; 4 + 4 = 8 kept
    assert dropped == 1 and [len(x) for x in ids] == [5, 8, 6]
    with pytest.raises(
        DataError, match=r"^f\.parquet row 5: field 'prompt' is 9 tokens, longer than max_prompt_length=8"
    ):
        encode_rows(rows, chat_tokenizer, max_prompt_length=8, overlong="error")
    with pytest.raises(ValueError, match="overlong='skip'"):
        encode_rows(rows, chat_tokenizer, max_prompt_length=8, overlong="skip")  # type: ignore[arg-type]
