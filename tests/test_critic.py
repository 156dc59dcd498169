"""The PPO critic: value shapes and masking, the position convention, and learning a fixed batch."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from configs import AlgoConfig, CriticConfig, OptimConfig
from rlcore.pure.advantages import gae
from rlcore.step.critic import ValueModel, build_critic, compute_values, explained_variance
from tests.configured import new_state, update_critic
from tests.dist.rollouts import fake_rollout


@pytest.fixture(scope="module")
def critic_and_batch():
    torch.manual_seed(0)
    critic = build_critic("builtin:tiny", seed=0)
    batch = fake_rollout(4, 3, max_prompt=6, max_response=7, seed=3)
    return critic, batch


def test_values_have_response_shape_are_zero_off_the_mask_and_start_at_zero(critic_and_batch):
    critic, batch = critic_and_batch
    values = compute_values(critic, batch)
    assert values.shape == batch["response_mask"].shape and values.dtype == torch.float32
    assert (values == 0).all()  # the head starts at zero
    with torch.no_grad():
        critic.value_head.bias.fill_(0.5)
        critic.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    values = compute_values(critic, batch)
    assert (values[batch["response_mask"] == 0] == 0).all()
    assert (values[batch["response_mask"] != 0] != 0).all()
    again = compute_values(critic, batch, micro_batch_size=2)  # micro-batching and trimming change nothing
    torch.testing.assert_close(again, values, atol=1e-5, rtol=0)
    torch.nn.init.zeros_(critic.value_head.weight)
    torch.nn.init.zeros_(critic.value_head.bias)


def test_value_of_token_t_is_read_before_it(critic_and_batch):
    """V(s_t) comes from the hidden state at the position before response token t (verl's slice)."""
    critic, batch = critic_and_batch
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    i = int(torch.nonzero(batch["response_mask"].sum(-1) >= 3)[0])  # a row with a real response
    row = batch[i : i + 1]
    values = compute_values(critic, row)
    prompt = row["input_ids"][0][row["attention_mask"][0] != 0]
    t = int(row["response_attention"][0].sum())
    full = torch.cat([prompt, row["responses"][0, :t]])[None]
    with torch.no_grad():
        hidden = critic.backbone(input_ids=full).last_hidden_state
        expected = critic.value_head(hidden).squeeze(-1)[0, len(prompt) - 1 : len(prompt) - 1 + t]
    mask = row["response_mask"][0, :t] != 0
    assert mask.sum() >= 3
    torch.testing.assert_close(values[0, :t][mask], expected[mask], atol=1e-5, rtol=0)
    torch.nn.init.zeros_(critic.value_head.weight)


def test_gae_fed_updates_reduce_the_value_loss_on_a_fixed_batch():
    critic = build_critic("builtin:tiny", seed=0)
    batch = fake_rollout(4, 4, max_prompt=6, max_response=6, seed=5)
    mask = batch["response_mask"]
    rewards = torch.zeros_like(mask)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    rewards[last] = torch.linspace(-1, 1, int(last.sum()))  # outcome rewards on the last token
    optim_cfg = OptimConfig(lr=3e-3)
    state = new_state(critic, optim_cfg, 50)
    algo, critic_cfg = AlgoConfig(micro_batch_size=5), CriticConfig(value_clip=10.0)
    losses = []
    for _ in range(25):
        values = compute_values(critic, batch)
        _, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
        b = batch.with_(values=values, returns=returns)
        state, metrics = update_critic(state, b, algo, critic_cfg, horizon=6)
        losses.append(metrics["critic/vf_loss"])
    assert state.step == 25
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics["critic/explained_variance"] > 0.3


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    constant = torch.full_like(returns, 2.0)  # predicting the mean explains nothing
    assert float(explained_variance(constant, returns, mask)) == pytest.approx(0.0, abs=1e-6)


def test_value_model_is_a_module_with_a_zero_head():
    critic = build_critic("builtin:tiny")
    assert isinstance(critic, ValueModel) and critic.value_head.out_features == 1
    assert dataclasses.is_dataclass(CriticConfig())


def test_shared_prompt_values_and_updates_equal_the_row_path():
    """Packed critic passes (each prompt once for its samples) give the row path's values, and one
    critic update the same weights (float64; to float32 rounding, as for the actor: HF's RMSNorm)."""
    critic64 = build_critic("builtin:tiny", dtype=torch.float64, seed=0)
    with torch.no_grad():
        critic64.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    batch = fake_rollout(3, 6, max_prompt=14, max_response=6, seed=9)
    from rlcore.models.forward import model_inputs

    assert model_inputs(critic64, batch).gather is not None  # this batch does pack
    plain = compute_values(critic64, batch, share_prompts=False)
    shared = compute_values(critic64, batch, share_prompts=True)
    assert (plain != 0).any()
    torch.testing.assert_close(shared, plain, atol=1e-10, rtol=0)
    mask = batch["response_mask"]
    _, returns = gae(mask * 0.3, plain.float(), mask, gamma=1.0, lam=1.0)
    b = batch.with_(values=plain, returns=returns.double())
    after = []
    for share in (False, True):
        model = copy.deepcopy(critic64)
        optim_cfg = OptimConfig(lr=1e-2, eps=1e-3)
        state = new_state(model, optim_cfg, 4)
        update_critic(
            state, b, AlgoConfig(micro_batch_size=7, share_prompts=share), CriticConfig(), horizon=6
        )
        after.append([q.detach().clone() for q in model.parameters()])
    moved = max(
        float((q - p0.detach()).abs().max()) for q, p0 in zip(after[0], critic64.parameters(), strict=True)
    )
    assert moved > 1e-3
    for q0, q1 in zip(*after, strict=True):
        torch.testing.assert_close(q1, q0, atol=1e-6, rtol=0)
