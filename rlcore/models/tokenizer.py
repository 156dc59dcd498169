"""The built-in character-level tokenizer: one token per character, chat roles as single tokens.

Vocabulary (103 ids): the special tokens below (ids 0-6), then printable ASCII (space to `~`)
and newline. Any other character encodes to `<|unk|>`, so text in that alphabet round-trips
exactly: `decode(encode(text, add_special_tokens=False)) == text` (the `Fuse` decoder joins the
characters with nothing between them). Encoding adds no special tokens by itself; the chat
template writes BOS and the role markers:

    <|bos|><|system|>{system}<|eos|><|user|>{user}<|eos|><|assistant|>      (generation prompt)

An assistant turn ends with `<|eos|>`, which is also the stop token for sampling.

`vision=True` (the built-in vision-language model) appends Qwen2-VL's three vision tokens (ids 103-105:
`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`) and a template that also takes a message's
content as parts, an image part rendering as `<|vision_start|><|image_pad|><|vision_end|>`.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *(f"<|{role}|>" for role in ROLES))
CHARACTERS = (*(chr(c) for c in range(32, 127)), "\n")
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

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

VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer(*, model_max_length: int = 2048, vision: bool = False) -> PreTrainedTokenizerFast:
    """The character-level tokenizer with its chat template (see the module docstring)."""
    specials = (*SPECIAL_TOKENS, *(VISION_TOKENS if vision else ()))
    vocab = {
        token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS, *specials[len(SPECIAL_TOKENS) :]))
    }
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per char
    backend.decoder = decoders.Fuse()  # join pieces with no separator
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[f"<|{role}|>" for role in ROLES] + list(specials[len(SPECIAL_TOKENS) :]),
        chat_template=VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=model_max_length,
    )
