"""The training run: build every piece from a Config, loop over steps, close. Used by train.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from configs import Config, ConfigError, validate
from rlcore.batch import Batch
from rlcore.data.dataset import PromptDataset
from rlcore.data.prompts import pad_token_id
from rlcore.data.rows import DataError
from rlcore.data.sources import read_sources
from rlcore.dist.mesh import close_distributed
from rlcore.dist.reduce import all_reduce, reduce_metrics
from rlcore.pure.kl import adaptive_kl_coef
from rlcore.rewards.custom import RewardSpecError
from rlcore.rewards.pool import RewardScorer
from rlcore.rewards.step import OverlongPenalty
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.vllm_engine import logprob_gap  # vllm itself is imported lazily
from rlcore.steps import (
    advantage_step,
    concat_rollouts,
    filter_groups,
    logprob_step,
    rollout_step,
    score_step,
)
from rlcore.trainer import checkpoints, faults
from rlcore.trainer.errors import StopRun, reason
from rlcore.trainer.logger import MetricsLogger, read_metrics
from rlcore.trainer.plots import plot_curves
from rlcore.trainer.validation import validate_policy

USER_ERRORS = (ConfigError, DataError, RewardSpecError)


@dataclass(kw_only=True)
class Pieces:
    """Everything a run holds between steps (handles, not logic)."""

    cfg: Config
    out_dir: Path
    dist: Any
    mesh: Any
    tokenizer: Any
    train_ds: PromptDataset
    val_ds: PromptDataset | None
    scorer: RewardScorer
    engine: Any
    state: Any
    critic: Any
    ref_model: Any
    logger: MetricsLogger
    kl_coef: float
    last_finite: dict[str, float] = dataclasses.field(default_factory=dict)


def run(cfg: Config) -> int:
    """Train to the end; user errors print one line and return 2."""
    try:
        pieces = build(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        close_distributed()
        return 2
    try:
        loop(pieces)
        _dump_state(pieces)  # test-only (RLCORE_TEST_DUMP_STATE)
    except StopRun as e:  # disk trouble, an unusable checkpoint: the user's to fix
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:
        pieces.scorer.close()
        pieces.logger.close()
        if hasattr(pieces.engine, "close"):  # vLLM: its engine and process groups (also under AgentEngine)
            pieces.engine.close()
        close_distributed()
    return 0


def _dump_state(p: Pieces) -> None:
    """RLCORE_TEST_DUMP_STATE: every rank writes the run state that must agree across ranks."""
    import os

    from rlcore.trainer.models import engine_holds

    directory = os.environ.get("RLCORE_TEST_DUMP_STATE")
    if directory:
        state = {"step": p.state.step, "kl_coef": p.kl_coef, "data": p.train_ds.state_dict(),
                 "bad_updates": p.state.bad_updates}  # fmt: skip
        faults.dump_state(directory, p.dist.rank, state, engine_holds(p.state.model, p.engine))


# ---------------------------------------------------------------- build


def step_seed(seed: int, step: int, what: str) -> int:
    """A sampling seed that depends on (seed, step, what) only, so resumed runs sample identically."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{step}:{what}".encode(), digest_size=7).digest(), "little")


def build(cfg: Config) -> Pieces:
    from rlcore.dist.mesh import build_mesh, init_distributed
    from rlcore.trainer.models import (
        build_critic_state,
        build_engine,
        build_policy,
        build_reference,
        build_state,
        check_engine,
    )

    try:
        dist = init_distributed(cfg.trainer.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    validate(cfg, world_size=dist.world_size)
    check_engine(cfg, dist)
    mesh = build_mesh(dist)
    torch.manual_seed(cfg.trainer.seed)
    out_dir = Path(cfg.out_dir or f"runs/{cfg.preset}-{datetime.now():%Y%m%d-%H%M%S}")
    model, tokenizer = build_policy(cfg, dist, mesh)
    train_ds, val_ds = _datasets(cfg, tokenizer)
    sources = sorted({*train_ds_sources(train_ds), *(train_ds_sources(val_ds) if val_ds else ())})
    r = cfg.reward
    scorer = RewardScorer(
        r.custom,
        data_sources=sources,
        num_workers=r.num_workers,
        timeout_s=r.timeout_s,
        failure_score=r.failure_score,
        max_error_rate=r.max_error_rate,
    )
    needs_ref = cfg.algo.kl_coef > 0 or cfg.algo.use_kl_loss
    ref_model = build_reference(cfg, dist, mesh) if needs_ref else None
    state = build_state(cfg, model, dist)
    engine = build_engine(cfg, model, tokenizer, dist, mesh)
    critic = build_critic_state(cfg, dist, mesh) if cfg.algo.adv_estimator == "gae" else None
    if dist.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    logger = MetricsLogger(
        out_dir,
        total_steps=cfg.trainer.steps,
        enabled=dist.rank == 0,
        wandb_mode=cfg.log.wandb,
        wandb_project=cfg.log.project,
        run_name=out_dir.name,
        config=dataclasses.asdict(cfg),
        progress=cfg.log.progress,
    )
    return Pieces(
        cfg=cfg, out_dir=out_dir, dist=dist, mesh=mesh, tokenizer=tokenizer, train_ds=train_ds, val_ds=val_ds,
        scorer=scorer, engine=engine, state=state, critic=critic, ref_model=ref_model, logger=logger, kl_coef=cfg.algo.kl_coef,
    )  # fmt: skip


def train_ds_sources(ds: PromptDataset) -> list[str]:
    return sorted({row.data_source for row in ds.rows})


def _datasets(cfg: Config, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    d, seed = cfg.data, cfg.trainer.seed
    common = {"max_prompt_length": d.max_prompt_length, "overlong": d.overlong}
    rows = read_sources(d.train_files, split="train", builtin_size=d.builtin_train_size, seed=seed)
    train = PromptDataset(rows, tokenizer, seed=seed, name="--data.train-files", **common)
    val = None
    if d.val_files:
        rows = read_sources(d.val_files, split="val", builtin_size=d.builtin_val_size, seed=seed)
        val = PromptDataset(rows, tokenizer, seed=seed, shuffle=False, name="--data.val-files", **common)
    return train, val


# ---------------------------------------------------------------- loop


def loop(p: Pieces) -> None:
    cfg = p.cfg
    start = checkpoints.maybe_resume(p)
    from rlcore.trainer.models import sync_weights

    sync_weights(p)  # the engine starts from the policy's weights (restored ones after a resume)
    if start == 0 and p.val_ds is not None and cfg.trainer.val_every > 0:
        p.logger.log(0, _validation(p, 0))
    for step in range(start + 1, cfg.trainer.steps + 1):
        metrics = train_step(p, step)
        if step == start + 1:  # the first step this process trains: is the engine's policy the trainer's?
            _check_gap(p, step, metrics)
        last = step == cfg.trainer.steps
        every = cfg.trainer.val_every
        if p.val_ds is not None and every > 0 and (step % every == 0 or last):
            metrics |= _validation(p, step)
        p.logger.log(step, metrics)
        if cfg.trainer.save_every > 0 and (step % cfg.trainer.save_every == 0 or last):
            checkpoints.save(p, step)
    _finish(p)


def _check_gap(p: Pieces, step: int, metrics: dict[str, float]) -> None:
    """One `warning:` line when the rollout/trainer gap (max over ranks) is above the dtype's bound."""
    from rlcore.dist.reduce import all_reduce
    from rlcore.trainer.health import gap_warning

    local = metrics.get("rollout/logprob_diff_max", 0.0)  # absent: sft, or every step of a rank empty
    gap = float(all_reduce(torch.tensor(local, device=p.dist.device), p.mesh, op="max"))
    line = gap_warning(gap, engine=p.cfg.rollout.engine, dtype=p.cfg.model.dtype, step=step)
    if line and p.dist.rank == 0:
        print(line, file=sys.stderr, flush=True)


def _validation(p: Pieces, step: int) -> dict[str, float]:
    cfg = p.cfg
    assert p.val_ds is not None
    return validate_policy(
        p.engine,
        p.val_ds,
        p.scorer,
        p.tokenizer,
        max_tokens=cfg.rollout.max_tokens,
        k=cfg.rollout.val_n,
        seed=step_seed(cfg.trainer.seed, step, "val"),
    )


def _sampling(cfg: Config, step: int, round_: int = 0, rank: int = 0) -> SamplingParams:
    """Step `step`'s sampling; each rank draws its own stream (its prompts are not another rank's)."""
    r = cfg.rollout
    return SamplingParams(
        n=r.n,
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=step_seed(cfg.trainer.seed, step, f"train{round_}" + (f"/rank{rank}" if rank else "")),
    )


def _overlong(cfg: Config) -> OverlongPenalty | None:
    r = cfg.reward
    if r.overlong_buffer_length <= 0:
        return None
    return OverlongPenalty(
        buffer_length=r.overlong_buffer_length,
        penalty_factor=r.overlong_penalty_factor,
        max_length=cfg.rollout.max_tokens,
    )


def collect(p: Pieces, step: int) -> tuple[Batch, dict[str, torch.Tensor]]:
    """Rollout + rewards for one step; with dynamic sampling, more rounds until every rank's share of the
    batch is full (decided over all ranks, so every rank draws the same global batches)."""
    from rlcore.dist.reduce import all_reduce_int

    cfg, wanted = p.cfg, p.cfg.data.batch_size
    share = wanted // p.dist.world_size  # this rank's prompts
    kept: list[Batch] = []
    metrics: dict[str, torch.Tensor] = {}
    rounds = cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 1
    groups_seen = groups_kept = 0
    for round_ in range(rounds):
        prompts = _this_rank(p, p.train_ds.next_batch(wanted))
        batch, m = rollout_step(p.engine, prompts, _sampling(cfg, step, round_, p.dist.rank))
        batch, rm = score_step(p.scorer, batch, tokenizer=p.tokenizer, overlong=_overlong(cfg))
        if cfg.algo.adv_estimator == "remax":
            batch = batch.with_(baseline_rewards=_greedy_baseline(p, prompts, step))
        if round_ == 0:
            metrics |= m | rm
            metrics["train/reward_mean"] = batch["token_scores"].sum(-1).mean()
        if not cfg.algo.dynamic_sampling:
            return batch, metrics
        batch, n_kept, n_seen = filter_groups(batch)
        groups_seen, groups_kept = groups_seen + n_seen, groups_kept + n_kept
        kept.append(batch)
        if all_reduce_int(groups_kept, p.mesh, op="min") >= share:  # every rank is full
            break
    batch = concat_rollouts(kept, pad_token_id(p.tokenizer)) if len(kept) > 1 else kept[0]
    batch = batch[: min(len(batch), share * cfg.rollout.n)]
    seen, kept_all = all_reduce_int(groups_seen, p.mesh), all_reduce_int(groups_kept, p.mesh)
    metrics["train/groups_drawn"] = torch.tensor(float(seen))  # over all ranks
    metrics["train/groups_kept_frac"] = torch.tensor(kept_all / max(seen, 1))
    return batch, metrics


def _this_rank(p: Pieces, prompts: Batch) -> Batch:
    """SPMD data parallelism: every rank draws the same global batch and keeps its own slice of prompts."""
    per = len(prompts) // p.dist.world_size
    return prompts[p.dist.rank * per : (p.dist.rank + 1) * per]


def _greedy_baseline(p: Pieces, prompts: Batch, step: int) -> torch.Tensor:
    """ReMax: the reward of each prompt's greedy response, repeated for its n samples.  # (b * n,)"""
    greedy = SamplingParams(n=1, max_tokens=p.cfg.rollout.max_tokens, temperature=0.0)
    batch, _ = score_step(
        p.scorer, p.engine.generate(prompts, greedy), tokenizer=p.tokenizer, overlong=_overlong(p.cfg)
    )
    return batch["token_scores"].sum(-1).repeat_interleave(p.cfg.rollout.n)


def sft_step(p: Pieces, step: int) -> dict[str, float]:
    """One supervised step (the sft preset): teacher-forced targets, NLL through update_step."""
    from rlcore.trainer.sft import sft_batch
    from rlcore.update import update_step

    cfg, started = p.cfg, time.perf_counter()
    batch = sft_batch(_this_rank(p, p.train_ds.next_batch(cfg.data.batch_size)), p.tokenizer)
    p.state, metrics = update_step(
        p.state, batch, cfg.algo, cfg.optim, mesh=p.mesh, horizon=cfg.rollout.max_tokens
    )
    metrics["sft/nll"] = metrics["actor/pg_loss"]
    metrics["response/length_mean"] = float(batch["response_mask"].sum(-1).float().mean())
    metrics |= _sync(p)  # validation samples from the engine: it must hold the trained weights
    metrics["timing/step_s"] = time.perf_counter() - started
    return reduce_metrics(metrics, p.mesh)


def _sync(p: Pieces) -> dict[str, float]:
    """Push the actor's weights into the engine; `sync/*` and `timing/sync_s`."""
    from rlcore.trainer.models import sync_weights

    started = time.perf_counter()
    return sync_weights(p) | {"timing/sync_s": time.perf_counter() - started}


def train_step(p: Pieces, step: int) -> dict[str, float]:
    """Rollout and rewards, then (the engine asleep) log-probs, advantages and updates, then weight sync."""
    if p.cfg.preset == "sft":
        return sft_step(p, step)
    started = time.perf_counter()
    batch, metrics = collect(p, step)
    faults.kill_point(step, "rollout")  # test-only fault injection (RLCORE_TEST_KILL_AT)
    batch = batch[: _fewest_rows(p, len(batch))]  # dynamic sampling: ranks keep equal numbers of groups
    if len(batch) == 0:  # no group with a signal on some rank: every rank skips the step together
        return {"train/empty_step": 1.0, "timing/step_s": time.perf_counter() - started}
    p.engine.sleep()
    try:
        metrics |= learn(p, step, batch)
        faults.kill_point(step, "update")
    finally:
        p.engine.wake()
    metrics |= _sync(p)
    seconds = time.perf_counter() - started
    tokens = batch["attention_mask"].sum() + batch["response_attention"].sum()
    metrics["timing/step_s"] = torch.tensor(seconds)
    metrics["throughput/tokens_per_s"] = tokens / seconds
    return reduce_metrics({k: float(v) for k, v in metrics.items()}, p.mesh)


def _fewest_rows(p: Pieces, rows: int) -> int:
    """The smallest batch over the ranks (whole groups of n rows): the update, a collective, needs every
    rank to hold as many groups; the groups a rank kept beyond it are dropped."""
    from rlcore.dist.reduce import all_reduce_int

    return all_reduce_int(rows, p.mesh, op="min")


def on_policy(cfg: Config) -> bool:
    """One optimizer update per step (one epoch, one mini-batch) and no KL in the reward: the old policy
    is the policy being updated, so its log-probs come from the update's forward (ratio 1, exactly as
    with a separate pass) and the extra no-grad pass over the batch is skipped."""
    a = cfg.algo
    return a.ppo_epochs == 1 and a.mini_batch_size in (None, cfg.data.batch_size) and a.kl_coef == 0


def learn(p: Pieces, step: int, batch: Batch) -> dict[str, torch.Tensor | float]:
    """Old/reference log-probs, values, advantages, then the critic and actor updates of one step."""
    from rlcore.update import update_step

    cfg, metrics = p.cfg, {}
    forward = {"temperature": cfg.rollout.temperature, "micro_batch_size": cfg.algo.micro_batch_size,
               "max_tokens": cfg.algo.max_tokens_per_micro_batch, "share_prompts": cfg.algo.share_prompts}  # fmt: skip
    if not on_policy(cfg):  # else the update's own forward gives them (and the rollout gap)
        batch = logprob_step(p.state.model, batch, key="old_logprobs", **forward)
        metrics |= logprob_gap(batch, batch["old_logprobs"])  # rollout vs trainer log-probs
    if p.ref_model is not None:
        batch = logprob_step(p.ref_model, batch, key="ref_logprobs", **forward)
    if p.critic is not None:
        from rlcore.critic import compute_values

        values = compute_values(
            p.critic.model,
            batch,
            micro_batch_size=cfg.algo.micro_batch_size,
            share_prompts=cfg.algo.share_prompts,
        )
        batch = batch.with_(values=values)
    batch, am = advantage_step(batch, cfg.algo, kl_coef=p.kl_coef)
    batch = faults.poison(batch, step)  # test-only NaN injection (RLCORE_TEST_NAN_AT_STEPS)
    metrics |= am
    update_started = time.perf_counter()
    if p.critic is not None:
        from rlcore.critic import critic_update

        p.critic, cm = critic_update(
            p.critic, batch, cfg.algo, cfg.critic, mesh=p.mesh, horizon=cfg.rollout.max_tokens
        )
        metrics |= cm
        if step <= cfg.critic.critic_warmup:  # only the critic learns during its warm-up
            return metrics
    p.state, um = update_step(
        p.state, batch, cfg.algo, cfg.optim, mesh=p.mesh, horizon=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature, seed=cfg.trainer.seed,
    )  # fmt: skip
    _check_bad_updates(p, step, um)
    metrics |= um
    metrics["timing/update_s"] = time.perf_counter() - update_started
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_ctrl == "adaptive":
        p.kl_coef = _next_kl_coef(p, metrics["actor/reward_kl_penalty"], rows=len(batch))
    return metrics


def _next_kl_coef(p: Pieces, local_kl: torch.Tensor, *, rows: int) -> float:
    """The adaptive controller's next coefficient from the KL of the global batch (ranks hold equal rows:
    the mean of the ranks' means), with verl's n_steps = the step's batch size over all ranks."""
    world = p.dist.world_size
    observed = all_reduce(local_kl.to(p.dist.device), p.mesh) / world
    a = p.cfg.algo
    return float(
        adaptive_kl_coef(p.kl_coef, observed.cpu(), rows * world, target=a.kl_target, horizon=a.kl_horizon)
    )


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


def _check_bad_updates(p: Pieces, step: int, update_metrics: dict[str, float]) -> None:
    """Skipped updates are counted by update_step; K in a row abort with the last finite metrics."""
    if p.state.bad_updates == 0:
        p.last_finite = {k: v for k, v in update_metrics.items() if math.isfinite(v)}
        return
    if p.state.bad_updates > p.cfg.trainer.max_bad_updates:
        last = ", ".join(f"{k}={v:.4g}" for k, v in sorted(p.last_finite.items())) or "none"
        raise TrainingDiverged(
            f"step {step}: {p.state.bad_updates} consecutive updates had a non-finite loss or gradient "
            f"(--trainer.max-bad-updates {p.cfg.trainer.max_bad_updates}); last finite metrics: {last}"
        )


def _finish(p: Pieces) -> None:
    """out_dir/final (the HF directory) and curves.png; a full disk here is one line, exit 2."""
    from safetensors import SafetensorError

    from rlcore.trainer.models import save_final

    try:
        save_final(p)
        if p.dist.rank == 0:
            records = read_metrics(p.out_dir / "metrics.jsonl")
            plot_curves(records, p.out_dir / "curves.png", title=f"{p.cfg.preset}: {p.cfg.model.path}")
    except (OSError, SafetensorError) as e:
        raise StopRun(
            f"cannot write the final model or curves under {p.out_dir} ({reason(e)}); free disk space, then "
            f"rerun with --resume auto (training is done; checkpoints, if any, are intact)"
        ) from None
