"""The run's models, optimizer states and rollout engine, built from its Config: each flag bound to the
library's specs (`rlcore.models.specs`, `rlcore.step.optim.OptimizerSpec`), the builders
(`rlcore.models.build`, `rlcore.rollout.build`, `rlcore.step.optim`) called, their errors named by flag."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from configs import Config, ConfigError
from rlcore.config.model_checks import max_positions
from rlcore.dist.reduce import world_max
from rlcore.models import build
from rlcore.models.specs import EngineSpec, ModelSpec, SpecError
from rlcore.rollout.build import build_engine as engine_of
from rlcore.rollout.engines import engine_kind
from rlcore.step import optim


def model_spec(cfg: Config) -> ModelSpec:
    """The policy's spec: --model, --trainer.seed, --algo.router-replay, --rollout.exact."""
    m = cfg.model
    return ModelSpec(
        path=m.path, dtype=m.dtype, seed=cfg.trainer.seed, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout, lora_targets=m.lora_targets,
        activation_checkpointing=m.activation_checkpointing, selective_checkpointing=m.selective_checkpointing,
        freeze_vision=m.freeze_vision,
        router_replay=cfg.algo.router_replay, exact=cfg.rollout.exact,
    )  # fmt: skip


def engine_spec(cfg: Config) -> EngineSpec:
    """The rollout engine's spec: --rollout and --trainer.seed (vllm: its context, `_engine_context`)."""
    r = cfg.rollout
    return EngineSpec(
        kind=r.engine, seed=cfg.trainer.seed, max_context=_engine_context(cfg) if engine_kind(r.engine).own_weights else None,
        compile=r.compile, gpu_memory_utilization=r.gpu_memory_utilization, lora_merged_copy=r.lora_merged_copy,
        sync_bucket_mb=r.sync_bucket_mb,
    )  # fmt: skip


def _engine_context(cfg: Config) -> int:
    """The longest sequence vLLM must hold: a prompt of --data.max-prompt-length (or an env's first
    observation after a shorter one) plus --rollout.max-tokens, never past the model's positions."""
    wanted, limit = cfg.data.max_prompt_length + cfg.rollout.max_tokens, max_positions(cfg.model.path)
    return wanted if limit is None else min(wanted, limit)


def _line(cfg: Config, e: SpecError, path_flag: str) -> str:
    """The one line of a spec's error, named by the flag that set the field at fault."""
    m = cfg.model
    return {
        "path": f"{path_flag}: {e}",
        "exact": f"--rollout.exact with --model.path {m.path}: {e}",
        "lora_targets": f"--model.lora-targets {' '.join(m.lora_targets) or '(all linear)'}: {e}",
        "kind": f"--rollout.engine {cfg.rollout.engine}: {e}",
        "engine": f"--rollout.engine {cfg.rollout.engine} with --model.path {m.path}: {e}",
    }[e.field]


@contextlib.contextmanager
def _flags(cfg: Config, path_flag: str = "--model.path") -> Iterator[None]:
    """A builder's SpecError as the user's ConfigError."""
    try:
        yield
    except SpecError as e:
        raise ConfigError(_line(cfg, e, path_flag)) from None


def tokenizer_of(cfg: Config) -> Any:
    """The policy's tokenizer, loaded without its weights (the prompts are checked before they load)."""
    with _flags(cfg):
        return build.load_tokenizer_of(model_spec(cfg))


def vision_of(cfg: Config, tokenizer: Any) -> Any:
    """The policy's image processing (`rlcore.models.vision`) for its loaded `tokenizer`, None for a
    text-only model; no weights load."""
    with _flags(cfg):
        return build.load_vision_of(model_spec(cfg), tokenizer)


def _load(cfg: Config, dist: Any) -> Any:
    with _flags(cfg):
        return build.load(model_spec(cfg), dist)


def agree_exact_rows() -> None:
    """--rollout.exact: every rank multiplies in the same row layouts. Each rank's `make_exact` chose its
    own on its own CPU (`rlcore.models.exact_check`); ranks on CPUs that chose otherwise would sample and
    score in other bits, so every rank refuses alike (a collective: all ranks call it once)."""
    from rlcore.models.exact_check import CANDIDATES, rows_signature

    mine = rows_signature()
    highest, lowest = world_max(mine), [-v for v in world_max([-v for v in mine])]
    if highest == lowest:
        return
    names = {-1: "none", **{i: rows.name for i, rows in enumerate(CANDIDATES)}}
    differ = "; ".join(f"{dtype}: {names[lo]} and {names[hi]}" for dtype, lo, hi
                       in zip(("float32", "bfloat16", "float16"), lowest, highest, strict=True) if lo != hi)  # fmt: skip
    raise ConfigError(
        f"--rollout.exact: the ranks' CPUs keep products row-invariant in different row layouts ({differ}), so "
        "their engines and trainers would multiply otherwise; run every rank on one kind of CPU (lscpu), or "
        "without --rollout.exact"
    )


def build_policy(cfg: Config, placement: Any) -> Any:
    """The trained policy, split over the placement's axes (`rlcore.models.build.shard`)."""
    with _flags(cfg):
        return build.build_policy(model_spec(cfg), placement)


def build_engine_copy(cfg: Config, dist: Any) -> Any:
    """The policy an engine samples from when it cannot share the trained module
    (`rlcore.models.build.build_engine_copy`)."""
    with _flags(cfg):
        return build.build_engine_copy(model_spec(cfg), dist)


def build_reference(cfg: Config, placement: Any) -> Any:
    """A frozen copy of the starting policy, sharded like it (None with LoRA)."""
    with _flags(cfg):
        return build.build_reference(model_spec(cfg), placement)


def build_teacher(cfg: Config, placement: Any) -> Any:
    """On-policy distillation's teacher (--algo.teacher, in the policy's dtype): frozen, sharded like the
    policy."""
    with _flags(cfg, "--algo.teacher"):
        return build.build_teacher(dataclasses.replace(model_spec(cfg), path=cfg.algo.teacher), placement)


def build_state(cfg: Config, model: Any, dist: Any) -> Any:
    """The actor's ModelState: the policy with AdamW (--optim) and its schedule over the run's updates."""
    from rlcore.trainer.algorithm import model_state, updates_per_run

    return model_state(model, cfg.optim, updates_per_run(cfg), lora=cfg.model.lora_rank > 0)


def build_engine(cfg: Config, model: Any, tokenizer: Any, dist: Any) -> Any:
    """The rollout engine of this rank (`rlcore.rollout.build.build_engine`) for the policy `model`."""
    with _flags(cfg):
        return engine_of(model_spec(cfg), engine_spec(cfg), model, tokenizer, dist)


def critic_spec(cfg: Config) -> ModelSpec:
    """The PPO critic's backbone: --critic.path (else the policy's) with --critic.lora-rank's adapters
    (alpha, dropout and targets as the policy's)."""
    c = cfg.critic
    return dataclasses.replace(model_spec(cfg), path=c.path or cfg.model.path, lora_rank=c.lora_rank)


def build_critic_state(cfg: Config, placement: Any) -> Any:
    """The PPO critic (initialised from --critic.path or the policy) with its own optimizer and schedule."""
    from rlcore.trainer.algorithm import critic_optim, optimizer_spec, updates_per_run

    with _flags(cfg, "--critic.path"):
        spec, optimizer = critic_spec(cfg), optimizer_spec(critic_optim(cfg))
        return optim.critic_state(spec, optimizer, updates_per_run(cfg), placement)
