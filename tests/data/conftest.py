"""Shared fixtures: the built-in character tokenizer, with and without its chat template."""

from pathlib import Path

import pytest

from rlcore.models import build_char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT = 0, 1, 2, 4, 5, 6


def char_ids(text: str) -> list[int]:
    """Hand-derived ids of the character tokenizer: 7 specials, then ' '..'~' (ord - 32), then newline."""
    return [7 + 95 if c == "\n" else 7 + ord(c) - 32 for c in text]


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    return tokenizer
