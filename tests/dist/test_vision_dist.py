"""A vision-language policy under FSDP2 on 2 gloo ranks (issue 37): the update of builtin:tiny-vl, its
language layers and vision blocks sharded, each rank with its own prompts' images, equals one process."""

from __future__ import annotations

import pytest
import torch

from configs import AlgoConfig, OptimConfig
from rlcore.models import load_policy
from tests.configured import new_state, update
from tests.dist import workers

ALGO = AlgoConfig(loss_agg="token-mean", micro_batch_size=2)
OPTIM = OptimConfig(lr=1e-2, eps=1e-3)  # (see test_update_dist: the step then follows the gradient)


def test_two_ranks_update_a_vision_language_policy_as_one_process(tmp_path):
    torch.set_num_threads(1)
    workers.spawn("vision_update", tmp_path, ALGO, OPTIM)
    ranks = torch.load(tmp_path / "vision.pt")
    batch = workers.vision_rollout()
    model, _ = load_policy("builtin:tiny-vl")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _, metrics = update(new_state(model, OPTIM), batch, AlgoConfig(loss_agg="token-mean", micro_batch_size=64),
                        OPTIM, horizon=4)  # fmt: skip
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
        assert ranks["metrics"][key] == pytest.approx(metrics[key], abs=1e-6, rel=0), key
    weights = model.state_dict()
    for key, value in ranks["weights"].items():
        torch.testing.assert_close(value, weights[key], atol=1e-6, rtol=0, msg=key)
    visual = [k for k in ranks["weights"] if k.startswith("model.visual.")]
    assert visual and max(float((ranks["weights"][k] - initial[k]).abs().max()) for k in visual) > 1e-3
