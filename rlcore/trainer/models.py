"""Building the models, the optimizer state and the rollout engine of a run; weight sync; final/ export."""

from __future__ import annotations

from typing import Any

import torch

from configs import Config, ConfigError
from rlcore.models.policy import load_policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _load(cfg: Config, dist: Any) -> tuple[Any, Any]:
    try:
        model, tokenizer = load_policy(cfg.model.path, dtype=DTYPES[cfg.model.dtype], seed=cfg.trainer.seed)
    except ValueError as e:  # a missing or broken model directory: the user's input
        raise ConfigError(f"--model.path: {e}") from None
    return model.to(dist.device), tokenizer


def build_policy(cfg: Config, dist: Any, mesh: Any) -> tuple[Any, Any]:
    """The trained policy (sharded with FSDP2 over the mesh when there is more than one rank)."""
    model, tokenizer = _load(cfg, dist)
    model.train()
    if cfg.model.activation_checkpointing:
        from rlcore.dist.fsdp import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    if mesh is not None:
        from rlcore.dist.fsdp import apply_fsdp

        apply_fsdp(model, mesh)
    return model, tokenizer


def build_reference(cfg: Config, dist: Any, mesh: Any) -> Any:
    """A frozen copy of the starting policy, sharded like it, never updated."""
    model, _ = _load(cfg, dist)
    model.eval().requires_grad_(False)
    if mesh is not None:
        from rlcore.dist.fsdp import apply_fsdp

        apply_fsdp(model, mesh)
    return model


def build_state(cfg: Config, model: Any, dist: Any) -> Any:
    from rlcore.update import TrainState, build_optimizer, build_scheduler

    optimizer = build_optimizer(model, cfg.optim)
    updates = (
        cfg.trainer.steps
        * cfg.algo.ppo_epochs
        * (cfg.data.batch_size // (cfg.algo.mini_batch_size or cfg.data.batch_size))
    )
    scheduler = build_scheduler(optimizer, cfg.optim, total_updates=updates)
    return TrainState(step=0, model=model, optimizer=optimizer, scheduler=scheduler, kl_coef=cfg.algo.kl_coef)


def build_engine(cfg: Config, model: Any, tokenizer: Any, dist: Any) -> Any:
    """The rollout engine: the native sampler, sharing the policy module (validate() refuses vllm for now)."""
    from rlcore.rollout.native import NativeEngine

    return NativeEngine(model, tokenizer, device=dist.device, generator_seed=cfg.trainer.seed)


def sync_weights(p: Any) -> None:
    """Push the updated actor weights into the engine (nothing to do when the engine shares the module)."""
    if getattr(p.engine, "model", None) is p.state.model:
        return  # the native engine samples from the trained module itself
    from rlcore.dist.stream import iter_full_state

    for bucket in iter_full_state(p.state.model):
        if p.dist.rank == 0:
            p.engine.load_weights(bucket)


def save_final(p: Any) -> None:
    """out_dir/final: a Hugging Face directory that from_pretrained (and vLLM) loads."""
    from rlcore.dist.stream import save_hf_pretrained

    save_hf_pretrained(p.state.model, p.tokenizer, p.out_dir / "final")


def build_critic_state(cfg: Config, dist: Any, mesh: Any) -> Any:
    """The PPO critic (initialised from --critic.path or the policy) with its own optimizer and schedule."""
    import dataclasses

    from rlcore.critic import build_critic
    from rlcore.update import TrainState, build_optimizer, build_scheduler

    try:
        critic = build_critic(
            cfg.critic.path or cfg.model.path, dtype=DTYPES[cfg.model.dtype], seed=cfg.trainer.seed
        )
    except ValueError as e:
        raise ConfigError(f"--critic.path: {e}") from None
    critic = critic.to(dist.device)
    if mesh is not None:
        from rlcore.dist.fsdp import apply_fsdp

        apply_fsdp(critic, mesh)  # each decoder layer, then the root (value head included)
    optim_cfg = dataclasses.replace(cfg.optim, lr=cfg.critic.lr, warmup_steps=cfg.critic.warmup_steps)
    optimizer = build_optimizer(critic, optim_cfg)
    per_step = cfg.algo.ppo_epochs * (
        cfg.data.batch_size // (cfg.algo.mini_batch_size or cfg.data.batch_size)
    )
    return TrainState(
        model=critic,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, optim_cfg, cfg.trainer.steps * per_step),
    )
