"""Shared-prompt packing: each prompt is computed once for all of its samples in a training forward.

GRPO-style batches hold n samples of every prompt. A plain forward computes the prompt n times; a
packed forward lays out blocks, one per prompt copy, side by side in packed rows,

    [prompt a | response a1 | response a2 | ... | prompt b | response b1 | ... | pad..]

with a 4D attention mask in which a block's prompt is causal, each response sees its block's prompt
and its own earlier tokens only, and position ids restart after the prompt for every response. Each
response token then sees exactly what it sees in its own row, so its log-prob is the same function
of the weights (the gradient too: the prompt's share is summed over its samples by autograd instead
of being computed once per sample). Rows sharing a prompt are found by comparing prompt tokens, so
any batch works; a micro-batch in which no prompt repeats stays unpacked.

Rows are bin-packed (`plan_rows`, best-fit decreasing up to a capacity): with long-tailed response
lengths one row per prompt would pad every prompt's row to the prompt with the most response tokens,
so a prompt's responses may spread over several packed rows (a copy of the prompt in each) and
several prompts may share one. Attention kernels with a dense mask compute every (query, key) pair
of a packed row, so wider rows cost more attention and fewer prompt copies; `choose_plan` picks the
capacity by a cost model (`layout_cost`: per token ~24 h^2 in the layers' matmuls, per query-key
pair ~4 h at a 2.5x lower rate; h = hidden size) and `worth_packing` compares the result with the
plain rows: short responses after a long shared prompt pack, long responses stay rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAIR_COST = 2.5 / 6.0
"""One query-key pair of dense attention relative to one token's layer matmuls, per unit of hidden
size: ~4 h FLOPs against ~24 h^2, times 2.5 because masked attention ran ~2.5x below the matmul rate
(CPU sdpa with a dense mask; experiments/README.md, "A lean decode step and a bin-packed update")."""


def prompt_groups(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(m,) group index per row: rows whose real prompt tokens are equal share an index (0..G-1)."""
    key = torch.cat([input_ids * attention_mask, attention_mask], dim=1)  # (m, 2p)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    return inverse


Block = tuple[int, list[int]]
"""(group, the batch rows whose responses follow that group's prompt copy in one packed row)."""


def aligned(length: int, align: int) -> int:
    """`length` rounded up to a multiple of `align`: a segment's columns in an aligned packed row."""
    return -(-length // align) * align


def plan_rows(
    prompt_len: list[int], resp_len: list[int], group: list[int], capacity: int
) -> list[list[Block]]:
    """Packed rows of at most `capacity` tokens, best-fit decreasing: groups by total response length,
    each group's responses longest first, each into the fullest row it fits (counting the group's
    prompt when that row has no copy of it yet); a new row when none fits. `capacity` >= the longest
    prompt + response."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)
    order = sorted(members, key=lambda g: (-sum(resp_len[i] for i in members[g]), g))
    rows: list[dict[int, list[int]]] = []
    free: list[int] = []
    for g in order:
        for i in sorted(members[g], key=lambda i: (-resp_len[i], i)):
            need = [resp_len[i] + (0 if g in row else prompt_len[i]) for row in rows]
            fits = [r for r in range(len(rows)) if need[r] <= free[r]]
            if fits:
                r = min(fits, key=lambda r: (free[r] - need[r], r))
            else:
                rows.append({})
                free.append(capacity)
                r, need = len(rows) - 1, [*need, resp_len[i] + prompt_len[i]]
            rows[r].setdefault(g, []).append(i)
            free[r] -= need[r]
    return [list(row.items()) for row in rows]


def plan_width(plan: list[list[Block]], prompt_len: list[int], resp_len: list[int]) -> int:
    """The longest packed row of `plan`, in tokens."""
    return max(sum(prompt_len[rows[0]] + sum(resp_len[i] for i in rows) for _, rows in row) for row in plan)


def choose_plan(
    prompt_len: list[int], resp_len: list[int], group: list[int], hidden: int
) -> tuple[list[list[Block]], int]:
    """(plan, width) of the cheapest capacity by `layout_cost`: from the longest prompt + response up
    (x1.5 each time) to the widest group's prompt + responses (where no prompt needs a second copy)."""
    per_group: dict[int, int] = {}
    for i, g in enumerate(group):
        per_group[g] = per_group.get(g, prompt_len[i]) + resp_len[i]
    widest = max(per_group.values())
    capacity = max(p + r for p, r in zip(prompt_len, resp_len, strict=True))
    best: tuple[float, list[list[Block]], int] | None = None
    while True:
        plan = plan_rows(prompt_len, resp_len, group, capacity)
        width = plan_width(plan, prompt_len, resp_len)
        cost = layout_cost(len(plan), width, hidden)
        if best is None or cost < best[0]:
            best = (cost, plan, width)
        if capacity >= widest:
            return best[1], best[2]
        capacity = min(widest, int(capacity * 1.5) + 1)


def pack_plan(
    input_ids: Tensor,
    prompt_attention: Tensor,
    responses: Tensor,
    response_attention: Tensor,
    plan: list[list[Block]],
    width: int,
    align: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Lay out `plan`'s packed rows: each block is [its group's prompt | its rows' responses], blocks
    side by side, rows right-padded to `width`. With `align` > 1 (exact mode, `rlcore.models.exact`) every
    prompt ends and every response starts on a multiple of `align` columns (padding before a prompt and after
    a response): each sequence's keys then fall into the same blocks of `align` as in its own row
    (`plan` and `width` from lengths rounded up likewise, `aligned`).

    Arguments: left-padded prompts (m, p) with their attention (the real tokens contiguous at the
    right), right-padded responses (m, r) with theirs (the attended tokens, in order, are the
    response). Returns (input_ids (R, W), attention (R, 1, W, W) bool, position_ids (R, W), gather
    (m, r)): a token sees the earlier tokens of its block's prompt and of its own response; positions
    restart after the prompt for every response. `gather` indexes the flattened (R * W) logits: entry
    (i, c) is the column that predicts row i's response token c (the block's last prompt token for the
    first one). Non-attended response columns point at that prompt token; their values mean nothing.
    """
    m, p = input_ids.shape
    device = input_ids.device
    plen = prompt_attention.long().sum(dim=1)
    attn_r = response_attention.long()
    lengths, rlen = plen.tolist(), attn_r.sum(dim=1).tolist()
    # per block: packed row, first column, representative row (its prompt); per response row: packed
    # row, first column, the column of its block's last prompt token
    blocks: list[tuple[int, int, int]] = []
    rows_at = [(0, 0, 0)] * m
    for packed, row in enumerate(plan):
        col = 0
        for _, members in row:
            col += aligned(lengths[members[0]], align) - lengths[members[0]]  # the prompt ends on a multiple
            blocks.append((packed, col, members[0]))
            col += lengths[members[0]]
            end = col - 1  # the prompt's last token: predicts each member's first response token
            for i in members:
                rows_at[i] = (packed, col, end)
                col += aligned(rlen[i], align)
    b_row, b_col, b_rep = torch.tensor(blocks, dtype=torch.long, device=device).unbind(1)
    r_row, r_col, r_end = torch.tensor(rows_at, dtype=torch.long, device=device).unbind(1)
    b_len = plen[b_rep]  # (B,)
    # prompt tokens: block b's k-th real prompt token is column p - len + k of its representative row
    tok_b = torch.repeat_interleave(torch.arange(len(blocks), device=device), b_len)  # (P,)
    k_p = torch.arange(tok_b.shape[0], device=device) - (torch.cumsum(b_len, 0) - b_len)[tok_b]
    # response tokens: the attended ones, the k-th of row i at column r_col[i] + k
    used = attn_r != 0
    k_r = torch.cumsum(attn_r, dim=1) - 1  # (m, r)
    ri, kr = torch.arange(m, device=device)[:, None].expand_as(used)[used], k_r[used]
    ids = input_ids.new_zeros(len(plan), width)
    block = torch.full((len(plan), width), -1, dtype=torch.long, device=device)  # -1 pad, else block id
    part = torch.zeros((len(plan), width), dtype=torch.long, device=device)  # 0 prompt, i + 1 response i
    pos = torch.zeros((len(plan), width), dtype=torch.long, device=device)
    at = (b_row[tok_b], b_col[tok_b] + k_p)
    ids[at], block[at], pos[at] = input_ids[b_rep[tok_b], p - b_len[tok_b] + k_p], tok_b, k_p
    at = (r_row[ri], r_col[ri] + kr)
    r_block = block[r_row, r_end]  # (m,) the block of each row's prompt copy
    ids[at], block[at], part[at], pos[at] = responses[used], r_block[ri], ri + 1, plen[ri] + kr
    q_block, k_block = block[:, :, None], block[:, None, :]  # (R, W, 1), (R, 1, W)
    q_part, k_part = part[:, :, None], part[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = causal & (k_block == q_block) & (k_block != -1) & ((k_part == 0) | (k_part == q_part))
    allowed |= torch.eye(width, dtype=torch.bool, device=device)  # pads see themselves: no empty rows
    predictor = torch.where(used & (k_r > 0), r_col[:, None] + k_r - 1, r_end[:, None])  # (m, r)
    return ids, allowed[:, None], pos, r_row[:, None] * width + predictor


def layout_cost(rows: int, width: int, hidden: int) -> float:
    """Estimated cost of a forward over `rows` x `width` tokens with dense attention, in units of one
    token's layer matmuls (`PAIR_COST`)."""
    return rows * width * (1.0 + width * PAIR_COST / max(1, hidden))


def worth_packing(rows: int, row_width: int, packed_rows: int, packed_width: int, hidden: int) -> bool:
    """Whether the packed forward is estimated cheaper than the row forward (module docstring)."""
    return layout_cost(packed_rows, packed_width, hidden) < layout_cost(rows, row_width, hidden)
