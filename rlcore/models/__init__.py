"""Models: the built-in tiny Llamas with a character-level tokenizer, and Hugging Face directories.

from rlcore.models import load_policy
model, tokenizer = load_policy("builtin:tiny")       # or a local Hugging Face model directory
"""

from rlcore.models.policy import BUILTIN_MODELS, BuiltinSpec, builtin_config, builtin_spec, load_policy
from rlcore.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "CHAT_TEMPLATE",
    "BuiltinSpec",
    "build_char_tokenizer",
    "builtin_config",
    "builtin_spec",
    "load_policy",
]
