"""Loading a policy: a built-in tiny Llama (`builtin:<name>`), a local Hugging Face directory or a hub id.

    model, tokenizer = load_policy("builtin:tiny")                      # ~0.4M params, seeded init
    model, tokenizer = load_policy("/models/Qwen2.5-0.5B-Instruct", dtype=torch.bfloat16)
    model, tokenizer = load_policy("Qwen/Qwen2.5-0.5B-Instruct")       # via the HF cache (rlcore.models.hub)
    tokenizer = load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")            # alone, without loading any weights

A built-in model is a real `transformers` `LlamaForCausalLM` (`Qwen3MoeForCausalLM` for `tiny-moe`) with the character-level tokenizer of
`rlcore.models.tokenizer`; it saves and reloads with `save_pretrained` / `from_pretrained` like any
other. If `rlcore/models/weights/<name>/` holds a `save_pretrained` directory, its weights are
loaded instead of the seeded random init.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
)

from rlcore.models.hub import model_directory
from rlcore.models.tokenizer import build_char_tokenizer

BUILTIN_PREFIX = "builtin:"
WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltinSpec:
    """Size of a built-in Llama; everything else comes from the tokenizer and Llama defaults."""

    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Attention (query) heads; head_dim = hidden_size / num_heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    max_positions: int = 2048
    """Longest sequence (prompt + response) in tokens, i.e. characters."""
    experts: int = 0
    """Routed experts per layer (0: a dense Llama; else a Qwen3-MoE whose every layer is a mixture, each
    expert a SwiGLU of width `intermediate_size`)."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k), with the top-k gate weights renormalised."""


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(hidden_size=96, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2),
    "small": BuiltinSpec(hidden_size=256, intermediate_size=688, num_layers=6, num_heads=8, num_kv_heads=4),
    # `tiny` warm-started on the built-in `reverse` task by experiments/warmstart.py (weights ship in
    # rlcore/models/weights/tiny-reverse/): the starting policy of the embedded default run.
    "tiny-reverse": BuiltinSpec(
        hidden_size=96, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2
    ),
    # `tiny` warm-started on the multi-turn `calc` task by experiments/warmstart_calc.py (weights in
    # rlcore/models/weights/tiny-calc/): it calls the calculator some of the time.
    "tiny-calc": BuiltinSpec(
        hidden_size=96, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2
    ),
    # a Qwen3-MoE as wide as `tiny` with 8 experts of a quarter of its MLP, top-2 (the same active
    # MLP width as `tiny`'s half); warm-started on `reverse` by experiments/warmstart.py --model
    # tiny-moe --out rlcore/models/weights/tiny-moe (1,500 SFT steps: greedy val 0.219, sampled 0.411)
    "tiny-moe": BuiltinSpec(
        hidden_size=96, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, experts=8
    ),
}


def builtin_spec(name: str) -> BuiltinSpec:
    """The spec of built-in model `name`; an unknown name is a one-line ValueError listing the choices."""
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown built-in model {BUILTIN_PREFIX}{name}; choose one of {sorted(BUILTIN_MODELS)}"
        )
    return BUILTIN_MODELS[name]


def builtin_config(name: str, tokenizer: Any) -> PretrainedConfig:
    """The config of built-in model `name` for `tokenizer`'s vocabulary: a `LlamaConfig`, or a
    `Qwen3MoeConfig` (every layer a mixture, top-k renormalised) for a mixture of experts."""
    spec = builtin_spec(name)
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer), "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_positions, "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }  # fmt: skip
    if not spec.experts:
        return LlamaConfig(**common)
    return Qwen3MoeConfig(
        **common, head_dim=spec.hidden_size // spec.num_heads, moe_intermediate_size=spec.intermediate_size,
        num_experts=spec.experts, num_experts_per_tok=spec.experts_per_token, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


def load_policy(
    path: str, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) for `builtin:<name>`, a local Hugging Face model directory or a hub id (resolved
    through the Hugging Face cache, `rlcore.models.hub`), in eval mode.

    `seed` fixes a built-in model's random init (without touching the global RNG); it is unused
    when weights are loaded from disk.
    """
    return load_model(path, dtype=dtype, seed=seed), load_tokenizer(path)


def load_model(path: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """The model of `load_policy` alone, in eval mode."""
    if path.startswith(BUILTIN_PREFIX):
        name = path.removeprefix(BUILTIN_PREFIX)
        tokenizer = load_tokenizer(path)
        weights = WEIGHTS_DIR / name
        if (weights / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype, local_files_only=True)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(builtin_config(name, tokenizer))
            model = model.to(dtype)
        return model.eval()
    directory = _directory(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model path {path!r}: cannot load the model ({_first_line(e)})") from None
    return model.eval()


def load_tokenizer(path: str) -> Any:
    """The tokenizer of `load_policy`, without loading any weights (seconds before them on a large model).
    One without a pad token pads with eos, as verl does (padding is masked out anyway)."""
    if path.startswith(BUILTIN_PREFIX):
        spec = builtin_spec(path.removeprefix(BUILTIN_PREFIX))
        return build_char_tokenizer(model_max_length=spec.max_positions)
    directory = _directory(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model path {path!r}: cannot load the tokenizer ({_first_line(e)})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _directory(path: str) -> Path:
    """The Hugging Face directory of a local path or hub id; a one-line ValueError if it is none."""
    try:
        directory = model_directory(path)
    except ValueError as e:
        raise ValueError(f"{e} (or {BUILTIN_PREFIX}<name>, name in {sorted(BUILTIN_MODELS)})") from None
    if not (directory / "config.json").is_file():
        raise ValueError(f"model path {path!r} has no config.json; it is not a Hugging Face model directory")
    return directory


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
