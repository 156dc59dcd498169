"""Datums as model inputs (`rlcore.tinker.rows`): the prompt-packed layout gives the log-probs and gradients of
plain rows, with every position (the shared prompt's too) gathered; groups are found by common prefix; micro-
batches follow a token budget and every rank plans every rank's alike."""

from __future__ import annotations

import torch

from rlcore.models.policy import load_model
from rlcore.tinker.model import micro_batches
from rlcore.tinker.rows import (
    datum_rows,
    packed_inputs,
    row_inputs,
    row_logprobs,
    sequence_of,
    shared_prefixes,
)


def _groups(g: torch.Generator) -> list[torch.Tensor]:
    seqs = []
    for prompt_len, samples in ((30, 4), (12, 3), (45, 5)):
        prompt = torch.randint(3, 60, (prompt_len,), generator=g)
        for _ in range(samples):
            response = torch.randint(3, 60, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
            seqs.append(torch.cat([prompt, response]))
    return seqs


def test_packed_datums_give_the_rows_logprobs_and_gradients():
    torch.manual_seed(0)
    model = load_model("builtin:tiny").train()
    seqs = _groups(torch.Generator().manual_seed(1))
    packed, packed_mask = packed_inputs(model, seqs, 0, torch.device("cpu"))
    assert packed.packed and packed.input_ids.shape[0] < len(seqs)  # fewer rows: each prompt once a block
    rows, rows_mask = row_inputs([datum_rows(s[:-1], s[1:]) for s in seqs], 0, torch.device("cpu"))
    assert torch.equal(packed_mask, rows_mask)
    weights = torch.rand(rows_mask.shape, generator=torch.Generator().manual_seed(2)) * rows_mask
    grads = []
    for inputs in (packed, rows):
        model.zero_grad()
        lp = row_logprobs(model, inputs)
        (lp * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if inputs is packed:
            first = lp.detach()
    torch.testing.assert_close(first * rows_mask, lp.detach() * rows_mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)  # summed in another order


def test_groups_are_consecutive_datums_with_a_common_prefix():
    t = torch.tensor
    seqs = [t([1, 2, 3, 4, 5]), t([1, 2, 3, 9]), t([1, 2, 7, 7, 7]), t([5, 6, 7]), t([8, 6]), t([8, 6, 1])]
    # the first three share [1, 2]; [5, 6, 7] is alone; the last two share [8] (< 2) but keep a response token
    assert shared_prefixes(seqs) == [2, 2, 2, 1, 1, 1]
    assert shared_prefixes([t([4, 4, 4]), t([4, 4, 4])]) == [2, 2]  # at least one response token each


def test_only_shifted_targets_have_a_sequence():
    assert torch.equal(sequence_of(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4])), torch.tensor([1, 2, 3, 4]))
    assert sequence_of(torch.tensor([1, 2, 3]), torch.tensor([2, 9, 4])) is None


def test_micro_batches_follow_the_budget_and_every_rank_plans_alike():
    lengths = [10, 10, 10, 25, 5, 5, 40, 1, 1]
    assert micro_batches(lengths, 1, 30) == [[[0, 1, 2], [3, 4], [5], [6], [7, 8]]]
    two = micro_batches(lengths, 2, 20)  # shares of 5 consecutive datums; 40 > 20 runs alone
    assert two == [[[0, 1], [2], [3], [4]], [[5], [6], [7, 8]]]
    assert sorted(i for plan in two for run in plan for i in run) == list(range(len(lengths)))
