"""Shared-prompt packing: each prompt is computed once for all of its samples in a training forward.

GRPO-style batches hold n samples of every prompt. A plain forward computes the prompt n times; a
packed forward lays out one sequence per distinct prompt,

    [pad.. prompt | response 1 | response 2 | ... | response n | pad..]

with a 4D attention mask in which the prompt is causal, each response sees the prompt and its own
earlier tokens only, and position ids restart after the prompt for every response. Each response
token then sees exactly what it sees in its own row, so its log-prob is the same function of the
weights (the gradient too: the prompt's share is summed over the n samples by autograd instead of
being computed n times). Rows sharing a prompt are found by comparing prompt tokens, so any batch
works; a micro-batch in which no prompt repeats stays unpacked.

A packed row is longer than any single row, and attention kernels with a dense mask compute every
(query, key) pair, so packing costs more attention and less of everything else. `worth_packing`
compares the two with a FLOP model (per token ~24 h^2 in the layers' matmuls, per query-key pair
~4 h; h = hidden size): short responses after a long shared prompt pack, long responses stay rows.
"""

from __future__ import annotations

import torch
from torch import Tensor


def prompt_groups(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(m,) group index per row: rows whose real prompt tokens are equal share an index (0..G-1)."""
    key = torch.cat([input_ids * attention_mask, attention_mask], dim=1)  # (m, 2p)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    return inverse


def _group_offsets(group: Tensor, lengths: Tensor, count: int) -> Tensor:
    """(m,) where each row's response starts inside its group's packed responses (rows in order)."""
    order = torch.argsort(group, stable=True)
    sorted_len = lengths[order]
    before = torch.cumsum(sorted_len, dim=0) - sorted_len  # exclusive prefix sum in group order
    sizes = torch.bincount(group, minlength=count)
    first = torch.cumsum(sizes, dim=0) - sizes  # (G,) first sorted position of each group
    offsets = torch.empty_like(lengths)
    offsets[order] = before - before[first][group[order]]
    return offsets


def packed_shape(group: Tensor, response_attention: Tensor, prompt_width: int) -> tuple[int, int]:
    """(groups G, packed width L) of `pack_rows` for these rows."""
    count = int(group.max().item()) + 1
    lengths = response_attention.long().sum(dim=1)
    totals = torch.zeros(count, dtype=torch.long, device=group.device).index_add_(0, group, lengths)
    return count, prompt_width + int(totals.max().item())


def pack_rows(
    input_ids: Tensor,
    prompt_attention: Tensor,
    responses: Tensor,
    response_attention: Tensor,
    group: Tensor,
    shape: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pack trimmed rows into one sequence per group.

    Arguments: left-padded prompts (m, p) with their attention, right-padded responses (m, r) with
    theirs, `group` (m,) from `prompt_groups`, `shape` = `packed_shape(group, response_attention, p)`
    (the caller has it already: it decides whether to pack). Returns (input_ids (G, L), attention (G, 1, L, L) bool,
    position_ids (G, L), gather (m, r)): `gather` indexes the flattened logits of the packed columns
    p - 1 .. L - 1 (`logits_to_keep = L - p + 1`): entry (i, c) is the position that predicts row i's
    response token c (the last prompt token for the first one). Non-attended response columns point
    at the last prompt token; their values mean nothing (the caller masks them).
    """
    m, p = input_ids.shape
    r = responses.shape[1]
    count, width = shape
    rows = torch.arange(m, device=group.device)
    rep = torch.full((count,), m, dtype=torch.long, device=group.device).scatter_reduce(
        0, group, rows, "amin"
    )
    attn_r = response_attention.long()
    offsets = _group_offsets(group, attn_r.sum(dim=1), count)  # (m,)
    k = torch.cumsum(attn_r, dim=1) - 1  # (m, r) index of each attended token within its row
    used = attn_r != 0
    cols = p + offsets[:, None] + k  # (m, r) packed column of each attended response token
    g_of = group[:, None].expand(m, r)

    ids = input_ids.new_zeros(count, width)
    ids[:, :p] = input_ids[rep]
    ids[g_of[used], cols[used]] = responses[used]
    seg = torch.full((count, width), -1, dtype=torch.long, device=group.device)  # -1 pad, 0 prompt, i + 1
    seg[:, :p] = torch.where(prompt_attention[rep] != 0, 0, -1)
    seg[g_of[used], cols[used]] = (rows[:, None].expand(m, r) + 1)[used]
    prompt_len = prompt_attention.long().sum(dim=1)  # (m,)
    pos = torch.zeros(count, width, dtype=torch.long, device=group.device)
    pos[:, :p] = (prompt_attention[rep].long().cumsum(dim=1) - 1).clamp(min=0)
    pos[g_of[used], cols[used]] = (prompt_len[:, None] + k)[used]

    q, kk = seg[:, :, None], seg[:, None, :]  # (G, L, 1), (G, 1, L)
    causal = torch.ones(width, width, dtype=torch.bool, device=group.device).tril()
    allowed = causal & (kk != -1) & ((kk == 0) | (kk == q))
    allowed |= torch.eye(width, dtype=torch.bool, device=group.device)  # pads see themselves: no empty rows
    prev = torch.where(k > 0, cols - 1, p - 1)  # the column predicting each token
    local = torch.where(used, prev, p - 1) - (p - 1)  # within the kept logits
    gather = g_of * (width - p + 1) + local  # (m, r)
    return ids, allowed[:, None], pos, gather


def worth_packing(rows: int, row_width: int, groups: int, packed_width: int, hidden: int) -> bool:
    """Whether the packed forward is estimated cheaper than the row forward (module docstring)."""
    pair_cost = 1.0 / (6.0 * max(1, hidden))  # a query-key pair relative to a token's matmuls
    plain = rows * row_width * (1.0 + row_width * pair_cost)
    packed = groups * packed_width * (1.0 + packed_width * pair_cost)
    return packed < plain
