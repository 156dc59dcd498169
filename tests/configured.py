"""The library's update functions called with configs, as the tests written before issue 15 call them.

The library takes an `Algorithm` and an `UpdatePlan` (rlcore.algorithm, rlcore.step.update); the shell binds
them from the config (rlcore.trainer.algorithm). These wrappers do the binding for tests, deciding
the on-policy shortcut the way those tests set it up: a batch without `old_logprobs` is on-policy.
"""

from __future__ import annotations

from typing import Any

from configs import AlgoConfig, CriticConfig, OptimConfig
from rlcore.batch import Batch
from rlcore.state import ModelState
from rlcore.step.critic import critic_update
from rlcore.step.update import update_step
from rlcore.trainer.algorithm import algorithm_of, model_state, update_plan


def new_state(model: Any, optim: OptimConfig, total_updates: int = 10) -> ModelState:
    return model_state(model, optim, total_updates)


def update(state: ModelState, batch: Batch, algo: AlgoConfig, optim: OptimConfig, **kw: Any):
    algorithm = algorithm_of(algo, on_policy="old_logprobs" not in batch)
    return update_step(state, batch, algorithm, update_plan(algo, grad_clip=optim.grad_clip), **kw)


def update_critic(state: ModelState, batch: Batch, algo: AlgoConfig, critic: CriticConfig, **kw: Any):
    algorithm = algorithm_of(algo, critic, on_policy=False)
    plan = update_plan(algo, grad_clip=critic.grad_clip)
    return critic_update(state, batch, algorithm.value_loss_fn, plan, **kw)
