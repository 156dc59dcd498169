"""RewardModel: a tiny random Llama reward model with its own tokenizer and chat template, saved and
loaded like a Hugging Face checkpoint; micro-batching and padding never change a score; mixing with
a rule reward in score_step."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from rlcore.batch import Batch
from rlcore.models import build_char_tokenizer
from rlcore.rewards import RewardModel, RewardScorer, score_step

RM_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '[U]' if m['role'] == 'user' else '[A]' }}{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}"
)
SPECIALS = ["[PAD]", "[EOS]", "[UNK]", "[U]", "[A]"]


def rm_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer unlike the policy's: other ids, other markers, other template."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars[::-1])}  # reversed: ids differ from the policy's
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        chat_template=RM_TEMPLATE,
    )


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = rm_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm(rm_dir):
    return RewardModel.from_pretrained(str(rm_dir), dtype=torch.float64, micro_batch_size=2)


def direct(rm: RewardModel, text: str) -> float:
    """The model on one unpadded sequence: the reference a padded micro-batch must reproduce."""
    ids = rm.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item()


PROMPTS = ["2+3", [{"role": "user", "content": "reverse 123"}], "hi", "a much longer prompt here", "x"]
RESPONSES = ["5", "321", "", "ok", "a long, long response text"]


def test_render_uses_the_reward_models_own_template(rm):
    assert rm.render("2+3", "5") == "[U]2+3[EOS][A]5[EOS]"
    assert rm.render([{"role": "user", "content": "q"}], "a") == "[U]q[EOS][A]a[EOS]"


def test_scores_equal_unpadded_single_sequences(rm):
    got = rm.score(PROMPTS, RESPONSES)  # 5 rows in micro-batches of 2, padded to different widths
    expected = torch.tensor([direct(rm, rm.render(p, r)) for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    assert got.shape == (5,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=0)
    assert got.unique().numel() == 5  # a random model tells the rows apart


def test_micro_batch_size_does_not_change_scores(rm_dir, rm):
    one = RewardModel.from_pretrained(str(rm_dir), dtype=torch.float64, micro_batch_size=1)
    torch.testing.assert_close(one.score(PROMPTS, RESPONSES), rm.score(PROMPTS, RESPONSES), atol=1e-6, rtol=0)


def test_max_length_keeps_the_end(rm_dir):
    short = RewardModel.from_pretrained(str(rm_dir), dtype=torch.float64, max_length=6)
    ids = short.encode("a much longer prompt here", "the end")
    full = short.tokenizer(short.render("a much longer prompt here", "the end"), add_special_tokens=False)
    assert ids == full["input_ids"][-6:]


def test_reward_model_needs_one_label(rm_dir):
    tokenizer = rm_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_labels=2,
    )
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(LlamaForSequenceClassification(config), tokenizer)


def policy_batch(policy_tok, prompts: list[str], responses: list[str], *, raw: bool) -> Batch:
    """Left-padded prompts and right-padded responses (+ EOS), tokenized by the policy's tokenizer."""
    enc = [policy_tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    p_width = max(map(len, enc))
    input_ids, attention_mask = (
        torch.zeros(len(enc), p_width, dtype=torch.long),
        torch.zeros(len(enc), p_width, dtype=torch.long),
    )
    for i, seq in enumerate(enc):
        input_ids[i, p_width - len(seq) :] = torch.tensor(seq)
        attention_mask[i, p_width - len(seq) :] = 1
    width = 8
    resp, mask = (
        torch.zeros(len(responses), width, dtype=torch.long),
        torch.zeros(len(responses), width, dtype=torch.long),
    )
    for i, text in enumerate(responses):
        seq = policy_tok(text, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
        resp[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    fields = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": resp,
        "response_mask": mask,
        "response_attention": mask,
        "data_source": ["builtin/add"] * len(prompts),
        "ground_truth": ["5", "9"],
        "extra_info": [{}, {}],
    }
    if raw:
        fields["raw_prompt"] = [[{"role": "user", "content": p}] for p in prompts]
    return Batch.from_dict(fields)


@pytest.mark.parametrize("raw", [True, False], ids=["raw_prompt", "decoded-prompt"])
def test_score_step_mixes_rule_and_model_by_weight(rm, raw):
    policy_tok = build_char_tokenizer()
    batch = policy_batch(policy_tok, ["2+3", "4+5"], ["5", "8"], raw=raw)
    with RewardScorer(data_sources={"builtin/add"}) as scorer:
        out, metrics = score_step(
            scorer, batch, tokenizer=policy_tok, reward_model=rm, rule_weight=0.5, rm_weight=2.0
        )
    rm_scores = rm.score(["2+3", "4+5"], ["5", "8"])  # a plain-string prompt is one user message
    rule = torch.tensor([1.0, 0.0])  # 2+3=5 right, 4+5=8 wrong
    expected = 0.5 * rule + 2.0 * rm_scores
    torch.testing.assert_close(out["token_scores"][:, 1], expected, atol=1e-6, rtol=0)  # "5"/"8" + EOS
    assert out["token_scores"].count_nonzero() == 2
    assert metrics["reward/rm_mean"] == pytest.approx(rm_scores.mean().item(), abs=1e-6)
    assert metrics["reward/rule_mean"] == pytest.approx(0.5)
    assert metrics["reward/score_mean"] == pytest.approx(expected.mean().item(), abs=1e-6)


def test_score_step_with_reward_model_only(rm):
    policy_tok = build_char_tokenizer()
    batch = policy_batch(policy_tok, ["2+3", "4+5"], ["5", "8"], raw=True)
    out, metrics = score_step(None, batch, tokenizer=policy_tok, reward_model=rm)
    torch.testing.assert_close(
        out["token_scores"][:, 1], rm.score(["2+3", "4+5"], ["5", "8"]), atol=1e-6, rtol=0
    )
    assert "reward/errors" not in metrics and "reward/rm_mean" in metrics
