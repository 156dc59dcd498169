"""Vision-language policies: which families rlcore covers and how their image processing loads.

    vp = load_vision_processor(directory, config, tokenizer)   # None for a text-only model

A forward over images takes them as `Images`: each distinct image once (the n samples of a prompt share
their image tensors, so a micro-batch of GRPO rows holds each image n times) and the index of the distinct
image behind each placeholder run; `feeding(model, images)` runs the model's vision tower once per
distinct image and hands each run its features (its gradient the sum over the runs, as the per-row
forwards would give), where the Hugging Face forward would encode every row's copy.

The families share Qwen2-VL's image processing (patches merged 2x2 into one language-model token) and
its multimodal rotary positions (`rlcore.data.vision`). Their models come from
`AutoModelForImageTextToText`; their chat template may sit beside the tokenizer (`chat_template.jinja`
or `chat_template.json`, as processors save it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlcore.data.vision import VisionProcessor
from rlcore.models.families import family_of

VISION_FIELDS = ("pixel_values", "image_grid_thw")
"""The per-row vision inputs a batch carries in `multi_modal_inputs` (see `rlcore.data.prompts`)."""


def is_vision_config(config: Any) -> bool:
    """Whether a model config is of a vision-language family rlcore covers."""
    return family_of(config).vision is not None


def vision_tower(model: Any) -> Any:
    """The vision tower module of a vision-language model (`model.model.visual` in every family), or None."""
    return (
        getattr(getattr(model, "model", None), "visual", None)
        if is_vision_config(getattr(model, "config", None))
        else None
    )


def placeholder_ids(model: Any) -> list[int]:
    """The image and video placeholder ids of a vision-language model (none for a text model). The policy
    never samples them: a placeholder in a response would claim image features the forward does not
    have, so the engine and every trainer forward give them `suppress`'s logit (the same distribution
    on both sides)."""
    config = getattr(model, "config", None)
    if not is_vision_config(config):
        return []
    vocab = config.get_text_config().vocab_size  # (a built-in model has no video token in its vocabulary)
    ids = (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
    return [i for i in ids if i is not None and 0 <= i < vocab]


def vision_processor_of(config: Any, image_processor: Any, tokenizer: Any) -> VisionProcessor:
    """The `VisionProcessor` of a vision-language `config` with its image processor and tokenizer."""
    token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id != config.image_token_id:
        raise ValueError(
            f"the tokenizer's {token} is id {token_id} but the model's image_token_id is {config.image_token_id}"
        )
    return VisionProcessor(image_processor=image_processor, image_token=token, image_token_id=token_id,
                           merge=config.vision_config.spatial_merge_size)  # fmt: skip


def load_vision_processor(directory: Path, config: Any, tokenizer: Any) -> VisionProcessor | None:
    """The `VisionProcessor` of the model in `directory` (its `preprocessor_config.json`), or None for a
    text-only model."""
    if not is_vision_config(config):
        return None
    import transformers

    settings = _processor_settings(directory)
    cls = getattr(transformers, family_of(config).vision, None)
    if cls is None:  # older transformers export it from the family's module only
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "size",
            "image_mean", "image_std")  # fmt: skip
    return vision_processor_of(config, cls(**{k: settings[k] for k in keys if k in settings}), tokenizer)


def _processor_settings(directory: Path) -> dict[str, Any]:
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = directory / name
        if path.is_file():
            doc = json.loads(path.read_text())
            return doc.get("image_processor", doc)
    raise ValueError(f"{directory}: a vision-language model without preprocessor_config.json")


def chat_template_of(directory: Path) -> str | None:
    """A processor's chat template kept beside the tokenizer (`chat_template.jinja` / `.json`), or None."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    path = directory / "chat_template.json"
    if path.is_file():
        return json.loads(path.read_text()).get("chat_template")
    return None


def suppress(logits: Tensor, ids: Tensor) -> Tensor:
    """`logits` (..., v) with columns `ids` set, in place, to -1e9 (or the dtype's lowest): probability
    exactly 0 after a softmax, yet finite, so entropies and temperature scaling stay finite."""
    return logits.index_fill_(-1, ids.to(logits.device), max(-1e9, torch.finfo(logits.dtype).min))


@dataclasses.dataclass(frozen=True)
class Images:
    """A forward's images: the distinct ones, and which of them each placeholder run (in row order) shows."""

    pixel_values: Tensor
    """(patches, d) of the distinct images, one after the other."""
    image_grid_thw: Tensor
    """(distinct images, 3) long."""
    index: Tensor | None = None
    """(runs,) long: the distinct image of each placeholder run in the sequences, in order; None: the
    runs are the distinct images, in order."""

    def to(self, device: torch.device) -> Images:
        return dataclasses.replace(self, pixel_values=self.pixel_values.to(device),
                                   image_grid_thw=self.image_grid_thw.to(device))  # fmt: skip


def images_of(rows: list[dict[str, Tensor]]) -> Images | None:
    """The `Images` of rows' vision inputs (`multi_modal_inputs`: a dict per row, empty without images);
    rows holding the same tensors (a prompt's samples) count once. None when no row has an image."""
    distinct: dict[int, tuple[int, dict[str, Tensor]]] = {}  # id(pixel_values) -> (first image, inputs)
    index: list[int] = []
    images = 0
    for row in rows:
        if not row:
            continue
        count = row["image_grid_thw"].shape[0]
        first, _ = distinct.setdefault(id(row["pixel_values"]), (images, row))
        images += count if first == images else 0
        index.extend(range(first, first + count))
    if not distinct:
        return None
    kept = [row for _, row in distinct.values()]
    shared = len(index) != images
    return Images(pixel_values=torch.cat([r["pixel_values"] for r in kept]),
                  image_grid_thw=torch.cat([r["image_grid_thw"] for r in kept]),
                  index=torch.tensor(index) if shared else None)  # fmt: skip


@contextlib.contextmanager
def feeding(model: Any, images: Images | None) -> Iterator[dict[str, Tensor]]:
    """The forward keywords of `images` (none without), for a forward of `model` run inside the block: the
    vision tower encodes each distinct image once and each placeholder run gets its image's features."""
    if images is None:
        yield {}
        return
    target = None if images.index is None else _encoder(model)
    if target is not None:
        target.get_image_features = functools.partial(_expanded, target, images.index.tolist())
    try:
        yield {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw}
    finally:
        if target is not None:
            del target.get_image_features


def _encoder(model: Any) -> Any:
    """The module whose `get_image_features` the forward calls (the family's `...VLModel`, holding `visual`)."""
    return next(
        m for m in model.modules() if "visual" in m._modules and hasattr(type(m), "get_image_features")
    )


def _expanded(
    target: Any, index: list[int], pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any
) -> Any:
    """The family's `get_image_features` over the distinct images, its per-image outputs (and Qwen3-VL's
    per-layer deepstack features) listed once per placeholder run."""
    out = type(target).get_image_features(target, pixel_values, image_grid_thw, **kwargs)
    out.pooler_output = tuple(out.pooler_output[i] for i in index)
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:
        out.deepstack_features = [tuple(layer[i] for i in index) for layer in deepstack]
    return out
