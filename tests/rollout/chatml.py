"""A ChatML tokenizer for the multi-turn tests, built here: byte-level BPE trained on a small corpus,
`<|im_start|>` / `<|im_end|>` / `<|endoftext|>` special, `<tool_call>` / `</tool_call>` added (not
special, as in Qwen2.5), eos `<|im_end|>` and pad `<|endoftext|>` (pad != eos), and a chat template in
the Qwen2.5 / Hermes layout: tool schemas in the system turn, tool results as `<tool_response>` blocks
of one user turn. `THINK_TEMPLATE` also drops `<think>...</think>` from past assistant turns, as Qwen3
does (not prefix-stable).
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>")

_ASSISTANT = "{{- message.content }}"
_ASSISTANT_THINK = (
    "{%- if not loop.last and '</think>' in message.content %}"
    "{{- message.content.split('</think>')[-1].lstrip('\\n') }}"
    "{%- else %}{{- message.content }}{%- endif %}"
)

_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}@ASSISTANT@{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATE = _TEMPLATE.replace("@ASSISTANT@", _ASSISTANT)
THINK_TEMPLATE = _TEMPLATE.replace("@ASSISTANT@", _ASSISTANT_THINK)

_CORPUS = [
    "You are a helpful assistant. Guess the number between 0 and 9.",
    "higher lower correct wrong try again the answer is",
    '{"name": "add", "arguments": {"a": 2, "b": 3}}',
    "user assistant system tool_response tools function",
    "0123456789 + - * / = ( ) [ ] , . : ;",
] * 4


@functools.cache
def _backend() -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_CORPUS, trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return backend


def build_chatml_tokenizer(template: str = TEMPLATE) -> PreTrainedTokenizerFast:
    """A fresh ChatML tokenizer (see the module docstring) with `template` as its chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_backend().to_str()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        padding_side="left",
    )
