"""rlcore.models.forward: micro-batching, trimming, log-probs and entropies against naive references.

Exactness checks use a float64 builtin:tiny so that only the code under test can make a difference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.batch import Batch
from rlcore.models import load_policy
from rlcore.models.forward import (
    compute_logprobs,
    micro_batches,
    sequence_tensors,
    token_entropy,
)
from rlcore.pure.losses import entropy
from tests.dist.rollouts import fake_rollout

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model64():
    model, _ = load_policy("builtin:tiny", dtype=torch.float64)
    return model


def _lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Real prompt tokens and response width (last attended column + 1) per row, by a plain loop."""
    prompt, response = [], []
    for i in range(len(batch)):
        prompt.append(int(batch["attention_mask"][i].sum()))
        cols = [j for j, a in enumerate(batch["response_attention"][i].tolist()) if a != 0]
        response.append(cols[-1] + 1 if cols else 0)
    return prompt, response


# ------------------------------------------------------------------------------------- micro-batching


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.integers(1, 6),
    n=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    size=st.one_of(st.none(), st.integers(1, 7)),
    budget=st.one_of(st.none(), st.integers(1, 120)),
    min_count=st.integers(1, 8),
)
def test_micro_batches_cover_every_row_once_and_respect_the_budget(prompts, n, seed, size, budget, min_count):
    batch = fake_rollout(prompts, n, max_prompt=9, max_response=14, seed=seed)
    pieces = micro_batches(batch, micro_batch_size=size, max_tokens=budget, min_count=min_count)
    assert len(pieces) >= min_count
    seen = []
    prompt, response = _lengths(batch)
    for micro, rows in pieces:
        if len(rows) == 0:  # a padding piece: one row, nothing to train on
            assert len(micro) == 1 and float(micro["response_mask"].abs().sum()) == 0.0
            continue
        assert torch.equal(micro["input_ids"], batch["input_ids"][rows])  # rows are what the indices say
        assert torch.equal(micro["responses"], batch["responses"][rows])
        assert micro["uid"] == [batch["uid"][i] for i in rows.tolist()]
        seen += rows.tolist()
        width = max(prompt[i] for i in rows.tolist()) + max(response[i] for i in rows.tolist())
        assert sequence_tensors(micro).input_ids.shape[1] == width  # trimmed to the used columns
        if budget is not None and len(rows) > 1:
            assert len(rows) * width <= budget
        if budget is None and size is not None and min_count == 1:
            assert len(rows) <= size
    assert sorted(seen) == list(range(len(batch)))  # a permutation: order can be restored
    if min_count > len(batch):
        assert len(pieces) == min_count


def test_order_is_restored_through_the_indices():
    batch = fake_rollout(5, 2, max_prompt=6, max_response=16, seed=3)
    pieces = micro_batches(batch, max_tokens=48)
    order = torch.cat([rows for _, rows in pieces])
    assert not torch.equal(order, torch.arange(len(batch)))  # sorted by length: really reordered
    out = torch.empty_like(batch["responses"])
    for micro, rows in pieces:
        out[rows] = micro["responses"]
    assert torch.equal(out, batch["responses"])


def test_token_budget_packs_short_rows_together():
    # 6 rows of prompt 2 + response 2 (width 4) and one long row of 2 + 20: budget 24
    attention_mask = torch.ones(7, 2, dtype=torch.long)
    lengths = torch.tensor([2, 2, 20, 2, 2, 2, 2])
    response_attention = (torch.arange(20) < lengths[:, None]).float()
    batch = Batch.from_dict(
        {
            "input_ids": torch.full((7, 2), 9),
            "attention_mask": attention_mask,
            "responses": torch.full((7, 20), 9) * response_attention.long(),
            "response_attention": response_attention,
            "response_mask": response_attention,
        }
    )
    pieces = micro_batches(batch, max_tokens=24)
    assert [rows.tolist() for _, rows in pieces] == [[2], [0, 1, 3, 4, 5, 6]]  # 1 x 22, 6 x 4 = 24


def test_sequence_tensors_by_hand():
    # row 0: prompt [5, 6] (left pad 1), response [7, 8, 9]; row 1: prompt [4] (left pad 2), response [3]
    batch = Batch.from_dict(
        {
            "input_ids": torch.tensor([[0, 5, 6], [0, 0, 4]]),
            "attention_mask": torch.tensor([[0, 1, 1], [0, 0, 1]]),
            "responses": torch.tensor([[7, 8, 9, 0], [3, 0, 0, 0]]),
            "response_attention": torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]]),
        }
    )
    inputs = sequence_tensors(batch)
    # the first prompt column and the last response column are pad in every row: trimmed
    assert inputs.input_ids.tolist() == [[5, 6, 7, 8, 9], [0, 4, 3, 0, 0]]
    assert inputs.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]  # cumsum - 1, clamped
    assert inputs.labels.tolist() == [[7, 8, 9], [3, 0, 0]]


# ------------------------------------------------------------------------------------- log-probs


def _naive_row(model, batch: Batch, i: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row alone, no padding at all: its real prompt + response tokens through the model."""
    prompt = batch["input_ids"][i][batch["attention_mask"][i] != 0]
    _, response_width = _lengths(batch[i : i + 1])
    response = batch["responses"][i, : response_width[0]]
    ids = torch.cat([prompt, response])[None]  # (1, s)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature  # (r, v)
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, response[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize(
    ("temperature", "size", "budget"), [(1.0, None, None), (0.7, 3, None), (1.3, None, 30), (1.0, 1, None)]
)
def test_compute_logprobs_equals_naive_per_row_log_softmax(model64, temperature, size, budget):
    batch = fake_rollout(4, 2, max_prompt=7, max_response=11, seed=5)
    lp, ent = compute_logprobs(
        model64, batch, temperature=temperature, micro_batch_size=size, max_tokens=budget, with_entropy=True
    )
    assert lp.dtype == torch.float32 and lp.shape == batch["response_mask"].shape
    mask = batch["response_mask"] != 0
    for i in range(len(batch)):
        ref_lp, ref_ent = _naive_row(model64, batch, i, temperature)
        r = len(ref_lp)
        keep = mask[i, :r]
        torch.testing.assert_close(lp[i, :r][keep], ref_lp[keep].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(ent[i, :r][keep], ref_ent[keep].float(), atol=1e-6, rtol=0)
    assert float(lp[~mask].abs().sum()) == 0.0 and float(ent[~mask].abs().sum()) == 0.0


def test_trimming_never_changes_logprobs(model64):
    """Against one forward of the whole untrimmed batch (every pad column kept), float64 inside."""
    batch = fake_rollout(5, 2, max_prompt=9, max_response=13, seed=8)
    ids = torch.cat([batch["input_ids"], batch["responses"]], dim=1)
    attn = torch.cat([batch["attention_mask"], batch["response_attention"].long()], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    p = batch["input_ids"].shape[1]
    with torch.no_grad():
        logits = model64(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, p - 1 : -1]
    full = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"] != 0
    for size, budget in [(None, None), (1, None), (3, None), (None, 25), (None, 60)]:
        lp, _ = compute_logprobs(model64, batch, micro_batch_size=size, max_tokens=budget)
        torch.testing.assert_close(lp[mask], full[mask].float(), atol=1e-6, rtol=0)


def test_token_entropy_chunks_match_one_pass_values_and_grads():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)).requires_grad_(True)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    (entropy(logits / 0.8) * weights).sum().backward()
    ref_grad, logits.grad = logits.grad, None
    chunked = token_entropy(logits, temperature=0.8, chunk_size=4)  # 15 positions in 4 chunks
    (chunked * weights).sum().backward()
    torch.testing.assert_close(chunked, entropy(logits / 0.8), atol=1e-12, rtol=0)
    torch.testing.assert_close(logits.grad, ref_grad, atol=1e-12, rtol=0)
    # by hand for a uniform distribution over 11 tokens: H = log 11
    assert float(token_entropy(torch.zeros(1, 1, 11, dtype=torch.float64))) == pytest.approx(
        float(torch.log(torch.tensor(11.0, dtype=torch.float64))), abs=1e-12
    )
