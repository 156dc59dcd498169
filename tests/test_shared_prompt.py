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
from rlcore.models.forward import ModelInputs, compute_logprobs, micro_batches, model_inputs, response_logits
from rlcore.models.shared_prompt import pack_plan, plan_rows, plan_width, prompt_groups, worth_packing
from tests.configured import new_state, update
from tests.dist.rollouts import fake_rollout

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model64():
    model, _ = load_policy("builtin:tiny", dtype=torch.float64)
    return model


def test_pack_plan_by_hand():
    # rows 0 and 2 share the prompt [5, 6]; row 1 has [4] (left-padded). Responses: [7, 8], [3], [9].
    ids = torch.tensor([[5, 6], [0, 4], [5, 6]])
    attn = torch.tensor([[1, 1], [0, 1], [1, 1]])
    responses = torch.tensor([[7, 8], [3, 0], [9, 0]])
    r_attn = torch.tensor([[1, 1], [1, 0], [1, 0]])
    group = prompt_groups(ids, attn)
    assert group[0] == group[2] != group[1]
    a, b = int(group[0]), int(group[1])
    plen, rlen, groups = [2, 1, 2], [2, 1, 1], group.tolist()
    # capacity 4: row 0 fills a packed row; row 2 cannot join it, so prompt a is copied; b gets its own
    assert plan_rows(plen, rlen, groups, 4) == [[(a, [0])], [(a, [2])], [(b, [1])]]
    # capacity 7: one packed row, [5, 6 | 7, 8 | 9 || 4 | 3]
    plan = plan_rows(plen, rlen, groups, 7)
    assert plan == [[(a, [0, 2]), (b, [1])]] and plan_width(plan, plen, rlen) == 7
    packed, allowed, pos, gather = pack_plan(ids, attn, responses, r_attn, plan, 7)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 4, 3]]
    assert pos.tolist() == [[0, 1, 2, 3, 2, 0, 1]]  # each response restarts after its prompt
    T, F = True, False
    assert allowed.shape == (1, 1, 7, 7)
    assert allowed[0, 0].tolist() == [
        [T, F, F, F, F, F, F],
        [T, T, F, F, F, F, F],
        [T, T, T, F, F, F, F],  # 7 sees the prompt and itself
        [T, T, T, T, F, F, F],  # 8 sees the prompt, 7 and itself
        [T, T, F, F, T, F, F],  # 9 sees the prompt and itself, not row 0's response
        [F, F, F, F, F, T, F],  # prompt b starts a new block
        [F, F, F, F, F, T, T],
    ]
    # row 0's tokens are predicted from columns 1 and 2, row 2's from 1 (the last prompt token), row 1's from 5
    assert gather.tolist() == [[1, 2], [5, 5], [1, 1]]  # non-attended columns point at the prompt's end
    packed, allowed, pos, gather = pack_plan(
        ids, attn, responses, r_attn, plan_rows(plen, rlen, groups, 4), 4
    )
    assert packed.tolist() == [[5, 6, 7, 8], [5, 6, 9, 0], [4, 3, 0, 0]]
    assert allowed[1, 0, 3].tolist() == [F, F, F, T]  # a pad sees itself (no empty softmax rows)
    assert gather.tolist() == [[1, 2], [8, 8], [5, 5]]  # row 1 in packed row 2 (column 0), row 2 in row 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_capacity_gives_the_plain_logprobs(model64, seed):
    """Forced plans from the tightest capacity (prompt copies in many rows) to one row per prompt."""
    batch = fake_rollout(3, 5, max_prompt=12, max_response=9, seed=seed)
    plain = model_inputs(model64, batch, share_prompts=False)
    ids_p, attn_p = batch["input_ids"], batch["attention_mask"].long()
    responses, attn_r = batch["responses"], batch["response_attention"].long()
    plen, rlen = attn_p.sum(1).tolist(), attn_r.sum(1).tolist()
    groups = prompt_groups(ids_p, attn_p).tolist()
    reference = response_logits(model64, plain)
    mask = attn_r.bool()
    widths = set()
    for capacity in (max(p + r for p, r in zip(plen, rlen, strict=True)), 20, 35, 1000):
        plan = plan_rows(plen, rlen, groups, capacity)
        width = plan_width(plan, plen, rlen)
        widths.add((len(plan), width))
        ids, allowed, pos, gather = pack_plan(ids_p, attn_p, responses, attn_r, plan, width)
        inputs = ModelInputs(input_ids=ids, attention_mask=allowed, position_ids=pos, labels=responses,
                             gather=gather, keep=width)  # fmt: skip
        torch.testing.assert_close(
            response_logits(model64, inputs)[mask], reference[mask], atol=1e-10, rtol=0
        )
    assert len(widths) >= 3  # the capacities gave different layouts


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
    # 8 rows of 30 columns vs one packed row of 100, hidden 64: pairs cost 2.5/384 of a token
    assert worth_packing(8, 30, 1, 100, 64)  # 8*30*(1+30/153.6)=286.9 > 100*(1+100/153.6)=165.1
    # 8 rows of 1,000 columns vs one of 7,500 (long responses): attention dominates
    assert not worth_packing(8, 1000, 1, 7500, 64)  # 8*1000*(1+1000/153.6)=60083 < 7500*(1+7500/153.6)=373730
    assert not worth_packing(
        8, 100, 1, 720, 64
    )  # 8*100*1.65=1321 < 720*5.69=4095 (packs at pair cost 1/384: 1188 < 2070)


def test_eager_attention_gets_an_additive_mask(model64):
    batch = fake_rollout(2, 5, max_prompt=12, max_response=6, seed=3)
    plain, _ = compute_logprobs(model64, batch, share_prompts=False)  # sdpa, unpacked
    eager = copy.deepcopy(model64)
    eager.set_attn_implementation("eager")
    assert model_inputs(eager, batch, share_prompts=True).gather is not None
    shared, _ = compute_logprobs(eager, batch, share_prompts=True)
    # eager attention's softmax sums masked columns too (exact zeros, in another order than sdpa's),
    # and Hugging Face's float32 RMSNorm turns those float64 roundings into float32 ones
    torch.testing.assert_close(shared, plain, atol=1e-6, rtol=0)


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
