"""Loading a policy: a built-in tiny Llama (`builtin:<name>`), a local Hugging Face directory or a hub id.

    model, tokenizer = load_policy("builtin:tiny")                      # ~0.4M params, seeded init
    model, tokenizer = load_policy("/models/Qwen2.5-0.5B-Instruct", dtype=torch.bfloat16)
    model, tokenizer = load_policy("Qwen/Qwen2.5-0.5B-Instruct")       # via the HF cache (rlcore.models.hub)
    tokenizer = load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")            # alone, without loading any weights

A built-in model is a real `transformers` `LlamaForCausalLM` (`Qwen3MoeForCausalLM` for `tiny-moe`,
`Qwen2VLForConditionalGeneration` for `tiny-vl`, whose images come through `load_vision`) with the character-level tokenizer of
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
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2VLConfig,
    Qwen3MoeConfig,
)

from rlcore.data.vision import VisionProcessor
from rlcore.models.hub import model_directory
from rlcore.models.tokenizer import VISION_TOKENS, build_char_tokenizer
from rlcore.models.vision import (
    chat_template_of,
    is_vision_config,
    load_vision_processor,
    vision_processor_of,
)

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
    vision_depth: int = 0
    """Vision-tower blocks (0: a text model; else a Qwen2-VL whose vision tower has this many blocks of
    width `vision_width`, patches of `patch_size` pixels merged 2x2, images resized to `image_size`)."""
    vision_width: int = 64
    """Width of the vision tower's blocks."""
    patch_size: int = 8
    """Side of a square patch, in pixels."""
    image_size: int = 48
    """Side every image is resized to (a multiple of 2 * patch_size): (image_size / patch_size / 2)^2
    language-model tokens per image."""


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
    # a Qwen2-VL with `tiny`'s language model and a 2-block vision tower over 48x48 images (9 image
    # tokens each); warm-started on `shapes` by experiments/warmstart_vl.py (weights in
    # rlcore/models/weights/tiny-vl/)
    "tiny-vl": BuiltinSpec(
        hidden_size=96, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2, vision_depth=2
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
    if spec.vision_depth:
        return _vision_config(spec, tokenizer, common)
    if not spec.experts:
        return LlamaConfig(**common)
    return Qwen3MoeConfig(
        **common, head_dim=spec.hidden_size // spec.num_heads, moe_intermediate_size=spec.intermediate_size,
        num_experts=spec.experts, num_experts_per_tok=spec.experts_per_token, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


def _vision_config(spec: BuiltinSpec, tokenizer: Any, text: dict[str, Any]) -> Qwen2VLConfig:
    """A Qwen2-VL config: `text` as its language model (M-RoPE sections over the head's frequency pairs)."""
    head_dim = spec.hidden_size // spec.num_heads
    sections = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]  # temporal, height, width
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
    start, image, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    vision = {"depth": spec.vision_depth, "embed_dim": spec.vision_width, "hidden_size": spec.hidden_size,
              "num_heads": 4, "mlp_ratio": 2, "patch_size": spec.patch_size, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_channels": 3}  # fmt: skip
    return Qwen2VLConfig(text_config={**text, "rope_parameters": rope}, vision_config=vision,
                         image_token_id=image, vision_start_token_id=start, vision_end_token_id=end,
                         tie_word_embeddings=True)  # fmt: skip


def _builtin_vision(spec: BuiltinSpec, config: Qwen2VLConfig, tokenizer: Any) -> VisionProcessor:
    """The built-in vision-language model's image processing: every image resized to `image_size`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = spec.image_size**2
    processor = Qwen2VLImageProcessorPil(patch_size=spec.patch_size, merge_size=2, temporal_patch_size=2,
                                         min_pixels=pixels, max_pixels=pixels)  # fmt: skip
    return vision_processor_of(config, processor, tokenizer)


def load_vision(path: str, tokenizer: Any = None) -> VisionProcessor | None:
    """The image processing of model `path` (`rlcore.models.vision`), None for a text-only model; no
    weights load. `tokenizer`: the model's, when already loaded (else it is loaded here)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
    if path.startswith(BUILTIN_PREFIX):
        name = path.removeprefix(BUILTIN_PREFIX)
        spec = builtin_spec(name)
        return (
            _builtin_vision(spec, builtin_config(name, tokenizer), tokenizer) if spec.vision_depth else None
        )
    directory = _directory(path)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    try:
        return load_vision_processor(directory, config, tokenizer)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model path {path!r}: cannot load its image processor ({_first_line(e)})") from None


def auto_class(config: PretrainedConfig) -> Any:
    """The Auto class whose model a config makes: image-text-to-text for a vision-language family."""
    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


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
        config = builtin_config(name, tokenizer)
        if (weights / "config.json").is_file():
            model = auto_class(config).from_pretrained(weights, dtype=dtype, local_files_only=True)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = auto_class(config).from_config(config)
            model = model.to(dtype)
        return model.eval()
    directory = _directory(path)
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        model = auto_class(config).from_pretrained(directory, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model path {path!r}: cannot load the model ({_first_line(e)})") from None
    return model.eval()


def context_length(module: Any, tokenizer: Any) -> int:
    """A loaded model's context: its (text) config's `max_position_embeddings` (a vision-language model's is its
    language model's, as `rlcore.config.model_checks.max_positions` reads it), else the tokenizer's
    `model_max_length` (also for an engine that holds no module here)."""
    config = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "max_position_embeddings", None) or tokenizer.model_max_length)


def load_tokenizer(path: str) -> Any:
    """The tokenizer of `load_policy`, without loading any weights (seconds before them on a large model).
    One without a pad token pads with eos, as verl does (padding is masked out anyway)."""
    if path.startswith(BUILTIN_PREFIX):
        spec = builtin_spec(path.removeprefix(BUILTIN_PREFIX))
        return build_char_tokenizer(model_max_length=spec.max_positions, vision=spec.vision_depth > 0)
    directory = _directory(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model path {path!r}: cannot load the tokenizer ({_first_line(e)})") from None
    if not getattr(tokenizer, "chat_template", None):  # a processor keeps its template beside the tokenizer
        tokenizer.chat_template = chat_template_of(directory)
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
