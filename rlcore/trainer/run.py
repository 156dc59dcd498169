"""The training run as a short story: build → loop → close. Used by train.py.

    state, handles, algorithm, plan = build(cfg)
    state = checkpoints.resume(state, handles)                     # --resume auto|none|PATH
    state, metrics = train_step(state, handles, algorithm, plan)  # one step, a new TrainState

`TrainState` (rlcore.state) is everything a step changes; `Handles` are what a step uses but does not
change (the engine, the reward scorer, the datasets, the logger, the mesh, the frozen reference);
`Algorithm` (rlcore.algorithm) is the run's pure callables and `StepPlan` (rlcore.plan) the numbers
around them, both bound once from the config (`rlcore.trainer.algorithm.bind`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from configs import Config, ConfigError, resolved, validate
from rlcore.algorithm import Algorithm
from rlcore.data.dataset import Cursor, PromptDataset
from rlcore.data.rows import DataError
from rlcore.data.sources import read_sources
from rlcore.dist.mesh import close_distributed, group_rank, group_size, init_distributed
from rlcore.dist.placement import as_world, place
from rlcore.dist.reduce import all_reduce_int, reduce_metrics
from rlcore.plan import StepPlan
from rlcore.rewards.custom import RewardSpecError
from rlcore.rewards.dispatch import find_reward
from rlcore.rewards.pool import RewardError, RewardScorer
from rlcore.rollout.env import EnvSpecError
from rlcore.state import Rollout, TrainState
from rlcore.trainer import agents, checkpoints, faults, models, signals, split
from rlcore.trainer.algorithm import bind
from rlcore.trainer.collect import fill, staleness, step_seed, this_rank
from rlcore.trainer.errors import StopRun, reason
from rlcore.trainer.handles import Handles, Outbox
from rlcore.trainer.health import check_health
from rlcore.trainer.learn import TrainingDiverged, check_bad_updates, learn
from rlcore.trainer.logger import MetricsLogger, gpu_free_mb, read_metrics
from rlcore.trainer.phases import (
    StepProfiler,
    Watchdog,
    at_step,
    current_step,
    phase,
    profile_steps,
    watching,
)
from rlcore.trainer.plots import plot_curves
from rlcore.trainer.samples import SampleWriter
from rlcore.trainer.sft import sft_batch
from rlcore.trainer.validation import val_due, validate_policy
from rlcore.update import update_step

USER_ERRORS = (ConfigError, DataError, RewardSpecError, EnvSpecError)
__all__ = ["Handles", "TrainingDiverged", "build", "run", "step_seed", "train_step"]


def run(cfg: Config) -> int:
    """Train to the end; user errors print one line and return 2, a diverged run 3."""
    cfg = resolved(cfg)  # defaults that depend on other flags (the LoRA learning rate)
    try:
        state, h, algorithm, plan = build(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        close_distributed()
        return 2
    except KeyboardInterrupt:
        print("interrupted while starting; nothing was trained", file=sys.stderr)
        close_distributed()
        return signals.EXIT_INTERRUPTED
    checkpoint_dir = h.out_dir / "checkpoints"
    try:
        with signals.handling(grace_s=cfg.trainer.preempt_grace_s, newest=lambda: checkpoints.newest(checkpoint_dir),
                              at_once=h.placement.split):  # fmt: skip
            state = loop(state, h, algorithm, plan)
        faults.dump_state(state, h, models.engine_holds)  # test-only (RLCORE_TEST_DUMP_STATE)
    except StopRun as e:  # disk trouble, an unusable checkpoint: the user's to fix
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except RewardError as e:  # the step stops before the update that would have used the scores
        print(f"error: step {current_step()}: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except signals.Preempted as e:
        print(str(e), file=sys.stderr, flush=True)
        return signals.EXIT_PREEMPTED
    except signals.Terminated as e:
        print(f"{e} at step {current_step()} (split placement stops at once); the newest checkpoint is "
              f"{checkpoints.newest(checkpoint_dir)}; continue with --resume auto", file=sys.stderr, flush=True)  # fmt: skip
        return signals.EXIT_PREEMPTED
    except KeyboardInterrupt:
        signals.exit_at_once_on_sigint()
        if h.placement.writes:
            checkpoints.discard_partial(checkpoint_dir)
        print(f"interrupted at step {current_step()}; the newest checkpoint is {checkpoints.newest(checkpoint_dir)}; "
              "continue with --resume auto", file=sys.stderr, flush=True)  # fmt: skip
        return signals.EXIT_INTERRUPTED
    finally:
        if h.scorer is not None:
            h.scorer.close()
        h.logger.close()
        if h.engine is not None:  # vLLM: its engine and process groups (also under AgentEngine)
            h.engine.close()
        close_distributed()
    return 0


# ---------------------------------------------------------------- build


def build(cfg: Config) -> tuple[TrainState, Handles, Algorithm, StepPlan]:
    try:
        info = init_distributed(cfg.trainer.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    validate(cfg, world_size=info.world_size)
    models.check_engine(cfg, info)
    models.check_mesh(cfg)
    agent_files = agents.load_agent_files(cfg)  # a bad env / tools file stops here, before any model loads
    p = cfg.pipeline
    placement = place(info, split=p.placement == "split", rollout_ranks=p.rollout_ranks, tp=cfg.trainer.tp,
                      sp=cfg.trainer.sp)  # fmt: skip
    dist, mesh, trains, generates = placement.local, placement.mesh, placement.trains, placement.generates
    threads = {"trainer": p.trainer_threads, "rollout": p.rollout_threads}.get(placement.role, 0)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.trainer.seed)
    algorithm, plan = bind(cfg)
    out_dir = Path(cfg.out_dir or f"runs/{cfg.preset}-{datetime.now():%Y%m%d-%H%M%S}")
    tokenizer = models.tokenizer_of(cfg)
    train_ds, val_ds = _datasets(cfg, tokenizer, agents.prompt_tools(agent_files, tokenizer))
    models.check_context(cfg, {ds.name: ds.prompt_lengths() for ds in (train_ds, val_ds) if ds is not None})
    # a rollout rank of split placement loads the engine's own copy of the policy instead
    model = models.build_policy(cfg, placement) if trains else models.build_engine_copy(cfg, dist)
    sources = sorted({row.data_source for ds in (train_ds, val_ds) if ds is not None for row in ds.rows})
    r = cfg.reward
    if cfg.rollout.env is not None:  # an env scores its episodes: a reward function only where one exists
        sources = [s for s in sources if find_reward(s) is not None]
    scorer = RewardScorer(r.custom, data_sources=sources, num_workers=r.num_workers, timeout_s=r.timeout_s,
                          failure_score=r.failure_score, max_error_rate=r.max_error_rate,
                          math_verifier=r.math_verifier) if generates else None  # fmt: skip
    needs_ref = plan.needs_ref and trains
    ref_model = models.build_reference(cfg, placement) if needs_ref else None
    actor = models.build_state(cfg, model, dist) if trains else None
    engine = None
    if generates:  # an in-process vLLM takes the default group as its world: there, the rollout ranks
        with as_world(placement.rollouts if cfg.rollout.engine == "vllm" else None):
            engine = models.build_engine(cfg, model, tokenizer, dist)
        engine = agents.agent_engine(cfg, engine, tokenizer, agent_files)
    critic = models.build_critic_state(cfg, placement) if algorithm.needs_critic and trains else None
    if placement.writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    logger = MetricsLogger(out_dir, total_steps=cfg.trainer.steps, enabled=placement.writes, wandb_mode=cfg.log.wandb,
                           wandb_project=cfg.log.project, run_name=out_dir.name, config=dataclasses.asdict(cfg),
                           progress=cfg.log.progress)  # fmt: skip
    report_data(cfg, train_ds, val_ds, logger, prints=placement.writes)
    if actor is not None:  # what trains (a LoRA policy: the adapters) and what the optimizer holds
        logger.once(parameter_counts(actor))
    samples = SampleWriter(out_dir, tokenizer, k=cfg.log.samples if placement.writes else 0,
                           wandb_run=logger.wandb_run)  # fmt: skip
    state = TrainState(actor=actor, critic=critic, kl_coef=cfg.algo.kl_coef, cursor=Cursor())
    h = Handles(cfg=cfg, out_dir=out_dir, placement=placement, dist=dist, mesh=mesh, tokenizer=tokenizer,
                train_ds=train_ds, val_ds=val_ds, scorer=scorer, engine=engine, ref_model=ref_model, logger=logger,
                samples=samples,
                outbox=Outbox() if placement.role == "trainer" else None)  # fmt: skip
    return state, h, algorithm, plan


def _datasets(
    cfg: Config, tokenizer: Any, tools: tuple[dict, ...]
) -> tuple[PromptDataset, PromptDataset | None]:
    d, seed = cfg.data, cfg.trainer.seed
    common = {"max_prompt_length": d.max_prompt_length, "overlong": d.overlong, "tools": tools}
    optional = cfg.rollout.env is not None  # an env's first observation can be the first user turn
    rows = read_sources(d.train_files, split="train", builtin_size=d.builtin_train_size, seed=seed,
                        prompt_optional=optional)  # fmt: skip
    train = PromptDataset(rows, tokenizer, seed=seed, name="--data.train-files", **common)
    val = None
    if d.val_files:
        rows = read_sources(d.val_files, split="val", builtin_size=d.builtin_val_size, seed=seed,
                            prompt_optional=optional)  # fmt: skip
        val = PromptDataset(rows, tokenizer, seed=seed, shuffle=False, name="--data.val-files", **common)
    return train, val


def parameter_counts(actor: Any) -> dict[str, float]:
    """`model/params`, `model/trainable_params` and `model/optimizer_params` (whole tensors, sharded or not)."""
    params = list(actor.model.parameters())
    held = [p for group in actor.optimizer.param_groups for p in group["params"]]
    return {
        "model/params": float(sum(p.numel() for p in params)),
        "model/trainable_params": float(sum(p.numel() for p in params if p.requires_grad)),
        "model/optimizer_params": float(sum(p.numel() for p in held)),
    }


def report_data(cfg: Config, train: PromptDataset, val: PromptDataset | None, logger: MetricsLogger, *,
                prints: bool) -> None:  # fmt: skip
    """One `data:` line per file set (rows, prompts dropped for length, prompt-length percentiles) on
    stdout (stderr keeps warnings and errors), and the dropped counts as `data/train_dropped` / `data/val_dropped` in the first record."""
    sets = {"train": (train, cfg.data.train_files), "val": (val, cfg.data.val_files)}
    for key, (ds, files) in sets.items():
        if ds is None:
            continue
        if prints:
            print(f"data: {ds.name} {' '.join(files)}: {ds.report()}", flush=True)
        logger.once({f"data/{key}_dropped": float(ds.n_dropped)})


# ---------------------------------------------------------------- loop


def loop(state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan) -> TrainState:
    """The training loop; on a rollout rank of split placement, the rollout loop that feeds it. Both run
    under the hang watchdog (--trainer.hang-timeout-s)."""
    with watching(_watchdog(h.cfg)):
        if not h.placement.trains:
            return split.rollout_loop(state, h, algorithm, validate=_validation)
        return _train_loop(state, h, algorithm, plan)


def _watchdog(cfg: Config) -> Watchdog | None:
    if cfg.trainer.hang_timeout_s <= 0:
        return None
    return Watchdog(cfg.trainer.hang_timeout_s, rank=group_rank(), world=group_size())


def _train_loop(state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan) -> TrainState:
    cfg = h.cfg
    state = checkpoints.resume(state, h)
    start_engine(state, h)
    if state.step == 0 and val_due(h, 0):
        with phase("validation"):
            h.logger.log(0, _validation(h, 0))
    h.logger.begin(state.step)
    profiler = StepProfiler(profile_steps(cfg.trainer.profile_steps), h.out_dir, group_rank())
    last_finite = {}
    while state.step < cfg.trainer.steps:
        at_step(state.step + 1)
        profiler.before(state.step + 1)
        state, metrics = train_step(state, h, algorithm, plan)
        step = state.step
        update = {k: v for k, v in metrics.items() if k.startswith("actor/")}
        last_finite = check_bad_updates(
            state.bad_updates, step, update, last_finite, limit=cfg.trainer.max_bad_updates
        )
        health, checked, warnings = check_health(state.health, metrics, step=step, engine=cfg.rollout.engine,
                                                 dtype=_gap_dtype(cfg), max_tokens=cfg.rollout.max_tokens)  # fmt: skip
        state, metrics = dataclasses.replace(state, health=health), metrics | checked
        if h.placement.writes:
            for line in warnings:
                print(line, file=sys.stderr, flush=True)
        if val_due(h, step):
            with phase("validation"):
                metrics |= _validation(h, step)
        profiler.after(step)
        h.logger.log(step, metrics)
        saved = checkpoints.save_due(cfg, step)
        if saved:
            with phase("checkpoint"):
                checkpoints.save(state, h)
        if not h.placement.split and signals.preempt_requested():  # every rank alike: a reduced flag
            _preempted(state, h, saved=saved)
    if h.outbox is not None:  # stream mode: the rollout ranks take the last pushes
        h.outbox.flush()
    _finish(state, h)
    return state


def _preempted(state: TrainState, h: Handles, *, saved: bool) -> None:
    """A preemption signal reached some rank: the finished step's checkpoint (unless just written), then
    `Preempted` (exit 143)."""
    if not saved:
        with phase("checkpoint"):
            checkpoints.save(state, h)
    raise signals.Preempted(state.step, h.out_dir / "checkpoints" / f"step_{state.step}")


def train_step(
    state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan
) -> tuple[TrainState, dict[str, float]]:
    """Rollout and rewards, then (the engine asleep) log-probs, advantages and updates, then weight sync."""
    if h.cfg.algo.objective == "sft":
        return sft_step(state, h, algorithm, plan)
    started, step = time.perf_counter(), state.step + 1
    rollout, state, metrics = next_rollout(state, h, algorithm)
    batch = rollout.batch
    metrics |= dict(rollout.metrics) | staleness(rollout.batch, state.policy_version)
    faults.kill_point(step, "rollout")  # test-only fault injection (RLCORE_TEST_KILL_AT)
    batch = batch[: all_reduce_int(len(batch), h.mesh, op="min")]  # dynamic sampling: equal groups per rank
    if len(batch) == 0:  # no group with a signal on some rank: every rank skips the step together
        if h.placement.split:  # the rollout ranks move on to the next step (the weights did not change)
            split.push_weights(None, h, step=step, version=state.policy_version, bucket_bytes=1)
        return dataclasses.replace(state, step=step), {
            "train/empty_step": 1.0,
            "timing/step_s": time.perf_counter() - started,
        }
    if h.engine is not None:
        free = gpu_free_mb()
        h.engine.sleep()
        if free is not None:  # CUDA: what the engine's sleep gave back to the device (vLLM's pools too)
            metrics["perf/gpu_sleep_freed_mb"] = gpu_free_mb() - free
    try:
        state, learned, batch = learn(state, h, algorithm, plan, batch)
        h.samples.write(step, batch)
        faults.kill_point(step, "update")
    finally:
        if h.engine is not None:
            h.engine.wake()
    with phase("sync"):
        state, synced = push(state, h, step=step)
    seconds = time.perf_counter() - started
    tokens = batch["attention_mask"].sum() + batch["response_attention"].sum()
    metrics |= learned | synced | {"timing/step_s": seconds, "throughput/tokens_per_s": tokens / seconds}
    return dataclasses.replace(state, step=step), reduce_metrics(
        {k: float(v) for k, v in metrics.items()}, h.mesh
    )


def sft_step(
    state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan
) -> tuple[TrainState, dict[str, float]]:
    """One supervised step (objective sft): teacher-forced targets, NLL through the update loop."""
    started, step = time.perf_counter(), state.step + 1
    drawn, cursor = h.train_ds.take(state.cursor, plan.batch_size)
    batch = sft_batch(this_rank(h, drawn), h.tokenizer)
    teacher_forced = dataclasses.replace(algorithm, on_policy=False)
    actor, metrics = update_step(
        state.actor, batch, teacher_forced, plan.actor, mesh=h.mesh, horizon=plan.horizon
    )
    metrics["sft/nll"] = metrics["actor/pg_loss"]
    metrics["response/length_mean"] = float(batch["response_mask"].sum(-1).float().mean())
    state, synced = push(
        dataclasses.replace(state, actor=actor, cursor=cursor), h, step=step
    )  # validation samples the engine
    metrics |= synced | {"timing/step_s": time.perf_counter() - started}
    return dataclasses.replace(state, step=step), reduce_metrics(metrics, h.mesh)


def next_rollout(
    state: TrainState, h: Handles, algorithm: Algorithm
) -> tuple[Rollout, TrainState, dict[str, float]]:
    """The batch of the next step: generated here (with up to K more ahead, lag mode), or, on a trainer
    rank of split placement, received from the rollout ranks (`pipeline/trainer_idle_s`: the wait)."""
    if h.placement.split:
        rollout, waited = split.receive_rollout(state, h)
        return rollout, state, {"pipeline/trainer_idle_s": waited}
    state = fill(state, h, algorithm)
    return state.pending[0], dataclasses.replace(state, pending=state.pending[1:]), {}


def push(state: TrainState, h: Handles, *, step: int) -> tuple[TrainState, dict[str, float]]:
    """The actor's weights after `step` steps into the engine (one update of it; under split placement
    to the rollout ranks' engines); the state with the next policy version."""
    started, version, bucket = time.perf_counter(), state.policy_version + 1, models.sync_bucket_bytes(h.cfg)
    if h.placement.split:
        metrics = split.push_weights(state.actor.model, h, step=step, version=version, bucket_bytes=bucket)
    else:
        metrics = models.push_weights(state.actor.model, h.engine, bucket_bytes=bucket)
    metrics["timing/sync_s"] = time.perf_counter() - started
    return dataclasses.replace(state, policy_version=version), metrics


def start_engine(state: TrainState, h: Handles) -> None:
    """The engine starts from the policy's weights (restored ones after a resume): not a new version."""
    bucket = models.sync_bucket_bytes(h.cfg)
    if h.placement.split:
        split.push_weights(
            state.actor.model, h, step=state.step, version=state.policy_version, bucket_bytes=bucket
        )
    else:
        models.push_weights(state.actor.model, h.engine, bucket_bytes=bucket)


def _gap_dtype(cfg: Config) -> str:
    """The dtype whose rollout/trainer gap bound applies: bf16 when either side computes in bf16."""
    return "bfloat16" if "bfloat16" in (cfg.model.dtype, cfg.model.compute_dtype) else "float32"


def _validation(h: Handles, step: int) -> dict[str, float]:
    """The engine's policy on the validation set (on a trainer rank of split placement: what rollout
    rank 0 measured, received by the leader)."""
    if h.engine is None:
        return split.receive_validation(h)
    assert h.val_ds is not None
    return validate_policy(h.engine, h.val_ds, h.scorer, h.tokenizer, max_tokens=h.cfg.rollout.max_tokens,
                           k=h.cfg.rollout.val_n, seed=step_seed(h.cfg.trainer.seed, step, "val"),
                           samples=lambda batch: h.samples.write(step, batch, validation=True))  # fmt: skip


def _finish(state: TrainState, h: Handles) -> None:
    """out_dir/final (the HF directory) and curves.png; a full disk here is one line, exit 2."""
    from safetensors import SafetensorError

    try:
        models.save_final(
            state.actor.model, h.tokenizer, h.out_dir, group=h.placement.trainers, base=h.cfg.model.path
        )
        if h.placement.writes:
            records = read_metrics(h.out_dir / "metrics.jsonl")
            plot_curves(records, h.out_dir / "curves.png", title=f"{h.cfg.preset}: {h.cfg.model.path}")
    except (OSError, SafetensorError) as e:
        raise StopRun(
            f"cannot write the final model or curves under {h.out_dir} ({reason(e)}); free disk space, then "
            f"rerun with --resume auto (training is done; checkpoints, if any, are intact)"
        ) from None
