"""Images in the agent loop (`rlcore.rollout.agent.loop`) of a vision-language policy.

A sample's images are the vision inputs of its placeholder runs in order: the prompt row's
(`multi_modal_inputs`, shared with the other samples of the prompt) and then each observation's that
carried image parts. Every turn's context carries them with the context's M-RoPE positions (computed over
the context's tokens: an observation's image gets 2-D positions in the response as a prompt's does), so
the engine prefills exactly what a teacher-forced pass sees. The assembled batch holds per row the
images of its whole conversation and `response_rope_positions` (b, 3, t), the response's positions (text
continuing, and the observations' images), which the trainer's forwards use (`rlcore.models.forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlcore.data.images import decode_image
from rlcore.data.prompts import left_pad
from rlcore.data.rows import DataError
from rlcore.data.vision import VisionProcessor, padded_rope_positions, rope_positions
from rlcore.rollout.agent.env import EnvOutputError, Message

Inputs = dict[str, Tensor]
"""One group of images' vision inputs: `pixel_values` (patches, d), `image_grid_thw` (images, 3)."""


def message_images(messages: Sequence[Message]) -> list[Any]:
    """The image payloads of `messages`' image parts, in order."""
    return [part["image"] for m in messages if not isinstance(m["content"], str) for part in m["content"]
            if part.get("type") == "image"]  # fmt: skip


def template_messages(messages: Sequence[Message]) -> list[Message]:
    """`messages` as a chat template takes them: image parts without their payload."""
    return [m if isinstance(m["content"], str) else
            {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            for m in messages]  # fmt: skip


def observation_inputs(vision: VisionProcessor | None, messages: Sequence[Message]) -> Inputs | None:
    """The vision inputs of an observation's image parts (None without any); an EnvOutputError when an
    image cannot be decoded or the policy reads no images."""
    images = message_images(messages)
    if not images:
        return None
    if vision is None:
        raise EnvOutputError("an observation carries an image, but the policy is not a vision-language model")
    try:
        return vision.pixels([decode_image(spec, "observation", i) for i, spec in enumerate(images)])
    except DataError as e:
        raise EnvOutputError(str(e)) from None


def expanded(vision: VisionProcessor, text: str, inputs: Sequence[Inputs]) -> str:
    """`text` with its placeholders expanded for the images of `inputs`, in order."""
    grids = (
        torch.cat([x["image_grid_thw"] for x in inputs]) if inputs else torch.zeros(0, 3, dtype=torch.long)
    )
    return vision.expand(text, grids)


def merged(inputs: Sequence[Inputs]) -> Inputs:
    """One dict of a sample's image groups (the prompt's alone is kept as is: shared by its samples)."""
    inputs = [x for x in inputs if x]
    if len(inputs) == 1:
        return inputs[0]
    if not inputs:
        return {}
    return {key: torch.cat([x[key] for x in inputs]) for key in ("pixel_values", "image_grid_thw")}


def context_fields(
    vision: VisionProcessor, contexts: list[list[int]], inputs: list[list[Inputs]], pad: int
) -> dict:
    """The vision fields of a turn's context batch: each context's images and M-RoPE positions."""
    ids, mask, _ = left_pad(contexts, pad)
    grids = [_grids(x) for x in inputs]
    rope = padded_rope_positions(ids, mask, grids, image_token_id=vision.image_token_id, merge=vision.merge)
    return {"rope_positions": rope, "multi_modal_inputs": [merged(x) for x in inputs]}


def assembled_fields(vision: VisionProcessor, prompts: list[list[int]], responses: list[list[int]],
                     inputs: list[list[Inputs]], t: int) -> dict:  # fmt: skip
    """The rolled-out batch's vision fields: `rope_positions` (b, 3, p) of the left-padded prompts,
    `response_rope_positions` (b, 3, t) of the right-padded responses, each row's images."""
    p = max((len(x) for x in prompts), default=0)
    prompt_rope = torch.zeros(len(prompts), 3, p, dtype=torch.long)
    response_rope = torch.zeros(len(prompts), 3, t, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        whole = rope_positions(torch.tensor(prompt + response, dtype=torch.long), _grids(inputs[i]),
                               image_token_id=vision.image_token_id, merge=vision.merge)  # fmt: skip
        prompt_rope[i, :, p - len(prompt) :] = whole[:, : len(prompt)]
        response_rope[i, :, : len(response)] = whole[:, len(prompt) :]
    return {"rope_positions": prompt_rope, "response_rope_positions": response_rope,
            "multi_modal_inputs": [merged(x) for x in inputs]}  # fmt: skip


def _grids(inputs: Sequence[Inputs]) -> Tensor:
    groups = [x["image_grid_thw"] for x in inputs if x]
    return torch.cat(groups) if groups else torch.zeros(0, 3, dtype=torch.long)
