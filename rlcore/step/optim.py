"""The optimizer states of a run from specs: AdamW and its learning-rate schedule (`OptimizerSpec`), the
actor's `ModelState` over a built policy, and the PPO critic built with its own.

    actor = model_state(model, OptimizerSpec(lr=1e-6), total_updates=steps * epochs * mini_batches)
    critic = critic_state(ModelSpec(path="builtin:tiny"), OptimizerSpec(lr=1e-5), total_updates, placement)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlcore.models.specs import ModelSpec, SpecError
from rlcore.state import ModelState
from rlcore.step.update import build_optimizer, build_scheduler


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """AdamW's settings and its schedule (`rlcore.step.update.build_optimizer`, `build_scheduler`)."""

    lr: float
    """The peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decays."""
    eps: float = 1e-8
    """AdamW's denominator term."""
    weight_decay: float = 0.0
    """Decoupled weight decay, on every trained parameter."""
    warmup_steps: int = 0
    """Optimizer updates of linear warm-up."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine down to `min_lr_ratio` of the peak at the last update."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's floor, as a share of the peak."""


def build_adamw(model: nn.Module, spec: OptimizerSpec) -> Optimizer:
    """AdamW over `model`'s trained parameters with the spec's settings."""
    return build_optimizer(model, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def build_schedule(optimizer: Optimizer, spec: OptimizerSpec, total_updates: int) -> LRScheduler:
    """The spec's learning-rate schedule over `total_updates` optimizer updates."""
    return build_scheduler(
        optimizer, total_updates=total_updates, warmup_steps=spec.warmup_steps, schedule=spec.schedule,
        min_lr_ratio=spec.min_lr_ratio,
    )  # fmt: skip


def model_state(model: nn.Module, spec: OptimizerSpec, total_updates: int) -> ModelState:
    """`model` with AdamW and its schedule over `total_updates` updates, both from `spec`."""
    optimizer = build_adamw(model, spec)
    return ModelState(model=model, optimizer=optimizer, scheduler=build_schedule(optimizer, spec, total_updates))


def critic_state(spec: ModelSpec, optim: OptimizerSpec, total_updates: int, placement: Any) -> ModelState:
    """The PPO critic on the backbone at `spec.path` (LoRA adapters per the spec's), value head at zero,
    sharded like the policy, with its own AdamW and schedule."""
    from rlcore.models.build import shard
    from rlcore.step.critic import build_critic

    try:
        critic = build_critic(spec.path, dtype=spec.torch_dtype, seed=spec.seed, lora=spec.lora())
    except ValueError as e:
        raise SpecError("path", str(e)) from None
    critic = shard(critic.to(placement.local.device), placement)  # the value head in the root
    return model_state(critic, optim, total_updates)
