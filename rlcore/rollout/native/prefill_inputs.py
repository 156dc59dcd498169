"""What the native engine's prefills are fed (`rlcore.rollout.native.engine`): positions, a vision-language
batch's images and M-RoPE positions, the context of a restart, and the forward's argument names.

    pos = positions(prompts, device)                                   # (b, p)
    images, rope, after = vision_prefill(prompts, pos, device)         # a vision-language batch
    context = restart_context(prompts, rows, sampled, device, vision)  # prompts + the tokens so far
    cache_kw, keep_kw = forward_keywords(model)

Positions are the batch's `position_ids`, or verl's clip(cumsum(attention_mask) - 1, 0) when it has none,
so a sample sees exactly the positions a teacher-forced pass over prompt + response sees. A restart
(weights loaded between decode steps) prefills each row's prompt followed by the tokens it has sampled,
at the positions those tokens had; a vision-language row keeps its images and continues as text from its
largest prompt position + 1. The forward's cache argument is `past_key_values` up to transformers 5.19
and `cache` from 5.20, read once from its signature.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.models.forward import ROPE_FIELD, VISION_FIELD, vision_inputs
from rlcore.models.vision import Images


def forward_keywords(model: torch.nn.Module) -> tuple[str, str | None]:
    """(the cache argument's name, the logits-to-keep argument's name or None) of `model.forward`."""
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    return cache_kw, keep_kw


def positions(rows: Batch, device: torch.device) -> Tensor:
    """The rows' `position_ids`, or verl's clip(cumsum(attention_mask) - 1, 0) when absent. (b, p)"""
    if "position_ids" in rows:
        return rows["position_ids"].to(device)
    return (rows["attention_mask"].to(device).long().cumsum(dim=-1) - 1).clamp(min=0)


def vision_prefill(prompts: Batch, pos: Tensor, device: torch.device) -> tuple[Images | None, Tensor, Tensor]:
    """(the prefill's images, its position ids, each row's next position (b, 1)): a vision-language batch's
    images (None where no row has one) and (3, b, p) M-RoPE positions (`rlcore.data.vision`)."""
    rope = prompts[ROPE_FIELD].to(device)  # (b, 3, p)
    images = vision_inputs(prompts)
    return (
        None if images is None else images.to(device),
        rope.transpose(0, 1),
        rope.amax(dim=(1, 2))[:, None] + 1,
    )


def restart_context(
    prompts: Batch, rows: Tensor, sampled: Tensor, device: torch.device, vision: bool
) -> Batch:
    """The prompts `rows` (a,) followed by the tokens each has sampled so far, `sampled` (a, k), as one
    prompt batch at the positions those tokens had; with `vision`, each row's images and M-RoPE positions,
    the tokens so far as text."""
    ids = prompts["input_ids"][rows].to(device)
    mask = prompts["attention_mask"][rows].to(device)
    pos = positions(prompts, device)[rows.to(device)]  # (a, p)
    k = sampled.shape[1]
    after = pos[:, -1:] + torch.arange(1, k + 1, device=device)  # (a, k)
    context = Batch.from_dict({
        "input_ids": torch.cat([ids, sampled], dim=1),
        "attention_mask": torch.cat([mask, torch.ones_like(sampled, dtype=mask.dtype)], dim=1),
        "position_ids": torch.cat([pos, after], dim=1),
    })  # fmt: skip
    if vision:  # a vision-language prompt: its images, and the tokens so far as text
        rope = prompts[ROPE_FIELD][rows].to(device)  # (a, 3, p)
        text = rope.amax(dim=(1, 2))[:, None] + torch.arange(1, k + 1, device=device)  # (a, k)
        context = context.with_(
            rope_positions=torch.cat([rope, text[:, None, :].expand(-1, 3, -1)], dim=2),
            multi_modal_inputs=[prompts[VISION_FIELD][i] for i in rows.tolist()],
        )
    return context
