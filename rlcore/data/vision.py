"""A vision-language model's prompts: its images as pixels and placeholder tokens, and their rotary positions.

    ids = tokenizer(vp.expand(text, vp.pixels(images)["image_grid_thw"]))["input_ids"]
    rope = rope_positions(torch.tensor(ids), grids, image_token_id=vp.image_token_id, merge=vp.merge)

A row's images become one `<|image_pad|>` run each in the rendered prompt, as many tokens as the image
has merged patches (`grid_t * grid_h * grid_w / merge**2`), and the vision inputs the model's
`forward` takes: `pixel_values` (patches, channels * temporal_patch * patch**2) and `image_grid_thw`
(images, 3). rlcore calls the model's image processor itself (its PIL backend) instead of the
Hugging Face `Processor`, whose video half needs torchvision. `rlcore.models.vision` builds the
`VisionProcessor` of a model.

Multimodal rotary positions (Qwen2-VL's M-RoPE, kept by Qwen2.5-VL and Qwen3-VL for images): every token
has a (temporal, height, width) position. A text token's three are equal and count on from the token
before; an image's tokens sit at `start + (0, row, column)` of its merged grid, and the text after it
starts at `start + max(rows, columns)`. `rope_positions` builds them once per prompt, as verl's dataset
does (tested equal to each family's `get_rope_index`); the response continues as text, so a response
token's position is its text position plus the row's delta `max(prompt positions) + 1 - prompt tokens`
on all three axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionProcessor:
    """What turns a row's images into model inputs and placeholder tokens (see the module docstring)."""

    image_processor: Any
    """The model's image processor (PIL backend): images -> pixel_values, image_grid_thw."""
    image_token: str
    """The placeholder token each merged patch of an image becomes (`<|image_pad|>`)."""
    image_token_id: int
    """Its id."""
    merge: int
    """Patches merged per side into one language-model token (`spatial_merge_size`)."""

    def pixels(self, images: list[Any]) -> dict[str, Tensor]:
        """`pixel_values` (patches, d) float32 and `image_grid_thw` (images, 3) long of PIL `images`."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def expand(self, text: str, grids: Tensor) -> str:
        """`text` with its i-th image placeholder repeated as many times as image i has merged patches."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != grids.shape[0]:
            raise ValueError(f"{len(pieces) - 1} image placeholders for {grids.shape[0]} images")
        counts = (grids.prod(dim=-1) // self.merge**2).tolist()
        return pieces[0] + "".join(
            self.image_token * c + piece for c, piece in zip(counts, pieces[1:], strict=True)
        )


def rope_positions(ids: Tensor, grids: Tensor, *, image_token_id: int, merge: int) -> Tensor:
    """(3, s) long M-RoPE positions of one prompt's real tokens `ids` (s,) whose image runs have the
    grids `grids` (images, 3), in order (see the module docstring)."""
    out = torch.empty(3, ids.shape[0], dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    col, nxt, image = 0, 0, 0
    while col < len(is_image):
        if not is_image[col]:
            out[:, col] = nxt
            col, nxt = col + 1, nxt + 1
            continue
        t, h, w = (int(x) for x in grids[image])
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        block = grid.reshape(3, -1) * torch.tensor([0, 1, 1])[:, None] + nxt  # (3, t*h*w): images' t is 0
        out[:, col : col + block.shape[1]] = block
        col, nxt, image = col + block.shape[1], nxt + max(h, w), image + 1
    return out


def padded_rope_positions(input_ids: Tensor, attention_mask: Tensor, grids: list[Tensor], *,
                          image_token_id: int, merge: int) -> Tensor:  # fmt: skip
    """(b, 3, p) long: `rope_positions` of each left-padded row (its grids `grids[i]`), 0 on padding."""
    out = torch.zeros(input_ids.shape[0], 3, input_ids.shape[1], dtype=torch.long)
    for i, (row, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
        real = mask.bool()
        out[i][:, real] = rope_positions(row[real], grids[i], image_token_id=image_token_id, merge=merge)
    return out


def response_rope_positions(prompt_rope: Tensor, prompt_mask: Tensor, text_positions: Tensor) -> Tensor:
    """(b, 3, t): the rotary positions of response columns whose text positions (cumsum of the attention
    - 1 over prompt and response) are `text_positions` (b, t): the text position plus the row's delta
    `max(prompt positions) + 1 - prompt tokens`, on all three axes."""
    tokens = prompt_mask.long().sum(dim=-1)  # (b,)
    delta = torch.where(tokens > 0, prompt_rope.amax(dim=(1, 2)) + 1 - tokens, 0)  # (b,)
    return (text_positions + delta[:, None])[:, None, :].expand(-1, 3, -1)
