"""Hugging Face's attention switch: the name on a transformers config (`_attn_implementation`) of the
attention function its model calls. Read and set here only.

    attention_of(model)                                  # "sdpa", "eager", "rlcore_exact", ...; None: not transformers
    set_attention(model, "rlcore_exact")                 # the model's configs, in place (transformers' own setter)
    config = with_attention(config, "rlcore_ulysses")    # a copy; the original, which another model may share, keeps its own

Sequence parallelism (`rlcore.dist.ulysses`) routes a model's attention through its own function and the model
layer (exact mode, the forward layouts) reads which one a model runs, so the switch sits here, below both.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

_SWITCH = "_attn_implementation"

CUSTOM_MASK = ("sdpa", "eager")
"""Hugging Face's attentions that take a custom 4D mask (a packed row's block-diagonal one)."""


def has_switch(config: Any) -> bool:
    """Whether `config` carries the switch (a transformers config does)."""
    return hasattr(config, _SWITCH)


def attention_of(model_or_config: Any) -> str | None:
    """The attention a model (or its config) runs: "sdpa", "eager", a registered name; None without a switch."""
    config = getattr(model_or_config, "config", None) if isinstance(model_or_config, nn.Module) else model_or_config
    return getattr(config, _SWITCH, None)


def set_attention(model: nn.Module, name: str) -> None:
    """Switch `model` (in place, every config it holds) to the attention registered as `name`."""
    model.set_attn_implementation(name)


def with_attention(config: Any, name: str) -> Any:
    """A copy of `config` whose model runs the attention registered as `name` (`config` itself unchanged)."""
    own = copy.deepcopy(config)
    setattr(own, _SWITCH, name)
    return own
