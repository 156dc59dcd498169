"""Tinker's datums as rlcore model inputs, and their log-probs.

A datum's model input x (N tokens) and targets y (N) say: position i of x predicts y[i]. Two layouts:

- rows: the row layout of `rlcore.models.forward` predicts its r labels from the last r + 1 positions of a
  row (the last position predicts nothing), so a datum becomes the row x + [y[-1]] with labels y,
  left-padded like prompts (the appended token only fills the unused last position: attention is causal).
- prompt-packed: where targets are the input shifted (x[1:] == y[:-1], the usual case) the datum is the
  sequence z = x + [y[-1]], and consecutive datums that start alike (GRPO's samples of one prompt) share
  their longest common prefix as a prompt. rlcore's shared-prompt packing (`rlcore.models.shared_prompt`,
  chosen by its cost model in `model_inputs`) then computes each prompt once for its samples; the
  prompt's own positions, which rlcore's packing does not gather, are gathered here from the prompt copy
  in the datum's block (its last token predicts the response's first). Log-probs and gradients are those of
  the rows, to rounding.

Both give each datum's N log-probs right-aligned in (m, n), n the longest datum, with a mask of its columns.
A prompt's own log-probs (`prompt_row`) use the row layout with x = prompt[:-1] + [prompt[-1]], labels prompt[1:].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, right_pad
from rlcore.models.exact import kernel_mode
from rlcore.models.forward import ModelInputs, model_inputs, response_logprobs

MIN_SHARED = 2
"""Fewest tokens of common prefix that make consecutive datums one group (a shared prompt)."""


def row_inputs(rows: Sequence[tuple[Tensor, Tensor]], pad_id: int, device: torch.device) -> tuple[ModelInputs, Tensor]:
    """(the model inputs of `rows`, each (input ids (N + 1,), labels (N,)); the (m, n) mask: 1 where a row
    has a label), every row right-aligned to the longest."""
    input_ids, attention_mask, position_ids = left_pad([x.tolist() for x, _ in rows], pad_id)  # (m, n + 1)
    labels, mask, _ = left_pad([y.tolist() for _, y in rows], pad_id)  # (m, n)
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


def sequence_of(tokens: Tensor, targets: Tensor) -> Tensor | None:
    """The datum's whole sequence z (N + 1,) where its targets are its input shifted, else None."""
    if len(tokens) == 0 or not torch.equal(tokens[1:], targets[:-1].to(tokens.dtype)):
        return None
    return torch.cat([tokens, targets[-1:].to(tokens.dtype)])


def shared_prefixes(seqs: Sequence[Tensor]) -> list[int]:
    """Each sequence's prompt length: consecutive sequences with at least MIN_SHARED tokens in common form
    a group whose prompt is their longest common prefix (leaving each at least one response token); a
    sequence in no group keeps its first token as its prompt."""
    out, i = [1] * len(seqs), 0
    while i < len(seqs):
        j, k = i + 1, len(seqs[i]) - 1
        while j < len(seqs):
            common = min(_common(seqs[i], seqs[j]), len(seqs[j]) - 1, k)
            if common < MIN_SHARED:
                break
            k, j = common, j + 1
        if j - i > 1:
            out[i:j] = [k] * (j - i)
        i = j
    return out


def _common(a: Tensor, b: Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def packed_inputs(model: nn.Module, seqs: Sequence[Tensor], pad_id: int, device: torch.device) -> tuple[ModelInputs, Tensor] | None:
    """The prompt-packed inputs of these sequences (module docstring) and the (m, n) mask, or None where rlcore's
    cost model keeps rows (or the kernel mode aligns prompts, which this gather does not follow)."""
    if kernel_mode(model).align != 1 or len(seqs) < 2:
        return None
    split = shared_prefixes(seqs)
    prompts = [s[:k].tolist() for s, k in zip(seqs, split, strict=True)]
    responses = [s[k:].tolist() for s, k in zip(seqs, split, strict=True)]
    ids, attn, pos = left_pad(prompts, pad_id)
    width = max(len(r) for r in responses)
    used = right_pad([[1.0] * len(r) for r in responses], 0.0, torch.float32, width)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": pos, "response_mask": used,
                             "responses": right_pad(responses, pad_id, torch.long, width), "response_attention": used})  # fmt: skip
    inputs = model_inputs(model, batch.to(device), share_prompts=True)
    if not inputs.packed:
        return None
    n = max(len(s) for s in seqs) - 1
    gather = torch.zeros(len(seqs), n, dtype=torch.long)
    labels = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n)
    for i, (s, k) in enumerate(zip(seqs, split, strict=True)):
        last = int(inputs.gather[i, 0])  # the block's last prompt token: predicts the first response token
        mine = torch.cat([torch.arange(last - (k - 1), last), inputs.gather[i, : len(s) - k].cpu()])
        gather[i, n - len(mine) :], labels[i, n - len(mine) :], mask[i, n - len(mine) :] = mine, s[1:], 1.0
    inputs = dataclasses.replace(inputs, gather=gather.to(device), labels=labels.to(device))
    return inputs, mask.to(device)


def row_logprobs(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """(m, r) float32 log-probs of the labels under `model` (with grad where enabled)."""
    return response_logprobs(model, inputs)[0].float()


def right_aligned(values: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """Each row's last `lengths[i]` values (the rows were left-padded)."""
    width = values.shape[1]
    return [values[i, width - n :] for i, n in enumerate(lengths)]
