"""Tiny random vision-language models of every family rlcore covers, on the built-in vision tokenizer."""

from __future__ import annotations

import io

import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

from rlcore.models.policy import _builtin_vision, builtin_spec
from rlcore.models.tokenizer import VISION_TOKENS, build_char_tokenizer

HEAD = 16  # head_dim: 8 frequency pairs, M-RoPE sections 2 + 3 + 3


def tokenizer():
    return build_char_tokenizer(vision=True)


def config(family: str):
    """A 2-layer language model and a 2-block vision tower (8-pixel patches merged 2x2) of `family`."""
    tok = tokenizer()
    start, image, end = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    text = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 32, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_channels": 3}  # fmt: skip
    ids = {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end}
    if family == "qwen2_vl":
        return Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 32, "hidden_size": 64,
                             "mlp_ratio": 2}, **ids)  # fmt: skip
    if family == "qwen2_5_vl":
        return Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "intermediate_size": 64,
                                "out_hidden_size": 64, "window_size": 32, "fullatt_block_indexes": [1]}, **ids)  # fmt: skip
    assert family == "qwen3_vl"
    text3 = {**text, "head_dim": HEAD, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": True}}
    return Qwen3VLConfig(text_config=text3, vision_config={**vision, "intermediate_size": 64, "out_hidden_size": 64,
                         "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}, **ids)  # fmt: skip


def model(family: str, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForImageTextToText.from_config(config(family)).eval()


def vision(family: str):
    """Images resized to 48x48 (as `builtin:tiny-vl`'s), placeholders as the tokenizer's."""
    return _builtin_vision(builtin_spec("tiny-vl"), config(family), tokenizer())


def png(color: str, size: tuple[int, int] = (48, 48)) -> bytes:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse((4, 4, 20, 20), fill=color)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
