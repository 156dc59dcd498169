"""Which batch fields a model's forwards read: the sequences, a vision-language family's images and M-RoPE
positions, and a mixture of experts' recorded routes.

    fields = model_fields(model, batch)      # what compute_logprobs and the update select
    takes_images(model)                      # the family record's answer, never the batch's keys

Whether a forward takes images is decided by the model's family record (`rlcore.models.families`), so a
vision-language batch that lost its images or positions is one clear error rather than a text forward. The
recorded routes are an optional group of columns: the rollout records them when the run replays or
compares routes (`--algo.router-replay`), and their presence is the record of that choice.
"""

from __future__ import annotations

from torch import nn

from rlcore.batch import Batch
from rlcore.models.families import family_of

SEQUENCE_FIELDS = ("input_ids", "attention_mask", "responses", "response_attention", "response_mask")
"""The batch fields the model passes read."""

VISION_FIELD = "multi_modal_inputs"
"""A vision-language batch's per-row images as model inputs (`rlcore.data.prompts`)."""

ROPE_FIELD = "rope_positions"
"""A vision-language batch's prompt M-RoPE positions (b, 3, p) (`rlcore.data.vision`)."""

RESPONSE_ROPE_FIELD = "response_rope_positions"
"""The response's M-RoPE positions (b, 3, t), where observations brought images into it (the agent loop,
`rlcore.rollout.agent.images`); without it the response continues as text."""

ROUTE_FIELDS = ("prompt_routes", "response_routes")
"""A mixture of experts' recorded routes (b, p, L, k) and (b, t, L, k), int16, -1 where none was
recorded (`rlcore.models.moe`): the model passes replay them when the batch carries them."""


def takes_images(model: nn.Module) -> bool:
    """Whether `model` is a vision-language family's (its record's `vision`, `rlcore.models.families`). Its
    batches carry `rope_positions` and `multi_modal_inputs` on every row, with images or not; a text
    family's forwards never read them. Decided by the record, never by the fields a batch happens to hold,
    so a vision-language batch that lost its images is an error, not a text forward."""
    return family_of(model).vision is not None


def model_fields(model: nn.Module, batch: Batch) -> tuple[str, ...]:
    """The fields a forward of `model` reads from `batch`: `SEQUENCE_FIELDS`; a vision-language model's images
    and M-RoPE positions (`takes_images`: required; the response's own positions only where the agent loop's
    observations brought images); and the recorded routes where the rollout recorded them
    (`--algo.router-replay`): an optional group of columns whose presence is the record of that choice."""
    fields = [*SEQUENCE_FIELDS, *(ROUTE_FIELDS if ROUTE_FIELDS[0] in batch else ())]
    if takes_images(model):
        require_vision(batch, model)
        fields += [ROPE_FIELD, VISION_FIELD, *([RESPONSE_ROPE_FIELD] if RESPONSE_ROPE_FIELD in batch else [])]
    return tuple(fields)


def require_vision(batch: Batch, model: nn.Module) -> None:
    """Raise, naming the fix, where a vision-language model's `batch` lacks its images or M-RoPE positions."""
    missing = [k for k in (ROPE_FIELD, VISION_FIELD) if k not in batch]
    if missing:
        raise ValueError(f"a {family_of(model).name} batch has no {' or '.join(missing)}: build its prompts with the model's "
                         "processor (rlcore.data.prompts.make_prompt_batch(..., vision=...))")  # fmt: skip
