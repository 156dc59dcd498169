"""The built-in character-level tokenizer: one token per character, chat roles as single tokens.

Vocabulary (103 ids): the special tokens below (ids 0-6), then printable ASCII (space to `~`)
and newline. Any other character encodes to `<|unk|>`, so text in that alphabet round-trips
exactly: `decode(encode(text, add_special_tokens=False)) == text` (the `Fuse` decoder joins the
characters with nothing between them). Encoding adds no special tokens by itself; the chat
template writes BOS and the role markers:

    <|bos|><|system|>{system}<|eos|><|user|>{user}<|eos|><|assistant|>      (generation prompt)

An assistant turn ends with `<|eos|>`, which is also the stop token for sampling.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *(f"<|{role}|>" for role in ROLES))
CHARACTERS = (*(chr(c) for c in range(32, 127)), "\n")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer(*, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The character-level tokenizer with its chat template (see the module docstring)."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per char
    backend.decoder = decoders.Fuse()  # join pieces with no separator
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[f"<|{role}|>" for role in ROLES],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=model_max_length,
    )
