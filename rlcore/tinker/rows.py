"""Tinker's datums as rlcore model inputs, and their log-probs.

A datum's model input x (N tokens) and targets y (N) say: position i of x predicts y[i]. The row layout of
`rlcore.models.forward` predicts its r labels from the last r + 1 positions of a row (the last position
predicts nothing), so a datum becomes the row x + [y[-1]] with labels y, left-padded like prompts: the
appended token only fills the unused last position (attention is causal: no earlier logit sees it). A
prompt's own log-probs are the same with x = prompt[:-1] + [prompt[-1]], labels prompt[1:].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlcore.data.prompts import left_pad
from rlcore.models.forward import ModelInputs, response_logprobs


def row_inputs(rows: Sequence[tuple[Tensor, Tensor]], pad_id: int, device: torch.device) -> tuple[ModelInputs, Tensor]:
    """(the model inputs of `rows`, each (input ids (N + 1,), labels (N,)); the (m, r) mask: 1 where a row
    has a label), every row right-aligned to the longest."""
    input_ids, attention_mask, position_ids = left_pad([x.tolist() for x, _ in rows], pad_id)  # (m, r + 1)
    labels, mask, _ = left_pad([y.tolist() for _, y in rows], pad_id)  # (m, r)
    inputs = ModelInputs(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         position_ids=position_ids.to(device), labels=labels.to(device))  # fmt: skip
    return inputs, mask.to(device, torch.float32)


def datum_rows(tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """A datum (model input (N,), targets (N,)) as a row (N + 1,) and its labels (N,)."""
    return torch.cat([tokens, targets[-1:]]), targets


def prompt_row(prompt: Sequence[int]) -> tuple[Tensor, Tensor]:
    """A prompt of P tokens as a row (P,) whose labels (P - 1,) are its tokens after the first."""
    ids = torch.as_tensor(list(prompt), dtype=torch.long)
    return ids, ids[1:]


def row_logprobs(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """(m, r) float32 log-probs of the labels under `model` (with grad where enabled)."""
    return response_logprobs(model, inputs)[0].float()


def right_aligned(values: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """Each row's last `lengths[i]` values (the rows were left-padded)."""
    width = values.shape[1]
    return [values[i, width - n :] for i, n in enumerate(lengths)]
