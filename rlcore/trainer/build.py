"""Building a run from its config, before the loop: the pre-flight checks, the datasets, the models, the
engine and the handles (`build(cfg) -> (TrainState, Handles, Algorithm, StepPlan)`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from configs import Config, ConfigError
from rlcore.algorithm import Algorithm
from rlcore.config import model_checks
from rlcore.config.cpu_bf16 import bf16_units, cpu_flags, slow_bf16_line
from rlcore.config.defaults import default_lines, micro_budget, model_kind
from rlcore.config.fits import check_fits
from rlcore.config.preflight import preflight
from rlcore.data.dataset import Cursor, PromptDataset
from rlcore.data.rows import DataError
from rlcore.data.sources import read_sources
from rlcore.dist import memory
from rlcore.dist.mesh import init_distributed
from rlcore.dist.placement import as_world, place
from rlcore.plan import StepPlan
from rlcore.rewards.custom import RewardSpecError
from rlcore.rewards.dispatch import find_reward
from rlcore.rewards.pool import RewardScorer
from rlcore.rollout.agent.env import EnvSpecError
from rlcore.rollout.engines import engine_kind
from rlcore.state import TrainState
from rlcore.step.faults import Hooks
from rlcore.step.handles import Handles, Outbox
from rlcore.step.transport import transport_of
from rlcore.step.weights import AdapterRelay
from rlcore.trainer import agents, judges, models
from rlcore.trainer.algorithm import bind, sync_bucket_bytes
from rlcore.trainer.logger import MetricsLogger
from rlcore.trainer.samples import SampleWriter

USER_ERRORS = (ConfigError, DataError, RewardSpecError, EnvSpecError)
"""What the user fixes: one `error:` line and exit 2."""


def build(
    cfg: Config, defaulted: dict[str, Any] | None = None
) -> tuple[TrainState, Handles, Algorithm, StepPlan]:
    """The run of `cfg`, resolved (`rlcore.config.defaults.resolve`); `defaulted` names the values its
    model's kind gave it (`defaults.defaulted` of the user's config): printed first, kept in config.json."""
    defaulted = defaulted or {}
    info = _world(cfg)
    preflight(cfg, info)  # every check that needs no weights, in one pass
    agent_files = agents.load_agent_files(cfg)  # a bad env / tools file stops here, before any model loads
    placement = _placement(cfg, info)
    torch.manual_seed(cfg.trainer.seed)
    algorithm, plan = bind(cfg)
    if placement.writes:  # the first lines of the run: what the model's kind chose, bf16 where it is slow
        report_defaults(cfg, defaulted, critic=algorithm.needs_critic)
        _warn_slow_bf16(cfg, on_cpu=info.device.type == "cpu")
    out_dir = Path(cfg.out_dir or f"runs/{cfg.preset}-{datetime.now():%Y%m%d-%H%M%S}")
    inputs = _inputs(cfg, info, agent_files)
    memory.note_process()  # what the process holds before any weights (perf/mem/process_mb)
    # a rollout rank of split placement loads the engine's own copy of the policy instead
    trains = placement.trains
    model = models.build_policy(cfg, placement) if trains else models.build_engine_copy(cfg, placement.local)
    if cfg.rollout.exact:
        models.agree_exact_rows()  # every rank's products in the same row layouts
    parts = _parts(Parts(cfg=cfg, placement=placement, algorithm=algorithm, plan=plan, model=model, inputs=inputs))
    logger = _logger(cfg, defaulted, out_dir, writes=placement.writes)
    _report_start(cfg, inputs, logger, parts["actor"], writes=placement.writes)
    samples = SampleWriter(out_dir, inputs.tokenizer, k=cfg.log.samples if placement.writes else 0,
                           wandb_run=logger.wandb_run)  # fmt: skip
    state = TrainState(actor=parts["actor"], critic=parts["critic"], kl_coef=cfg.algo.kl_coef, cursor=Cursor())
    h = Handles(out_dir=out_dir, placement=placement, dist=placement.local, mesh=placement.mesh,
                tokenizer=inputs.tokenizer, train_ds=inputs.train_ds, val_ds=inputs.val_ds, scorer=parts["scorer"],
                engine=parts["engine"], judge=parts["judge"], ref_model=parts["ref_model"],
                teacher_model=parts["teacher"], logger=logger, samples=samples,
                transport=transport_of(placement.role), model_base=model_base(cfg), hooks=Hooks.from_env(),
                outbox=Outbox() if placement.role == "trainer" else None,
                relay=_relay(cfg, placement, model))  # fmt: skip
    return state, h, algorithm, plan


def _world(cfg: Config) -> Any:
    """This process in the torchrun world (formed here: the pre-flight's checks need it)."""
    timeout = cfg.trainer.rendezvous_timeout_s
    if not (timeout > 0 and math.isfinite(timeout)):  # before the world forms: preflight needs it formed
        raise ConfigError(f"--trainer.rendezvous-timeout-s {timeout}: must be a number of seconds > 0")
    try:
        return init_distributed(cfg.trainer.device, rendezvous_timeout_s=timeout)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
    """What the models read, loaded and checked before any weights: the tokenizer, a vision-language
    policy's processor, the judge's parts and the datasets."""

    tokenizer: Any
    vision: Any
    judging: judges.JudgeParts | None
    train_ds: PromptDataset
    val_ds: PromptDataset | None
    agent_files: agents.AgentFiles | None


def _inputs(cfg: Config, info: Any, agent_files: agents.AgentFiles | None) -> Inputs:
    """The run's inputs, with the checks that need them and no weights: a teacher's vocabulary, the
    context, the memory fit, every row's image under torchrun."""
    tokenizer = models.tokenizer_of(cfg)
    vision = models.vision_of(cfg, tokenizer)
    if cfg.algo.teacher is not None:
        model_checks.check_teacher(cfg, tokenizer)  # before any weights load
    judging = judges.judge_parts(cfg)  # the judge's template, parser and tokenizer (None: no judge)
    train_ds, val_ds = _datasets(cfg, tokenizer, agents.prompt_tools(agent_files, tokenizer), vision)
    lengths = {ds.name: ds.prompt_lengths() for ds in (train_ds, val_ds) if ds is not None}
    model_checks.check_context(cfg, lengths)
    longest = max((max(v, default=0) for v in lengths.values()), default=0)
    check_fits(cfg, world_size=info.world_size, on_cpu=info.device.type == "cpu", prompt_tokens=longest)
    if vision is not None and info.world_size > 1:
        _check_every_row_has_an_image(train_ds)
    return Inputs(tokenizer=tokenizer, vision=vision, judging=judging, train_ds=train_ds, val_ds=val_ds,
                  agent_files=agent_files)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts:
    """What each part of a rank's run is built from."""

    cfg: Config
    placement: Any
    algorithm: Algorithm
    plan: StepPlan
    model: Any
    """The trained policy (a rollout rank of split placement: the engine's copy)."""
    inputs: Inputs


def _scorer_part(p: Parts) -> RewardScorer:
    return _scorer(p.cfg, (p.inputs.train_ds, p.inputs.val_ds), p.inputs.judging)


def _reference_part(p: Parts) -> Any:
    return models.build_reference(p.cfg, p.placement) if p.plan.needs_ref else None


def _teacher_part(p: Parts) -> Any:
    return models.build_teacher(p.cfg, p.placement) if p.algorithm.distill is not None else None


def _actor_part(p: Parts) -> Any:
    return models.build_state(p.cfg, p.model, p.placement.local)


def _engine_part(p: Parts) -> Any:
    """The rollout engine, in the agent loop where the run has one. An in-process vLLM takes the default
    group as its world: there, the rollout ranks."""
    cfg, placement, inputs = p.cfg, p.placement, p.inputs
    with as_world(placement.rollouts if engine_kind(cfg.rollout.engine).own_world else None):
        engine = models.build_engine(cfg, p.model, inputs.tokenizer, placement.local)
    return agents.agent_engine(cfg, engine, inputs.tokenizer, inputs.agent_files, inputs.vision)


def _judge_part(p: Parts) -> Any:
    if p.inputs.judging is None:
        return None
    with as_world(p.placement.rollouts if engine_kind(p.cfg.reward.judge_engine).own_world else None):
        return judges.build_judge(p.cfg, p.inputs.judging, p.placement.local)


def _critic_part(p: Parts) -> Any:
    return models.build_critic_state(p.cfg, p.placement) if p.algorithm.needs_critic else None


PARTS: tuple[tuple[str, str, Callable[[Parts], Any]], ...] = (
    ("scorer", "generates", _scorer_part),
    ("ref_model", "trains", _reference_part),
    ("teacher", "trains", _teacher_part),
    ("actor", "trains", _actor_part),
    ("engine", "generates", _engine_part),
    ("judge", "generates", _judge_part),
    ("critic", "trains", _critic_part),
)
"""A rank's parts in the order they are built (the order seeds and memory see), each with the role that
holds it (`Placement.trains` / `.generates`: colocated ranks hold both)."""


def _parts(p: Parts) -> dict[str, Any]:
    """Every part this rank's role holds, built in PARTS' order; None for the others."""
    return {name: make(p) if getattr(p.placement, role) else None for name, role, make in PARTS}


def _report_start(cfg: Config, inputs: Inputs, logger: MetricsLogger, actor: Any, *, writes: bool) -> None:
    """The data lines, a vision policy's packing note, and what trains and what the optimizer holds."""
    report_data(cfg, inputs.train_ds, inputs.val_ds, logger, prints=writes)
    if inputs.vision is not None and cfg.algo.share_prompts and writes:
        print("warning: --algo.share-prompts is off for a vision-language policy: its forwards run one row per "
              "sample (packing image tokens is not measured yet)", file=sys.stderr, flush=True)  # fmt: skip
    if actor is not None:  # what trains (a LoRA policy: the adapters) and what the optimizer holds
        logger.once(parameter_counts(actor))


def _placement(cfg: Config, info: Any) -> Any:
    """This rank's place in the run (`rlcore.dist.placement.place`), its role's torch threads set."""
    p = cfg.pipeline
    placement = place(info, split=p.placement == "split", rollout_ranks=p.rollout_ranks, tp=cfg.trainer.tp,
                      sp=cfg.trainer.sp, ep=cfg.trainer.ep)  # fmt: skip
    threads = {"trainer": p.trainer_threads, "rollout": p.rollout_threads}.get(placement.role, 0)
    if threads:
        torch.set_num_threads(threads)
    return placement


def _scorer(cfg: Config, datasets: tuple[Any, Any], judging: Any) -> RewardScorer:
    """The reward functions of the datasets' sources, but those an env or the judge scores."""
    sources = sorted({row.data_source for ds in datasets if ds is not None for row in ds.rows})
    if cfg.rollout.env is not None:  # an env scores its episodes: a reward function only where one exists
        sources = [s for s in sources if find_reward(s) is not None]
    if judging is not None:  # the judge's sources need no reward function
        sources = [s for s in sources if judging.sources and s not in judging.sources]
    r = cfg.reward
    return RewardScorer(r.custom, data_sources=sources, num_workers=r.num_workers, timeout_s=r.timeout_s,
                        failure_score=r.failure_score, max_error_rate=r.max_error_rate,
                        math_verifier=r.math_verifier)  # fmt: skip


def _logger(cfg: Config, defaulted: dict[str, Any], out_dir: Path, *, writes: bool) -> MetricsLogger:
    """The metrics logger; the rank that writes first writes config.json."""
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(record(cfg, defaulted), indent=2))
    return MetricsLogger(out_dir, total_steps=cfg.trainer.steps, enabled=writes, wandb_mode=cfg.log.wandb,
                         wandb_project=cfg.log.project, run_name=out_dir.name, config=record(cfg, defaulted),
                         progress=cfg.log.progress)  # fmt: skip


def _relay(cfg: Config, placement: Any, model: Any) -> AdapterRelay | None:
    """A rollout rank of a LoRA policy keeps its copy (with the adapter layers) for the pushed adapters."""
    if placement.role != "rollout" or cfg.model.lora_rank == 0:
        return None
    return AdapterRelay(model, bucket_bytes=sync_bucket_bytes(cfg))


def record(cfg: Config, defaulted: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config as config.json and W&B record it: every flag of the resolved config, and under
    "defaulted" the model's kind and the values it chose (section.field: value)."""
    out = dataclasses.asdict(cfg)
    out["defaulted"] = {"model_kind": model_kind(cfg.model.path), "values": dict(defaulted or {})}
    return out


def report_defaults(cfg: Config, defaulted: dict[str, Any], *, critic: bool) -> None:
    """One stdout line per value the model's kind chose (--critic.lr only where a critic trains)."""
    shown = {k: v for k, v in defaulted.items() if critic or k != "critic.lr"}
    budget = micro_budget(cfg) if "algo.max_tokens_per_micro_batch" in shown else None
    lines = default_lines(shown, kind=model_kind(cfg.model.path), lora=cfg.model.lora_rank > 0, budget=budget)
    for line in lines:
        print(line, flush=True)


def _warn_slow_bf16(cfg: Config, *, on_cpu: bool) -> None:
    units = bf16_units(cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"))
    line = slow_bf16_line(cfg, on_cpu=on_cpu, units=units)
    if line:
        print(line, file=sys.stderr, flush=True)


def model_base(cfg: Config) -> dict[str, Any]:
    """What a LoRA checkpoint's adapters were trained on (a resume must load the same base and shape)."""
    m = cfg.model
    if m.lora_rank == 0:
        return {"lora_rank": 0}
    return {"path": m.path, "lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha,
            "lora_targets": list(m.lora_targets)}  # fmt: skip


def _datasets(
    cfg: Config, tokenizer: Any, tools: tuple[dict, ...], vision: Any
) -> tuple[PromptDataset, PromptDataset | None]:
    d, seed = cfg.data, cfg.trainer.seed
    common = {
        "max_prompt_length": d.max_prompt_length,
        "overlong": d.overlong,
        "tools": tools,
        "vision": vision,
    }
    # an env's first observation can be the first user turn: its rows may leave the prompt out
    reading = {"seed": seed, "prompt_optional": cfg.rollout.env is not None, "answer_format": d.answer_format}
    rows = read_sources(d.train_files, split="train", builtin_size=d.builtin_train_size, **reading)
    train = PromptDataset(rows, tokenizer, seed=seed, name="--data.train-files", **common)
    val = None
    if d.val_files:
        rows = read_sources(d.val_files, split="val", builtin_size=d.builtin_val_size, **reading)
        val = PromptDataset(rows, tokenizer, seed=seed, shuffle=False, name="--data.val-files", **common)
    return train, val


def _check_every_row_has_an_image(ds: PromptDataset) -> None:
    """Under torchrun a vision-language run's training rows all carry images: a micro-batch without one
    would skip the vision tower's FSDP2 collectives on its rank while the others run them (a hang)."""
    bare = next((row for row in ds.rows if not row.images), None)
    if bare is not None:
        raise ConfigError(f"{bare.origin}: a row without an image; under torchrun every training row of a "
                          "vision-language policy needs one (ranks must run the vision tower alike); add "
                          "an image or train in one process")  # fmt: skip


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
    stdout (stderr keeps warnings and errors), and the dropped counts as `data/train_dropped` / `data/val_dropped`
    (and rows dropped for unreadable images, `data/*_bad_images`) in the first record."""
    sets = {"train": (train, cfg.data.train_files), "val": (val, cfg.data.val_files)}
    for key, (ds, files) in sets.items():
        if ds is None:
            continue
        if prints:
            print(f"data: {ds.name} {' '.join(files)}: {ds.report()}", flush=True)
        logger.once(
            {f"data/{key}_dropped": float(ds.n_dropped), f"data/{key}_bad_images": float(len(ds.bad_images))}
        )
