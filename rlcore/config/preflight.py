"""The pre-flight pass: every check of a config that needs no weights, run once before any model loads.

    validate(cfg, world_size=2)      # raises ConfigError: one line naming the flag, the value and the fix
    preflight(cfg, info)             # the shell's pass: validate, then the engine and the model's shape

Pairs of features that do not run together are one table (`rlcore.config.compatibility.CLASHES`), checked
first. Each `_check_*` looks at one part of the config; the algorithm's checks live beside its binding
(`rlcore.trainer.algorithm.check_algorithm`), the model's and the engine's beside their building
(`rlcore.config.model_checks.check_engine`, `check_mesh`; `check_context` runs once the prompts are
tokenized).
"""

from __future__ import annotations

import math
from pathlib import Path

from configs import Config, ConfigError
from rlcore.config.algo_checks import check_algorithm, need
from rlcore.config.compatibility import check_compatibility
from rlcore.dist.mesh import DistInfo


def preflight(cfg: Config, info: DistInfo) -> None:
    """The whole pass the shell runs before any weights load: the config's checks, the engine that can
    run here, and the model's shape against --trainer.tp / --trainer.sp (its config file only)."""
    from rlcore.config.model_checks import (
        check_engine,
        check_family,
        check_mesh,
        check_routing,
        check_vision,
    )

    validate(cfg, world_size=info.world_size)
    check_engine(cfg, info)
    check_mesh(cfg)
    check_routing(cfg)
    check_vision(cfg)
    check_family(cfg)


def validate(cfg: Config, *, world_size: int = 1) -> None:
    """Check a config before anything expensive; raise ConfigError naming the flag, value and fix."""
    check_compatibility(cfg)  # pairs of features first: each line then names the flags that clash
    _check_mesh(cfg, world_size)
    _check_pipeline(cfg, world_size)
    _check_observability(cfg)
    _check_batch(cfg, world_size)
    _check_rollout(cfg)
    check_algorithm(cfg)
    _check_update(cfg, world_size)
    _check_lora(cfg)
    _check_trainer(cfg)
    _check_files(cfg)


def roles(cfg: Config, world_size: int) -> dict[str, int]:
    """How many ranks share each role's batch: {"world size": W} colocated, else the rollout and
    trainer ranks of split placement."""
    if cfg.pipeline.placement != "split":
        peers = cfg.trainer.tp * cfg.trainer.sp
        if peers > 1:
            return {"data-parallel size (world size / tp / sp)": max(1, world_size // peers)}
        return {"world size": world_size}
    n, peers = cfg.pipeline.rollout_ranks, cfg.trainer.tp * cfg.trainer.sp
    if peers > 1:
        return {
            "number of rollout ranks": n,
            "trainer ranks' data-parallel size": max(1, (world_size - n) // peers),
        }
    return {"number of rollout ranks": n, "number of trainer ranks": world_size - n}


def _check_batch(cfg: Config, world_size: int) -> None:
    """--data.batch-size: positive and divisible by every role's rank count."""
    d = cfg.data
    need(d.batch_size >= 1, f"--data.batch-size {d.batch_size}: must be >= 1")
    for role, size in roles(cfg, world_size).items():
        need(
            d.batch_size % size == 0,
            f"--data.batch-size {d.batch_size} is not divisible by the {role} {size}: use a multiple of {size}",
        )


def _check_mesh(cfg: Config, world_size: int) -> None:
    """--trainer.tp / --trainer.sp: factors of the world (split: of the trainer ranks)."""
    from rlcore.dist.mesh import mesh_problem

    t = cfg.trainer
    for flag, n in (("tp", t.tp), ("sp", t.sp), ("ep", t.ep)):
        need(n >= 1, f"--trainer.{flag} {n}: must be >= 1 (1: off)")
    if t.ep > 1:
        _check_ep(cfg, world_size)
    if t.tp * t.sp == 1:
        return
    flags = " ".join(f"--trainer.{k} {n}" for k, n in (("tp", t.tp), ("sp", t.sp)) if n > 1)
    if cfg.pipeline.placement == "split":  # the trainer ranks' own mesh
        trainers = world_size - cfg.pipeline.rollout_ranks
        problem = mesh_problem(trainers, tp=t.tp, sp=t.sp)
        need(
            problem is None,
            f"{flags} with --pipeline.placement split: {problem} (the trainer ranks: {trainers})",
        )
    else:
        problem = mesh_problem(world_size, tp=t.tp, sp=t.sp)
        need(problem is None, f"{flags}: {problem}")


def _check_ep(cfg: Config, world_size: int) -> None:
    """--trainer.ep: with FSDP2 alone, dividing the ranks that train."""
    t = cfg.trainer
    from rlcore.models.lora import EXPERT_TARGETS

    m = cfg.model
    need(
        m.lora_rank == 0 or (bool(m.lora_targets) and not set(m.lora_targets) & set(EXPERT_TARGETS)),
        f"--trainer.ep {t.ep} with --model.lora-rank {m.lora_rank}: adapters on expert-parallel experts are not "
        "built; name linear targets (--model.lora-targets q_proj k_proj v_proj o_proj), or use ep 1",
    )
    split = cfg.pipeline.placement == "split"
    trainers = world_size - cfg.pipeline.rollout_ranks if split else world_size
    need(
        trainers % t.ep == 0,
        f"--trainer.ep {t.ep} does not divide the {'trainer ranks' if split else 'world size'} ({trainers}): "
        f"use an ep that does, under torchrun",
    )


def _check_pipeline(cfg: Config, world_size: int) -> None:
    """--pipeline.*: placement, modes and role threads that fit together."""
    p = cfg.pipeline
    if p.placement == "split":
        _check_split(cfg, world_size)
    for flag, threads in (("rollout-threads", p.rollout_threads), ("trainer-threads", p.trainer_threads)):
        need(threads >= 0, f"--pipeline.{flag} {threads}: must be >= 0 (0: torch's default)")
        need(
            threads == 0 or p.placement == "split",
            f"--pipeline.{flag} {threads}: only for --pipeline.placement split (else set OMP_NUM_THREADS)",
        )
    need(
        p.placement == "split" or p.rollout_ranks == 1,
        f"--pipeline.rollout-ranks {p.rollout_ranks}: only --pipeline.placement split has rollout ranks",
    )
    k = p.max_staleness
    need(k >= 0, f"--pipeline.max-staleness {k}: must be >= 0 (0 is synchronous)")
    need(
        k == 0 or cfg.algo.objective == "rl",
        f"--pipeline.max-staleness {k}: --algo.objective sft has no rollouts",
    )


def _check_split(cfg: Config, world_size: int) -> None:
    """--pipeline.placement split: at least one rank of each role, and rollouts to split."""
    n, p = cfg.pipeline.rollout_ranks, cfg.pipeline
    need(
        world_size > 1,
        "--pipeline.placement split needs at least 2 processes (torchrun --nproc_per_node 2 train.py ...: "
        "rollout ranks + trainer ranks); in one process use colocate",
    )
    need(
        1 <= n < world_size,
        f"--pipeline.rollout-ranks {n} with {world_size} processes: rollout ranks ({n}) + trainer ranks "
        f"({world_size - n}) must be {world_size} with at least 1 of each; use 1 <= N <= {world_size - 1}",
    )
    need(
        cfg.algo.objective == "rl",
        f"--pipeline.placement {p.placement}: --algo.objective sft has no rollouts; use colocate",
    )


def _check_observability(cfg: Config) -> None:
    """--trainer.hang-timeout-s, --trainer.preempt-grace-s, --log.samples, --trainer.profile-steps."""
    from rlcore.step.phases import profile_steps

    t = cfg.trainer
    need(t.hang_timeout_s >= 0, f"--trainer.hang-timeout-s {t.hang_timeout_s}: must be >= 0 (0: no watchdog)")
    need(
        t.preempt_grace_s > 0 and math.isfinite(t.preempt_grace_s),
        f"--trainer.preempt-grace-s {t.preempt_grace_s}: must be a number of seconds > 0",
    )
    need(cfg.log.samples >= 0, f"--log.samples {cfg.log.samples}: must be >= 0 (0: no samples.jsonl)")
    try:
        steps = profile_steps(t.profile_steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if steps is not None:
        need(
            steps[1] <= t.steps,
            f"--trainer.profile-steps {t.profile_steps}: the run has --trainer.steps {t.steps}",
        )


def _check_rollout(cfg: Config) -> None:
    """--rollout.*: sampling, turns, tools and the weight push's buckets."""
    from rlcore.rollout.agent.chat import TOOL_CALL_FORMATS

    r = cfg.rollout
    need(r.n >= 1, f"--rollout.n {r.n}: must be >= 1")
    need(r.max_tokens >= 1, f"--rollout.max-tokens {r.max_tokens}: must be >= 1")
    need(r.temperature >= 0, f"--rollout.temperature {r.temperature}: must be >= 0")
    need(0 < r.top_p <= 1, f"--rollout.top-p {r.top_p}: must be in (0, 1]")
    need(r.max_turns >= 1, f"--rollout.max-turns {r.max_turns}: must be >= 1 (1 is single-turn)")
    need(
        r.env_timeout_s > 0 and math.isfinite(r.env_timeout_s),
        f"--rollout.env-timeout-s {r.env_timeout_s}: must be a number of seconds > 0",
    )
    need(
        r.tool_format in TOOL_CALL_FORMATS,
        f"--rollout.tool-format {r.tool_format!r}: choose one of {sorted(TOOL_CALL_FORMATS)}",
    )
    need(
        cfg.algo.router_aux_coef >= 0 and math.isfinite(cfg.algo.router_aux_coef),
        f"--algo.router-aux-coef {cfg.algo.router_aux_coef}: must be a number >= 0",
    )
    need(
        r.sync_bucket_mb > 0 and math.isfinite(r.sync_bucket_mb),
        f"--rollout.sync-bucket-mb {r.sync_bucket_mb}: must be a number of MiB > 0",
    )


def _check_update(cfg: Config, world_size: int) -> None:
    """--algo's update shape (mini- and micro-batches, epochs) and --optim.lr."""
    a, d = cfg.algo, cfg.data
    if a.mini_batch_size is not None:
        need(
            a.mini_batch_size >= 1 and d.batch_size % a.mini_batch_size == 0,
            f"--algo.mini-batch-size {a.mini_batch_size} does not divide --data.batch-size {d.batch_size}: "
            f"use a divisor of {d.batch_size}",
        )
        trainers = list(roles(cfg, world_size).values())[-1]  # the ranks that train
        need(
            a.mini_batch_size % trainers == 0,
            f"--algo.mini-batch-size {a.mini_batch_size} is not divisible by the number of training ranks ({trainers})",
        )
    need(a.ppo_epochs >= 1, f"--algo.ppo-epochs {a.ppo_epochs}: must be >= 1")
    need(a.micro_batch_size >= 1, f"--algo.micro-batch-size {a.micro_batch_size}: must be >= 1")
    need(cfg.optim.lr is None or cfg.optim.lr > 0, f"--optim.lr {cfg.optim.lr}: must be > 0")


def _check_lora(cfg: Config) -> None:
    """--model.lora-* and --critic.lora-rank."""
    m = cfg.model
    need(m.lora_rank >= 0, f"--model.lora-rank {m.lora_rank}: must be >= 1 (or 0: no LoRA)")
    need(
        cfg.critic.lora_rank >= 0, f"--critic.lora-rank {cfg.critic.lora_rank}: must be >= 1 (or 0: no LoRA)"
    )
    if m.lora_rank == 0:
        return
    need(m.lora_alpha > 0, f"--model.lora-alpha {m.lora_alpha}: must be > 0")
    need(0 <= m.lora_dropout < 1, f"--model.lora-dropout {m.lora_dropout}: must be in [0, 1)")


def _check_trainer(cfg: Config) -> None:
    """--trainer's length and cadences."""
    t = cfg.trainer
    need(t.steps >= 1, f"--trainer.steps {t.steps}: must be >= 1")
    for flag, value in (("--trainer.val-every", t.val_every), ("--trainer.save-every", t.save_every)):
        need(value >= 0, f"{flag} {value}: must be >= 0 (0 turns it off)")
    need(t.keep_last >= 1, f"--trainer.keep-last {t.keep_last}: must be >= 1")


def _check_files(cfg: Config) -> None:
    """--out-dir, --reward.custom, --data.*-files and --resume name things that can exist."""
    from rlcore.data.sources import check_sources_exist

    d = cfg.data
    need(
        cfg.out_dir is None or not Path(cfg.out_dir).exists() or Path(cfg.out_dir).is_dir(),
        f"--out-dir {cfg.out_dir}: exists and is not a directory; give a new or an existing run directory",
    )
    if cfg.reward.custom is not None:
        path = cfg.reward.custom.rsplit(":", 1)[0]
        need(
            ":" in cfg.reward.custom,
            f"--reward.custom {cfg.reward.custom!r}: write it as path/to/file.py:function",
        )
        need(Path(path).is_file(), f"--reward.custom {cfg.reward.custom!r}: file {path} not found")
    for flag, sources in (("--data.train-files", d.train_files), ("--data.val-files", d.val_files)):
        problem = check_sources_exist(sources, flag) if sources else None
        need(problem is None, problem or "")
    need(bool(d.train_files), "--data.train-files: give at least one file or builtin:<task>")
    need(
        cfg.resume in ("auto", "none") or Path(cfg.resume).is_dir(),
        f"--resume {cfg.resume!r}: use auto, none, or an existing checkpoint directory",
    )
