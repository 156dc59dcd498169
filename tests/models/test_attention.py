"""Hugging Face's attention switch has one owner (`rlcore.dist.attention`): nothing else in rlcore/ reads or sets
it, and its readers and setters do what the model layer and sequence parallelism need of them."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.dist.attention import CUSTOM_MASK, attention_of, has_switch, set_attention, with_attention

RLCORE = Path(__file__).resolve().parents[2] / "rlcore"
OWNER = RLCORE / "dist" / "attention.py"


def test_only_the_owner_touches_the_switch():
    touching = sorted(str(p.relative_to(RLCORE.parent)) for p in RLCORE.rglob("*.py")
                      if "_attn_implementation" in p.read_text())  # fmt: skip
    assert touching == [str(OWNER.relative_to(RLCORE.parent))]


def _tiny(attention: str = "sdpa") -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, attn_implementation=attention)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_reads_a_model_or_its_config():
    model = _tiny("eager")
    assert attention_of(model) == attention_of(model.config) == "eager"
    assert has_switch(model.config) and not has_switch(object())
    assert attention_of(torch.nn.Linear(2, 2)) is None  # no config: not a transformers model
    assert attention_of(None) is None
    assert "eager" in CUSTOM_MASK and "sdpa" in CUSTOM_MASK


def test_set_attention_switches_the_model_in_place():
    model = _tiny("sdpa")
    set_attention(model, "eager")
    assert attention_of(model) == "eager"
    assert all(attention_of(c) == "eager" for c in (model.config, model.model.config))


def test_with_attention_leaves_the_shared_config_alone():
    """Sequence parallelism gives each config a copy: a reference model sharing the config keeps its attention."""
    model = _tiny("sdpa")
    own = with_attention(model.config, "eager")
    assert attention_of(own) == "eager" and attention_of(model.config) == "sdpa"
    assert own is not model.config and own.hidden_size == model.config.hidden_size
