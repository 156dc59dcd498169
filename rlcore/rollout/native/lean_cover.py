"""Which models the lean decode step (`rlcore.rollout.native.lean`) reproduces, and the layout of a layer's tensors.

    why = unsupported(model)              # None when the lean step computes what the modules do

Covered (the families whose record says `lean`, `rlcore.models.families`): Llama, Qwen2, Qwen3 (q/k RMSNorm), Mistral, and the mixtures of experts
with their attention (Qwen2-MoE, Qwen3-MoE, Mixtral; OLMoE normalises q/k over all heads at once and
keeps the Hugging Face step), as `from_pretrained` builds them (`<Type>ForCausalLM` with `.model.layers`
and `.lm_head`), every layer full attention, a rotary type that does not depend on the sequence length
(default, linear, llama3, yarn), plain `torch.nn.Linear` projections or peft LoRA linears over them (one
active adapter, no DoRA: the step adds scale (x A^T) B^T as peft does), and no forward hooks (another
wrapper, a quantized or a hooked module computes more than its weight). In exact mode, LoRA adapters
keep the Hugging Face step (the trainer adds them in place).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlcore.models import exact
from rlcore.models.families import covering, family_of

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""Rotary types whose cos/sin at a position do not depend on the sequence length."""


Layer = tuple[Any, ...]
"""One decoder layer's tensors, in `LAYER_FIELDS` order (None where a bias, norm or dense MLP is absent),
then each projection's LoRA (A, B, scale), in `PROJECTIONS` order (None without an adapter), then the
layer's sparse MoE block (a module, or a function calling it; None for a dense MLP)."""

LAYER_FIELDS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.gate_proj.bias",
    "mlp.up_proj.weight",
    "mlp.up_proj.bias",
    "mlp.down_proj.weight",
    "mlp.down_proj.bias",
)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
"""The projections, in `lean_step`'s order; a LoRA layer's (A, B, scale) follow the `LAYER_FIELDS`."""


def full_attention_only(config: Any) -> bool:
    """Whether every layer of `config` is plain full attention (then the preallocated cache fits)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is None and not getattr(
        config, "attention_chunk_size", None
    )


def unsupported(model: torch.nn.Module, mode: exact.KernelMode = exact.DEFAULT_MODE) -> str | None:
    """Why the lean step cannot run `model` in kernel `mode` (one phrase), or None when it can."""
    config = getattr(model, "config", None)
    why = family_of(model).refusal("lean")
    if why is not None:
        return f"model_type {getattr(config, 'model_type', None)!r}: {why} (lean: {covering('lean')})"
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if base is None or head is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return f"{type(model).__name__} is not a <Type>ForCausalLM with .model.layers and .lm_head"
    if not full_attention_only(config):
        return "not every layer is full attention"
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    dense = [layer.mlp for layer in base.layers if sparse_block(layer) is None]
    if any(not callable(getattr(mlp, "act_fn", None)) for mlp in dense):
        return "the MLP has no act_fn"
    if mode is exact.EXACT_MODE and any(is_lora(m) for m in model.modules()):
        return "exact mode with LoRA adapters (the trainer adds them in place: the Hugging Face step)"
    return _plain_modules(model)


def sparse_block(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder layer's sparse MoE block (an `mlp` with `experts` and no dense `gate_proj`), or None."""
    mlp = getattr(layer, "mlp", None)
    return mlp if hasattr(mlp, "experts") and not hasattr(mlp, "gate_proj") else None


def _plain_modules(model: torch.nn.Module) -> str | None:
    """Why the step would not compute what the modules do (a wrapped or hooked projection, e.g. a LoRA
    or quantized linear, whose forward is more than its weight), or None."""
    base = model.model
    paths = sorted({field.rsplit(".", 1)[0] for field in LAYER_FIELDS})  # the modules the tensors are of
    found = [(path, get(layer, path)) for layer in base.layers for path in paths]
    linears = [model.lm_head] + [m for path, m in found if path.endswith("_proj") and m is not None]
    norms = [base.norm] + [m for path, m in found if not path.endswith("_proj") and m is not None]
    for module in linears:
        why = _lora_problem(module)
        if why is not None:
            return why
        if is_lora(module):
            module = module.base_layer
        if type(module) is not torch.nn.Linear:
            return f"a projection is a {type(module).__name__}, not a plain torch.nn.Linear"
    for module in [*linears, *norms, base.embed_tokens, *base.layers]:
        hooks = [h for h in module._forward_hooks.values() if not _marks_grad(h)]
        if hooks or module._forward_pre_hooks:
            return f"{type(module).__name__} has forward hooks"
    if type(base.embed_tokens) is not torch.nn.Embedding:
        return f"the embedding is a {type(base.embed_tokens).__name__}"
    if any(not type(n).__name__.endswith("RMSNorm") for n in norms):
        return "a norm is not an RMSNorm"
    return None


def _marks_grad(hook: object) -> bool:
    """Transformers' `enable_input_require_grads` hook (activation checkpointing adds it to the embedding):
    it marks the output as requiring grad and changes no value, so the step may run without it."""
    return getattr(hook, "__name__", None) == "make_inputs_require_grads"


def is_lora(module: torch.nn.Module) -> bool:
    """A peft LoRA `Linear`, or a subclass of one (rlcore's in-place forward), without importing peft."""
    return any(
        c.__module__.startswith("peft.tuners.lora") and c.__name__ == "Linear" for c in type(module).__mro__
    )


def _lora_problem(module: torch.nn.Module) -> str | None:
    """Why a peft LoRA linear is not base + scale B A x (the step's low-rank path), or None (also when
    `module` is not a LoRA layer)."""
    if not is_lora(module):
        return None
    active = list(module.active_adapters)
    if module.merged or module.disable_adapters:
        return None  # the adapter is already in the weight, or off: the base layer computes it all
    if len(active) != 1 or getattr(module, "use_dora", {}).get(active[0], False):
        return "a LoRA projection has several active adapters or DoRA"
    if module.lora_bias.get(active[0], False) if hasattr(module, "lora_bias") else False:
        return "a LoRA projection has an adapter bias"
    return None


def lora_of(module: Any) -> tuple[Tensor, Tensor, float] | None:
    """(A, B, scale) of a LoRA projection whose adapter is applied at run time; None otherwise."""
    if module is None or not is_lora(module) or module.merged or module.disable_adapters:
        return None
    name = module.active_adapters[0]
    return module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])


def get(module: torch.nn.Module, path: str) -> Any:
    """The attribute at dotted `path` below `module`, or None where a part is missing."""
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj
