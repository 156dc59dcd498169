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
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.data.rows import DataError, Prompt, Row

Overlong = Literal["drop", "error"]


def render_prompt(tokenizer: Any, prompt: Prompt, tools: Sequence[dict] = ()) -> tuple[str, bool]:
    """The prompt text and whether the tokenizer should add its special tokens when encoding it; `tools`
    (JSON schemas, `--rollout.tools`) go to the chat template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(
            messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=False
        ), False
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return text, True


def encode_prompt(tokenizer: Any, row: Row, tools: Sequence[dict] = ()) -> list[int]:
    """Token ids of a row's rendered prompt (none for the empty prompt of an environment's row); a template
    failure is a `DataError` naming the row."""
    if row.prompt == "":
        return []
    try:
        text, special = render_prompt(tokenizer, row.prompt, tools)
    except Exception as e:  # jinja errors (unknown role, raise_exception) and the like
        raise DataError(f"{row.origin}: chat template failed on field 'prompt': {e}") from None
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


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
) -> tuple[list[Row], list[list[int]], list[int]]:
    """`encode_rows`, with the token lengths of the dropped prompts instead of their count; `tools` as
    for `render_prompt`."""
    if overlong not in ("drop", "error"):
        raise ValueError(f"overlong={overlong!r}: expected 'drop' or 'error'")
    kept, ids, dropped = [], [], []
    for row in rows:
        tokens = encode_prompt(tokenizer, row, tools)
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


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked out, so only the mask matters)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has neither a pad nor an eos token to pad with"
        )
    return pad


def prompt_batch(
    rows: Sequence[Row], token_ids: Sequence[Sequence[int]], *, pad_id: int, uids: Sequence[str]
) -> Batch:
    """A prompt Batch from rows and their token ids (see the module docstring for the tensors)."""
    if not len(rows) == len(token_ids) == len(uids):
        raise ValueError(f"prompt_batch: {len(rows)} rows, {len(token_ids)} token lists, {len(uids)} uids")
    if len(set(uids)) != len(uids):
        raise ValueError("prompt_batch: uids must be unique within a batch")
    input_ids, attention_mask, position_ids = left_pad(token_ids, pad_id)
    return Batch.from_dict(
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


def make_prompt_batch(
    rows: Sequence[Row], tokenizer: Any, *, uids: Sequence[str] | None = None, tools: Sequence[dict] = ()
) -> Batch:
    """Encode and left-pad `rows` into a prompt Batch; `uids` default to fresh random hex strings; `tools`
    (JSON schemas) go to the chat template."""
    _, token_ids, _ = encode_rows_keeping_lengths(rows, tokenizer, tools=tools)
    uids = list(uids) if uids is not None else [uuid.uuid4().hex for _ in rows]
    return prompt_batch(rows, token_ids, pad_id=pad_token_id(tokenizer), uids=uids)
