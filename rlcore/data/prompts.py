"""Rendering rows into token ids and left-padded prompt Batches.

Rendering follows verl's `RLHFDataset`: with a chat template, the messages go through
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` and the text
is encoded without adding special tokens (the template writes its own); a string prompt is sent
as one user message. Without a chat template the raw text (the string, or the messages' contents
joined by newlines) is encoded with the tokenizer's own special tokens (a base model's BOS).

Prompts are left-padded so every response starts at the same column:

    input_ids       [pad, pad, t0, t1, t2]
    attention_mask  [0,   0,   1,  1,  1 ]
    position_ids    [0,   0,   0,  1,  2 ]     (verl: clip(cumsum(mask) - 1, min=0))

With a vision-language model (a `VisionProcessor`, rlcore.models.vision), a row's images are decoded,
its `<image>` placeholders become image parts for the chat template, each image's placeholder token is
repeated once per merged patch, and the batch carries per row `multi_modal_inputs` (a dict of
`pixel_values` (patches, d) and `image_grid_thw` (images, 3); empty for a row without images; the
samples of a prompt share its tensors) and `rope_positions` (b, 3, p), the M-RoPE positions, 0 on
padding. The pixels are computed again when a batch is made (the dataset keeps token ids only).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.data.images import decode_image, with_image_parts
from rlcore.data.rows import DataError, Prompt, Row
from rlcore.data.vision import VisionProcessor, padded_rope_positions

Overlong = Literal["drop", "error"]


def render_prompt(
    tokenizer: Any, prompt: Prompt, tools: Sequence[dict] = (), *, images: bool = False
) -> tuple[str, bool]:
    """The prompt text and whether the tokenizer should add its special tokens when encoding it; `tools`
    (JSON schemas, `--rollout.tools`) go to the chat template; `images`: the `<image>` placeholders
    become image parts (`rlcore.data.images.with_image_parts`)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if images:
            messages = with_image_parts(messages)
        return tokenizer.apply_chat_template(
            messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=False
        ), False
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return text, True


def encode_prompt(
    tokenizer: Any, row: Row, tools: Sequence[dict] = (), vision: VisionProcessor | None = None
) -> list[int]:
    """Token ids of a row's rendered prompt (none for the empty prompt of an environment's row), its
    images' placeholders expanded by `vision`; a template failure or an unreadable image is a
    `DataError` naming the row."""
    if row.prompt == "":
        return []
    if row.images and vision is None:
        raise DataError(f"{row.origin}: field 'images': the model is not a vision-language model; give "
                        "--model.path a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (or builtin:tiny-vl)")  # fmt: skip
    try:
        text, special = render_prompt(tokenizer, row.prompt, tools, images=bool(row.images))
    except Exception as e:  # jinja errors (unknown role, raise_exception) and the like
        raise DataError(f"{row.origin}: chat template failed on field 'prompt': {e}") from None
    if row.images:
        grids = vision.pixels(row_images(row))["image_grid_thw"]
        try:
            text = vision.expand(text, grids)
        except ValueError as e:
            raise DataError(f"{row.origin}: the chat template rendered {e}") from None
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def row_images(row: Row) -> list[Any]:
    """The row's images decoded (PIL RGB), a `DataError` naming the row and image when one cannot be."""
    return [decode_image(spec, row.origin, i) for i, spec in enumerate(row.images)]


def encode_rows(
    rows: Sequence[Row], tokenizer: Any, *, max_prompt_length: int | None = None, overlong: Overlong = "error"
) -> tuple[list[Row], list[list[int]], int]:
    """(kept rows, their token ids, number dropped) after applying `max_prompt_length` per `overlong`."""
    kept, ids, dropped = encode_rows_keeping_lengths(
        rows, tokenizer, max_prompt_length=max_prompt_length, overlong=overlong
    )
    return kept, ids, len(dropped)


def encode_rows_keeping_lengths(
    rows: Sequence[Row],
    tokenizer: Any,
    *,
    max_prompt_length: int | None = None,
    overlong: Overlong = "error",
    tools: Sequence[dict] = (),
    vision: VisionProcessor | None = None,
    bad: list[str] | None = None,
) -> tuple[list[Row], list[list[int]], list[int]]:
    """`encode_rows`, with the token lengths of the dropped prompts instead of their count; `tools` and
    `vision` as for `encode_prompt`. With overlong="drop", a row whose images cannot be read is dropped
    too, its error appended to `bad` (else it raises)."""
    if overlong not in ("drop", "error"):
        raise ValueError(f"overlong={overlong!r}: expected 'drop' or 'error'")
    kept, ids, dropped = [], [], []
    for row in rows:
        try:
            tokens = encode_prompt(tokenizer, row, tools, vision)
        except DataError as e:
            if overlong == "error" or bad is None or not row.images or vision is None:  # (a text model: refused)
                raise
            bad.append(str(e))
            continue
        if max_prompt_length is not None and len(tokens) > max_prompt_length:
            if overlong == "error":
                raise DataError(
                    f"{row.origin}: field 'prompt' is {len(tokens)} tokens, longer than max_prompt_length="
                    f"{max_prompt_length} (overlong='drop' drops such rows)"
                )
            dropped.append(len(tokens))
            continue
        kept.append(row)
        ids.append(tokens)
    return kept, ids, dropped


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, position_ids), each (b, p) int64, left-padded to the longest sequence."""
    width = max((len(s) for s in sequences), default=0)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (b, p)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (b, p)
    for i, seq in enumerate(sequences):
        if len(seq):
            input_ids[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            attention_mask[i, width - len(seq) :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (b, p)
    return input_ids, attention_mask, position_ids


def right_pad(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, width: int) -> Tensor:
    """(b, width) `dtype`: each row's values from column 0, `value` after them (responses' padding)."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked out, so only the mask matters)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has neither a pad nor an eos token to pad with"
        )
    return pad


def prompt_batch(
    rows: Sequence[Row],
    token_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    uids: Sequence[str],
    vision: VisionProcessor | None = None,
) -> Batch:
    """A prompt Batch from rows and their token ids (see the module docstring for the tensors); with
    `vision`, their vision inputs and rotary positions too."""
    if not len(rows) == len(token_ids) == len(uids):
        raise ValueError(f"prompt_batch: {len(rows)} rows, {len(token_ids)} token lists, {len(uids)} uids")
    if len(set(uids)) != len(uids):
        raise ValueError("prompt_batch: uids must be unique within a batch")
    input_ids, attention_mask, position_ids = left_pad(token_ids, pad_id)
    batch = Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "uid": list(uids),
            "data_source": [r.data_source for r in rows],
            "ground_truth": [r.ground_truth for r in rows],
            "extra_info": [r.extra_info for r in rows],
            "raw_prompt": [r.prompt for r in rows],
        }
    )
    return batch if vision is None else with_vision(batch, rows, vision)


def with_vision(batch: Batch, rows: Sequence[Row], vision: VisionProcessor) -> Batch:
    """`batch` with its rows' `multi_modal_inputs` and `rope_positions` (see the module docstring)."""
    inputs = [vision.pixels(row_images(r)) if r.images else {} for r in rows]
    grids = [x.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)) for x in inputs]
    rope = padded_rope_positions(batch["input_ids"], batch["attention_mask"], grids,
                                 image_token_id=vision.image_token_id, merge=vision.merge)  # fmt: skip
    return batch.with_(multi_modal_inputs=inputs, rope_positions=rope)


def make_prompt_batch(
    rows: Sequence[Row],
    tokenizer: Any,
    *,
    uids: Sequence[str] | None = None,
    tools: Sequence[dict] = (),
    vision: VisionProcessor | None = None,
) -> Batch:
    """Encode and left-pad `rows` into a prompt Batch; `uids` default to fresh random hex strings; `tools`
    (JSON schemas) go to the chat template; `vision` (a vision-language model) adds the vision inputs."""
    _, token_ids, _ = encode_rows_keeping_lengths(rows, tokenizer, tools=tools, vision=vision)
    uids = list(uids) if uids is not None else [uuid.uuid4().hex for _ in rows]
    return prompt_batch(rows, token_ids, pad_id=pad_token_id(tokenizer), uids=uids, vision=vision)
