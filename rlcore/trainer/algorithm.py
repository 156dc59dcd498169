"""The shell's binding of a Config to the library's values: the Algorithm and the StepPlan (`bind`), the
update plans, the optimizers.

Hyper-parameters reach a table entry (`rlcore.pure.advantages.ESTIMATORS`,
`rlcore.pure.losses.POLICY_LOSSES`) by name: a keyword parameter of the entry named like an `--algo`
field (`gamma`, `lam`, `norm_by_std`, `clip_low`, `clip_high`, `clip_c`, ...) is bound to that flag's
value, and a policy loss's `agg` to `--algo.loss-agg`. An entry a user adds from their own script
(`ESTIMATORS["mine"] = fn`) is bound the same way and checked by `rlcore.config.algo_checks.check_algorithm` like a built-in.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import partial
from typing import Any

from configs import AlgoConfig, Config, CriticConfig, OptimConfig
from rlcore.algorithm import ESTIMATOR_INPUTS, Algorithm, parameters
from rlcore.config.algo_checks import ALGO_FIELDS, corrects
from rlcore.config.defaults import DEFAULTS
from rlcore.gateway.agents import GIVEN
from rlcore.models.specs import DTYPES, bucket_bytes
from rlcore.plan import ForwardPlan, KLControl, RolloutPlan, Schedule, StepPlan, UpdatePlan
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.distill import distill_advantages
from rlcore.pure.losses import POLICY_LOSSES, value_loss
from rlcore.rewards.step import OverlongPenalty
from rlcore.rollout.base import SamplingParams
from rlcore.state import ModelState
from rlcore.step import optim as optimizers
from rlcore.step.stages import stages_of
from rlcore.step.steps import correction_step

LIBRARY_DEFAULTS = DEFAULTS["builtin"]
"""What a config that `rlcore.config.defaults.resolve` has not filled gets here (a script calling the
optimizers directly): the built-in models' values. The trainer always resolves first."""


def learning_rate(optim: OptimConfig, *, lora: bool = False) -> float:
    """--optim.lr (resolved by the model's kind at start-up), else the built-in models' default."""
    if optim.lr is not None:
        return optim.lr
    return LIBRARY_DEFAULTS.lora_lr if lora else LIBRARY_DEFAULTS.lr


def optimizer_spec(optim: OptimConfig, *, lora: bool = False) -> optimizers.OptimizerSpec:
    """--optim as the library's OptimizerSpec (the learning rate's default: LoRA's when `lora`)."""
    return optimizers.OptimizerSpec(
        lr=learning_rate(optim, lora=lora), betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
        warmup_steps=optim.warmup_steps, schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio,
    )  # fmt: skip


def bind_flags(fn: Any, algo: AlgoConfig, **extra: Any) -> Any:
    """`fn` with each keyword parameter named like an --algo field bound to its value (and `extra`)."""
    names = parameters(fn)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    bound = {k: getattr(algo, k) for k in names & ALGO_FIELDS if k not in ESTIMATOR_INPUTS}
    return partial(fn, **bound, **{k: v for k, v in extra.items() if k in names or takes_any})


def on_policy(cfg: Config) -> bool:
    """One optimizer update per step (one epoch, one mini-batch) and no KL in the reward: the old policy
    is the policy being updated, so its log-probs come from the update's forward (ratio 1, exactly as
    with a separate pass) and the extra no-grad pass over the batch is skipped. So also for a batch
    generated K versions ago (lag mode): its old (proximal) policy is still the one being updated; the
    gap to the policy that sampled it is what the corrections weigh, and they need the separate pass."""
    a = cfg.algo
    corrected = corrects(a) or a.bypass  # the old log-probs come before the update
    before = corrected or a.teacher is not None  # (a teacher's term is taken against them)
    one_update = a.ppo_epochs == 1 and a.mini_batch_size in (None, cfg.data.batch_size)
    return one_update and a.kl_coef == 0 and not before


def bind(cfg: Config) -> tuple[Algorithm, StepPlan]:
    """The run's Algorithm (with its learn stages) and StepPlan: everything a step needs from the config,
    bound once. `cfg` is resolved (`rlcore.config.defaults.resolve`: the response length and the overlong
    buffer are set)."""
    plan = step_plan(cfg)
    return build_algorithm(cfg, plan), plan


def step_plan(cfg: Config) -> StepPlan:
    """The StepPlan of --rollout, --algo, --critic, --model.compute-dtype and --trainer.seed."""
    a = cfg.algo
    forward = ForwardPlan(temperature=cfg.rollout.temperature, micro_batch_size=a.micro_batch_size,
                          max_tokens=a.max_tokens_per_micro_batch, share_prompts=a.share_prompts,
                          compute_dtype=DTYPES[cfg.model.compute_dtype])  # fmt: skip
    kl = KLControl(
        adaptive=a.kl_coef > 0 and a.kl_ctrl == "adaptive", target=a.kl_target, horizon=a.kl_horizon
    )
    return StepPlan(forward=forward, actor=actor_plan(cfg), critic=critic_plan(cfg),
                    critic_warmup=cfg.critic.critic_warmup, kl=kl, horizon=cfg.rollout.max_tokens,
                    batch_size=cfg.data.batch_size, seed=cfg.trainer.seed, needs_ref=needs_ref(cfg),
                    rollout=rollout_plan(cfg), schedule=schedule(cfg), sft=a.objective == "sft")  # fmt: skip


def rollout_plan(cfg: Config) -> RolloutPlan:
    """The RolloutPlan of --rollout, --algo's dynamic sampling and --reward's overlong penalty."""
    r, a, w = cfg.rollout, cfg.algo, cfg.reward
    sampling = SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k)  # fmt: skip
    overlong = None
    if w.overlong_buffer_length > 0:
        overlong = OverlongPenalty(
            buffer_length=w.overlong_buffer_length,
            penalty_factor=w.overlong_penalty_factor,
            max_length=r.max_tokens,
        )
    return RolloutPlan(sampling=sampling, dynamic=a.dynamic_sampling, rounds=a.max_sampling_rounds,
                       overlong=overlong, val_n=r.val_n, given_rewards=GIVEN if r.agent else None)  # fmt: skip


def schedule(cfg: Config) -> Schedule:
    """The Schedule of --trainer's length and cadences and --pipeline's staleness and mode (no validation
    without --data.val-files)."""
    t, p = cfg.trainer, cfg.pipeline
    val_every = t.val_every if cfg.data.val_files else 0
    return Schedule(steps=t.steps, max_staleness=p.max_staleness, stream=p.mode == "stream",
                    partial=p.partial_rollout, val_every=val_every, save_every=t.save_every,
                    keep_last=t.keep_last, sync_bucket_bytes=sync_bucket_bytes(cfg), push=p.push)  # fmt: skip


def sync_bucket_bytes(cfg: Config) -> int:
    """--rollout.sync-bucket-mb in bytes (at least 1: one tensor per bucket)."""
    return bucket_bytes(cfg.rollout.sync_bucket_mb)


def needs_ref(cfg: Config) -> bool:
    """Whether the step needs reference log-probs (a KL penalty in the reward or a KL loss)."""
    return cfg.algo.kl_coef > 0 or cfg.algo.use_kl_loss


def build_algorithm(cfg: Config, plan: StepPlan) -> Algorithm:
    """The run's Algorithm: the --algo.adv-estimator and --algo.policy-loss entries, flags bound, and its
    learn stages under `plan` (`rlcore.step.stages.stages_of`, the --algo.rollout-* correction among them)."""
    algorithm = algorithm_of(cfg.algo, cfg.critic, on_policy=on_policy(cfg))
    return dataclasses.replace(algorithm, stages=stages_of(algorithm, plan, correction=_correction(cfg.algo)))


def algorithm_of(a: AlgoConfig, critic: CriticConfig | None = None, *, on_policy: bool) -> Algorithm:
    """The Algorithm of --algo (and --critic's value clip) with the on-policy shortcut as given; its learn
    stages are bound by `build_algorithm` (without them, `learn` runs the chain of its switches)."""
    critic = critic or CriticConfig()
    return Algorithm(
        advantage_fn=bind_flags(ESTIMATORS[a.adv_estimator], a),
        policy_loss_fn=bind_flags(POLICY_LOSSES[a.policy_loss], a, agg=a.loss_agg),
        loss_agg=a.loss_agg,
        kl_kind=a.kl_kind,
        kl_loss_coef=a.kl_loss_coef if a.use_kl_loss else 0.0,
        kl_loss_kind=a.kl_loss_kind,
        entropy_coef=a.entropy_coef,
        tis_cap=a.tis_cap,
        correction_weights=corrects(a) and a.rollout_is is not None,
        bypass=a.bypass,
        router_aux_coef=a.router_aux_coef,
        value_loss_fn=partial(value_loss, clip=critic.value_clip, agg=a.loss_agg),
        distill=_distill(a),
        on_policy=on_policy,
    )


def _distill(a: AlgoConfig) -> Any:
    """distill_advantages with --algo.teacher-coef and --algo.teacher-clip bound, or None without a teacher."""
    if a.teacher is None:
        return None
    return partial(distill_advantages, coef=a.teacher_coef, clip=a.teacher_clip)


def _correction(a: AlgoConfig) -> Any:
    """correction_step with the --algo.rollout-* settings bound, or None when none is on."""
    if not corrects(a):
        return None
    return partial(correction_step, is_level=a.rollout_is, is_cap=a.rollout_is_cap, rs_level=a.rollout_rs,
                   rs_upper=a.rollout_rs_upper, rs_lower=a.rollout_rs_lower, veto=a.rollout_veto)  # fmt: skip


def update_plan(algo: AlgoConfig, *, grad_clip: float, batch_size: int | None = None) -> UpdatePlan:
    """The update's shape from --algo; a mini-batch of the whole step's batch is spelled None."""
    mini = None if algo.mini_batch_size == batch_size else algo.mini_batch_size
    return UpdatePlan(
        ppo_epochs=algo.ppo_epochs,
        mini_batch_size=mini,
        micro_batch_size=algo.micro_batch_size,
        max_tokens_per_micro_batch=algo.max_tokens_per_micro_batch,
        share_prompts=algo.share_prompts,
        grad_clip=grad_clip,
    )


def actor_plan(cfg: Config) -> UpdatePlan:
    return update_plan(cfg.algo, grad_clip=cfg.optim.grad_clip, batch_size=cfg.data.batch_size)


def critic_plan(cfg: Config) -> UpdatePlan:
    return update_plan(cfg.algo, grad_clip=cfg.critic.grad_clip, batch_size=cfg.data.batch_size)


def optimizer(model: Any, optim: OptimConfig, *, lora: bool = False) -> Any:
    """AdamW with --optim's settings (the learning rate's default: LoRA's when `lora`)."""
    return optimizers.build_adamw(model, optimizer_spec(optim, lora=lora))


def scheduler(opt: Any, optim: OptimConfig, total_updates: int) -> Any:
    """The learning-rate schedule with --optim's settings over `total_updates` optimizer updates."""
    return optimizers.build_schedule(opt, optimizer_spec(optim), total_updates)


def model_state(model: Any, optim: OptimConfig, total_updates: int, *, lora: bool = False) -> ModelState:
    """`model` with AdamW and its schedule over `total_updates` updates, both from `optim`."""
    return optimizers.model_state(model, optimizer_spec(optim, lora=lora), total_updates)


def critic_optim(cfg: Config) -> OptimConfig:
    """--optim with the critic's learning rate (resolved by the model's kind at start-up, else the built-in
    models' default) and warm-up."""
    c: CriticConfig = cfg.critic
    lr = c.lr if c.lr is not None else LIBRARY_DEFAULTS.critic_lr
    return dataclasses.replace(cfg.optim, lr=lr, warmup_steps=c.lr_warmup_steps)


def updates_per_run(cfg: Config) -> int:
    """Optimizer updates of the whole run (steps x epochs x mini-batches)."""
    a = cfg.algo
    return (
        cfg.trainer.steps * a.ppo_epochs * (cfg.data.batch_size // (a.mini_batch_size or cfg.data.batch_size))
    )
