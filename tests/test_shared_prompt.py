"""rlcore.models.shared_prompt: packing by hand, and packed forwards against plain ones.

float64 builtin:tiny, so that only the packing can make a difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import AlgoConfig, OptimConfig
from rlcore.models import load_policy
from rlcore.models.forward import compute_logprobs, micro_batches, model_inputs
from rlcore.models.shared_prompt import pack_rows, packed_shape, prompt_groups, worth_packing
from tests.configured import new_state, update
from tests.dist.rollouts import fake_rollout

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model64():
    model, _ = load_policy("builtin:tiny", dtype=torch.float64)
    return model


def test_pack_rows_by_hand():
    # rows 0 and 2 share the prompt [5, 6]; row 1 has [4] (left-padded). Responses: [7, 8], [3], [9].
    ids = torch.tensor([[5, 6], [0, 4], [5, 6]])
    attn = torch.tensor([[1, 1], [0, 1], [1, 1]])
    responses = torch.tensor([[7, 8], [3, 0], [9, 0]])
    r_attn = torch.tensor([[1, 1], [1, 0], [1, 0]])
    group = prompt_groups(ids, attn)
    assert group[0] == group[2] != group[1]
    shape = packed_shape(group, r_attn, ids.shape[1])
    assert shape == (2, 5)  # two prompts; the longer packed row is 2 prompt + 3 response tokens
    packed, allowed, pos, gather = pack_rows(ids, attn, responses, r_attn, group, shape)
    a, b = int(group[0]), int(group[1])  # group a: [5, 6 | 7, 8 | 9], group b: [pad, 4 | 3 | pad, pad]
    assert packed[a].tolist() == [5, 6, 7, 8, 9] and packed[b].tolist() == [0, 4, 3, 0, 0]
    assert pos[a].tolist() == [0, 1, 2, 3, 2]  # each response restarts after the 2-token prompt
    assert pos[b].tolist() == [0, 0, 1, 0, 0]
    assert allowed.shape == (2, 1, 5, 5)
    T, F = True, False
    assert allowed[a, 0].tolist() == [
        [T, F, F, F, F],
        [T, T, F, F, F],
        [T, T, T, F, F],  # 7 sees the prompt and itself
        [T, T, T, T, F],  # 8 sees the prompt, 7 and itself
        [T, T, F, F, T],  # 9 sees the prompt and itself, not row 0's response
    ]
    assert allowed[b, 0].tolist() == [
        [T, F, F, F, F],  # a pad sees itself (no empty softmax rows; what pads see is never read)
        [F, T, F, F, F],
        [F, T, T, F, F],
        [F, T, F, T, F],
        [F, T, F, F, T],
    ]
    # kept logits: packed columns 1..4 (4 per group); row 0's tokens are predicted from columns 1 and 2,
    # row 2's first token from column 1 (the last prompt token), row 1's from its group's column 1
    assert gather[0].tolist() == [a * 4 + 0, a * 4 + 1]
    assert gather[2, 0] == a * 4 + 0 and gather[1, 0] == b * 4 + 0


def _equal_logprobs(model, batch, **kw):
    plain, ent_plain = compute_logprobs(model, batch, with_entropy=True, share_prompts=False, **kw)
    shared, ent_shared = compute_logprobs(model, batch, with_entropy=True, share_prompts=True, **kw)
    torch.testing.assert_close(shared, plain, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent_shared, ent_plain, atol=1e-10, rtol=0)


@settings(max_examples=15, deadline=None)
@given(
    prompts=st.integers(1, 4),
    n=st.integers(2, 6),
    max_prompt=st.integers(2, 20),
    max_response=st.integers(1, 10),
    size=st.one_of(st.none(), st.integers(1, 9)),
    seed=st.integers(0, 10_000),
)
def test_shared_prompt_logprobs_equal_plain_ones(model64, prompts, n, max_prompt, max_response, size, seed):
    """Groups of every size, empty responses, observation holes, micro-batches that split groups."""
    batch = fake_rollout(prompts, n, max_prompt=max_prompt, max_response=max_response, seed=seed)
    _equal_logprobs(model64, batch, micro_batch_size=size)


def test_the_packed_path_runs_where_it_pays_and_not_elsewhere(model64):
    short = fake_rollout(2, 8, max_prompt=20, max_response=4, seed=1)
    assert model_inputs(model64, short, share_prompts=True).gather is not None
    assert model_inputs(model64, short, share_prompts=False).gather is None
    alone = fake_rollout(6, 1, max_prompt=20, max_response=4, seed=1)  # no prompt repeats
    assert model_inputs(model64, alone, share_prompts=True).gather is None
    flash = copy.copy(model64)
    flash.config = copy.copy(model64.config)
    flash.config._attn_implementation = "flash_attention_2"  # cannot take a 4D mask
    assert model_inputs(flash, short, share_prompts=True).gather is None
    width = model_inputs(model64, short, share_prompts=True).input_ids.shape[1]
    for window in (width, width - 1):  # a sliding window (Mistral, Qwen2 with use_sliding_window)
        windowed = copy.copy(model64)
        windowed.config = copy.copy(model64.config)
        windowed.config.sliding_window = window  # the custom mask would drop it: pack only within it
        packed = model_inputs(windowed, short, share_prompts=True).gather is not None
        assert packed == (window == width)


def test_worth_packing_by_hand():
    # 8 rows of 30 columns vs one packed row of 100, hidden 64: pairs cost 1/384 of a token
    assert worth_packing(8, 30, 1, 100, 64)  # 8*30*(1+30/384)=258.75 > 100*(1+100/384)=126.04
    # 8 rows of 1,000 columns vs one of 7,500 (long responses): attention dominates
    assert not worth_packing(8, 1000, 1, 7500, 64)  # 8*1000*(1+1000/384)=28833 < 7500*(1+7500/384)=153984


def test_eager_attention_gets_an_additive_mask(model64):
    batch = fake_rollout(2, 5, max_prompt=12, max_response=6, seed=3)
    plain, _ = compute_logprobs(model64, batch, share_prompts=False)  # sdpa, unpacked
    eager = copy.deepcopy(model64)
    eager.set_attn_implementation("eager")
    assert model_inputs(eager, batch, share_prompts=True).gather is not None
    shared, _ = compute_logprobs(eager, batch, share_prompts=True)
    torch.testing.assert_close(shared, plain, atol=1e-10, rtol=0)


def test_update_with_shared_prompts_takes_the_same_step(model64):
    batch = fake_rollout(3, 6, max_prompt=15, max_response=8, seed=7)
    batch = batch.with_(advantages=batch["advantages"].double(), overwrite=True)
    optim = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.0)
    after = []
    for share in (False, True):
        model = copy.deepcopy(model64)
        state = new_state(model, optim, 4)
        algo = AlgoConfig(micro_batch_size=7, share_prompts=share)
        _, metrics = update(state, batch, algo, optim, horizon=8)
        # the share of trained tokens that went through a packed forward (every micro-batch packs here)
        assert metrics["actor/shared_prompt_frac"] == pytest.approx(1.0 if share else 0.0)
        after.append([p.detach().clone() for p in model.parameters()])
    moved = max(
        float((p - q.detach()).abs().max()) for p, q in zip(after[0], model64.parameters(), strict=True)
    )
    assert moved > 1e-3  # the step did something
    # Hugging Face's RMSNorm computes in float32 even in a float64 model, so gradients agree to float32
    # rounding only: the packed prompt's gradient is summed before that rounding, the plain one after
    for p, q in zip(*after, strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0)


def test_prompt_groups_compare_real_tokens_only():
    ids = torch.tensor([[9, 5, 6], [1, 5, 6], [0, 5, 7]])  # pads differ in rows 0 and 1
    attn = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1]])
    group = prompt_groups(ids, attn)
    assert group[0] == group[1] != group[2]


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.integers(1, 6), n=st.integers(1, 5), budget=st.integers(1, 200), seed=st.integers(0, 10_000)
)
def test_token_budget_keeps_a_prompts_samples_together(prompts, n, budget, seed):
    batch = fake_rollout(prompts, n, max_prompt=9, max_response=14, seed=seed)
    order = [int(i) for _, rows in micro_batches(batch, max_tokens=budget) for i in rows]
    assert sorted(order) == list(range(len(batch)))
    uids = [batch["uid"][i] for i in order]
    runs = [u for j, u in enumerate(uids) if j == 0 or uids[j - 1] != u]
    assert len(runs) == len(set(uids))  # each prompt's rows form one run
    # groups come longest first (by their longest row)
    total = (batch["attention_mask"].sum(1) + batch["response_attention"].sum(1)).tolist()
    longest = [max(total[i] for i in range(len(batch)) if batch["uid"][i] == u) for u in runs]
    assert longest == sorted(longest, reverse=True)
