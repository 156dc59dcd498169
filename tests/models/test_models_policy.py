"""Built-in models and tokenizer: exact round trips, the chat template, and save -> load_policy(dir)."""

import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.models import BUILTIN_MODELS, CHAT_TEMPLATE, build_char_tokenizer, load_policy
from rlcore.models import policy as policy_module
from rlcore.models.tokenizer import SPECIAL_TOKENS

ALPHABET = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """builtin:tiny saved with save_pretrained (model + tokenizer), and its logits on a fixed input."""
    model, tokenizer = load_policy("builtin:tiny", seed=3)
    directory = tmp_path_factory.mktemp("weights") / "tiny"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    ids = torch.tensor([tokenizer("<|bos|><|user|>1+2=<|eos|><|assistant|>")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return directory, ids, logits


def test_vocabulary_layout(tokenizer):
    # 7 special tokens, 95 printable ASCII characters (space .. ~), newline
    assert len(tokenizer) == 7 + 95 + 1
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(7))
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer("A\n", add_special_tokens=False)["input_ids"] == [7 + ord("A") - 32, 7 + 95]


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=80))
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # exact, even when the text spells a marker such as <|eos|>
    if not any(t in text for t in SPECIAL_TOKENS):
        assert len(ids) == len(text)  # one token per character


def test_roles_are_single_tokens_and_unknown_chars_are_unk(tokenizer):
    assert tokenizer("<|user|>x<|assistant|>", add_special_tokens=False)["input_ids"] == [
        5,
        7 + ord("x") - 32,
        6,
    ]
    assert tokenizer("é\t", add_special_tokens=False)["input_ids"] == [3, 3]
    assert tokenizer.decode([1, 5, 7 + ord("h") - 32, 2], skip_special_tokens=True) == "h"


def test_chat_template_matches_hand_written(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|system|>Be brief.<|eos|><|user|>2+2?<|eos|><|assistant|>"
    no_prompt = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<|bos|><|user|>2+2?<|eos|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chars = [7 + ord(c) - 32 for c in "Be brief."], [7 + ord(c) - 32 for c in "2+2?"]
    assert ids == [1, 4, *chars[0], 2, 5, *chars[1], 2, 6]  # bos system ... eos user ... eos assistant


def test_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(Exception, match="unsupported chat role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_builtin_sizes_and_seeded_init():
    tiny, tok = load_policy("builtin:tiny")
    n_tiny = sum(p.numel() for p in tiny.parameters())
    assert 100_000 < n_tiny < 1_000_000
    assert tiny.config.vocab_size == len(tok) and tiny.config.model_type == "llama"
    again, _ = load_policy("builtin:tiny")
    other, _ = load_policy("builtin:tiny", seed=1)
    states = tiny.state_dict().values(), again.state_dict().values(), other.state_dict().values()
    pairs = list(zip(*states, strict=True))
    assert all(torch.equal(a, b) for a, b, _ in pairs)
    assert not all(torch.equal(a, c) for a, _, c in pairs)
    spec = BUILTIN_MODELS["small"]  # "small" is ~ a few M params; counted from its shape, not built
    per_layer = (
        2 * spec.hidden_size**2 * (1 + spec.num_kv_heads / spec.num_heads)
        + 3 * spec.hidden_size * spec.intermediate_size
    )
    assert 1_000_000 < spec.num_layers * per_layer < 10_000_000


def test_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_policy("builtin:tiny", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_dtype():
    model, _ = load_policy("builtin:tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_save_then_load_policy_gives_identical_logits(saved_tiny):
    directory, ids, logits = saved_tiny
    model, tokenizer = load_policy(str(directory))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|bos|><|user|>hi<|eos|><|assistant|>"
    )
    assert tokenizer.decode(tokenizer("a b\nc", add_special_tokens=False)["input_ids"]) == "a b\nc"


def test_builtin_loads_shipped_weights(saved_tiny, monkeypatch):
    directory, ids, logits = saved_tiny
    monkeypatch.setattr(policy_module, "WEIGHTS_DIR", directory.parent)  # weights/tiny/ = the saved dir
    model, _ = load_policy("builtin:tiny")  # seed 0 here; the saved weights came from seed 3
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)


def test_missing_path_is_one_clear_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"^model path '.*nowhere' is not a directory; expected .* builtin:<name>"
    ) as e:
        load_policy(str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_policy(str(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"unknown built-in model builtin:huge; choose one of \['small', 'tiny', 'tiny-calc', 'tiny-moe', 'tiny-reverse', 'tiny-vl'\]",
    ):
        load_policy("builtin:huge")


def test_directory_errors_are_one_line(tmp_path, saved_tiny):
    directory, _, _ = saved_tiny
    (tmp_path / "config.json").write_bytes((directory / "config.json").read_bytes())  # config, no weights
    with pytest.raises(ValueError, match=r"cannot load the model \(") as e:
        load_policy(str(tmp_path))
    assert "\n" not in str(e.value)
    no_tokenizer = tmp_path / "no_tok"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((directory / name).read_bytes())
    with pytest.raises(ValueError, match=r"cannot load the tokenizer \(") as e:
        load_policy(str(no_tokenizer))
    assert "\n" not in str(e.value)


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    model, tokenizer = load_policy("builtin:tiny")
    tokenizer.pad_token = None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _, loaded = load_policy(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == 2
