"""A critic update on 2 gloo ranks equals the same update in one process (issue 8)."""

from __future__ import annotations

import pytest
import torch

from configs import AlgoConfig, CriticConfig, OptimConfig
from rlcore.step.critic import build_critic, compute_values
from tests.configured import update_critic
from tests.dist import workers
from tests.dist.rollouts import fake_rollout

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_rank_critic_update_equals_one_process(tmp_path):
    batch = fake_rollout(4, 2, max_prompt=6, max_response=6, seed=11)
    with torch.no_grad():
        values = compute_values(build_critic("builtin:tiny", seed=0), batch) + 0.05 * batch["response_mask"]
    returns = torch.linspace(-1, 1, batch["response_mask"].numel()).view_as(values) * batch["response_mask"]
    batch = batch.with_(values=values, returns=returns)
    workers.spawn("critic_update_worker", tmp_path, batch)
    two = torch.load(tmp_path / "critic.pt", weights_only=False)

    critic = build_critic("builtin:tiny", seed=0)
    state = workers.new_state(critic, OptimConfig(lr=1e-3, eps=1e-3))
    state, metrics = update_critic(
        state, batch, AlgoConfig(micro_batch_size=5), CriticConfig(value_clip=0.2), horizon=6
    )
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"):
        assert two["metrics"][key] == pytest.approx(metrics[key], abs=1e-6), key
    one = critic.state_dict()
    assert set(two["weights"]) == set(one)
    for name, tensor in one.items():
        torch.testing.assert_close(two["weights"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(one["value_head.weight"], torch.zeros_like(one["value_head.weight"]))  # it moved
