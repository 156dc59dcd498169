"""The learn phase of a step as a chain of stages: each names what it needs and what it makes.

    stages = stages_of(algorithm, plan)                          # bound once (rlcore.trainer.algorithm.bind)
    algorithm = dataclasses.replace(algorithm, stages=stages)
    state, metrics, batch = learn(state, handles, algorithm, plan, batch)   # runs them in order

A `Stage(name, needs, makes, run)` is a step of the chain: `run` takes the step's `Ctx` (the state, the
batch, the metrics so far) and returns a new one. `needs` and `makes` name batch keys (`old_logprobs`)
and state parts (`state.critic`); `check_chain` refuses, when the chain is built, a stage whose needs
neither the rollout (`given`) nor an earlier stage makes. The built-in chain, in order:

    old_logprobs       the actor's no-grad pass (or, bypassed, the rollout's log-probs; none on-policy)
    correction         off-policy IS weights and rejection (`rlcore.step.steps.correction_step`)
    ref_logprobs       the reference policy's pass (a KL penalty or KL loss)
    teacher_logprobs   on-policy distillation's teacher pass
    values             the critic's V(s_t)
    advantages         KL penalty, advantages and returns (`rlcore.step.steps.advantage_step`)
    critic_update      the critic's updates; during its warm-up the chain stops here (`Ctx.done`)
    actor_update       the actor's updates (`rlcore.step.update.update_step`)
    kl_controller      the adaptive KL coefficient from the global batch's KL

A stage of your own, e.g. scores clipped to [-1, 1] before the advantages:

    def clip_scores(ctx: Ctx) -> Ctx:
        scores = ctx.batch["token_scores"].clamp(-1.0, 1.0)
        return ctx.with_(batch=ctx.batch.with_(token_scores=scores, overwrite=True))

    mine = Stage("clip_scores", needs=frozenset({"token_scores"}), makes=frozenset({"token_scores"}),
                 run=clip_scores)
    algorithm, plan = bind(cfg)
    algorithm = with_stage(algorithm, mine, before="advantages")   # checked again; a bad need: ValueError
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlcore.algorithm import Algorithm, Stage
from rlcore.batch import Batch
from rlcore.dist import memory
from rlcore.dist.mesh import DistInfo
from rlcore.dist.reduce import all_reduce
from rlcore.plan import KLControl, StepPlan
from rlcore.pure.kl import adaptive_kl_coef
from rlcore.state import TrainState
from rlcore.step.collect import step_seed
from rlcore.step.critic import compute_values, critic_update
from rlcore.step.faults import Hooks
from rlcore.step.phases import phase
from rlcore.step.steps import advantage_step, logprob_gap, logprob_step
from rlcore.step.update import SAVED_KEY, update_step

ROLLOUT = frozenset(
    {"input_ids", "attention_mask", "responses", "response_attention", "response_mask", "token_scores",
     "rollout_logprobs", "uid"}
)  # fmt: skip
"""Batch keys every scored rollout holds (`rlcore.rollout.base`, `rlcore.step.steps.score_step`)."""


class Passes(Protocol):
    """What `learn` uses besides the state: where it runs, the frozen reference and teacher (the run's
    `Handles` have these; a script passes any object that does)."""

    @property
    def dist(self) -> DistInfo: ...  # this rank's device and the world size
    @property
    def mesh(self) -> DeviceMesh | None: ...  # the data-parallel mesh the updates reduce over
    @property
    def ref_model(self) -> nn.Module | None: ...  # None: no KL, or LoRA's adapter-disabled actor
    @property
    def teacher_model(self) -> nn.Module | None: ...  # on-policy distillation's frozen teacher
    @property
    def hooks(self) -> Hooks: ...  # test-only faults (NaN advantages at chosen steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ctx:
    """One step's learning as it goes through the stages."""

    state: TrainState
    h: Passes
    algorithm: Algorithm
    plan: StepPlan
    batch: Batch
    step: int
    """The step being learned (`state.step + 1`)."""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    update_started: float | None = None
    """When the updates began (the critic's, if any): the start of `timing/update_s`."""
    done: bool = False
    """The stages after this one are skipped (the critic's warm-up)."""

    def with_(self, **changes: Any) -> Ctx:
        return dataclasses.replace(self, **changes)

    def amp(self) -> contextlib.AbstractContextManager[Any]:
        """The model passes' precision (`compute_precision` of the plan's compute dtype)."""
        return compute_precision(self.plan.forward.compute_dtype, self.h.dist.device)

    @property
    def forward(self) -> dict[str, object]:
        """The keywords of a log-prob pass (`rlcore.step.steps.logprob_step`)."""
        return self.plan.forward.forward_kwargs()


def recompute_old_logprobs(ctx: Ctx) -> Ctx:
    """The actor's no-grad pass gives `old_logprobs`; its gap to the rollout's is logged."""
    started = time.perf_counter()
    with ctx.amp(), phase("logprobs"):
        batch = logprob_step(ctx.state.actor.model, ctx.batch, key="old_logprobs", **ctx.forward)
    metrics = ctx.metrics | logprob_gap(batch, batch["old_logprobs"])  # rollout vs trainer log-probs
    metrics["timing/old_logprobs_s"] = time.perf_counter() - started
    return ctx.with_(batch=batch, metrics=metrics)


def rollout_old_logprobs(ctx: Ctx) -> Ctx:
    """Bypass: the rollout's log-probs are the old policy's (no recompute pass)."""
    return ctx.with_(batch=ctx.batch.with_(old_logprobs=ctx.batch["rollout_logprobs"], overwrite=True))


def correct(fn: Callable[[Batch], tuple[Batch, dict[str, Any]]]) -> Callable[[Ctx], Ctx]:
    """A stage running the off-policy correction `fn` (IS weights, rejected units out of the mask)."""

    def run(ctx: Ctx) -> Ctx:
        batch, corr = fn(ctx.batch)
        return ctx.with_(batch=batch, metrics=ctx.metrics | corr)

    return run


def ref_logprobs(ctx: Ctx) -> Ctx:
    """The reference policy's pass gives `ref_logprobs` (a KL penalty in the reward or a KL loss)."""
    with ctx.amp(), phase("ref_logprobs"), reference(ctx.state, ctx.h) as ref:
        batch = logprob_step(ref, ctx.batch, key="ref_logprobs", **ctx.forward)
    return ctx.with_(batch=batch)


def teacher_logprobs(ctx: Ctx) -> Ctx:
    """On-policy distillation: the teacher scores the sampled tokens."""
    started = time.perf_counter()
    with ctx.amp(), phase("teacher_logprobs"):
        batch = logprob_step(teacher(ctx.h), ctx.batch, key="teacher_logprobs", **ctx.forward)
    return ctx.with_(batch=batch, metrics=ctx.metrics | {"timing/teacher_s": time.perf_counter() - started})


def values(ctx: Ctx) -> Ctx:
    """The critic's V(s_t) as the batch's `values`."""
    with ctx.amp(), phase("values"):
        v = compute_values(ctx.state.critic.model, ctx.batch, micro_batch_size=ctx.plan.forward.micro_batch_size,
                           share_prompts=ctx.plan.forward.share_prompts)  # fmt: skip
    return ctx.with_(batch=ctx.batch.with_(values=v))


def advantages(ctx: Ctx) -> Ctx:
    """`token_rewards` (scores minus the KL penalty), `advantages` and `returns` (`advantage_step`)."""
    with phase("advantages"):
        batch, am = advantage_step(ctx.batch, ctx.algorithm, kl_coef=ctx.state.kl_coef)
    batch = ctx.h.hooks.poison(batch, ctx.step)  # test-only NaN injection (RLCORE_TEST_NAN_AT_STEPS)
    return ctx.with_(batch=batch, metrics=ctx.metrics | am)


def update_critic(ctx: Ctx) -> Ctx:
    """The critic's updates; during its warm-up (`plan.critic_warmup` steps) the chain stops here."""
    started = time.perf_counter()
    with ctx.amp(), phase("critic_update"):
        critic, cm = critic_update(ctx.state.critic, ctx.batch, ctx.algorithm.value_loss_fn, ctx.plan.critic,
                                   mesh=ctx.h.mesh, horizon=ctx.plan.horizon)  # fmt: skip
    state = dataclasses.replace(ctx.state, critic=critic)
    warmup = ctx.step <= ctx.plan.critic_warmup  # only the critic learns during its warm-up
    return ctx.with_(state=state, metrics=ctx.metrics | cm, update_started=started, done=warmup)


def update_actor(ctx: Ctx) -> Ctx:
    """The actor's updates (`update_step`); `timing/update_s` counts the critic's too."""
    started = time.perf_counter() if ctx.update_started is None else ctx.update_started
    with ctx.amp(), phase("update"):
        actor, um = update_step(ctx.state.actor, ctx.batch, ctx.algorithm, ctx.plan.actor, mesh=ctx.h.mesh,
                                horizon=ctx.plan.horizon, temperature=ctx.plan.forward.temperature,
                                seed=step_seed(ctx.plan.seed, ctx.step, "loss"))  # fmt: skip
    saved = max(um[SAVED_KEY], ctx.metrics.get(SAVED_KEY, 0.0))  # the critic's micro-batches may save more
    metrics = ctx.metrics | um | memory.state_mb(actor.model, actor.optimizer) | {SAVED_KEY: saved}
    metrics["timing/update_s"] = time.perf_counter() - started
    return ctx.with_(state=dataclasses.replace(ctx.state, actor=actor), metrics=metrics)


def control_kl(ctx: Ctx) -> Ctx:
    """The adaptive KL controller's next coefficient (`next_kl_coef`)."""
    kl = ctx.metrics["actor/reward_kl_penalty"]
    coef = next_kl_coef(ctx.h, ctx.state.kl_coef, kl, ctx.plan.kl, rows=len(ctx.batch))
    return ctx.with_(state=dataclasses.replace(ctx.state, kl_coef=coef))


def _stage(name: str, run: Callable[[Ctx], Ctx], needs: Sequence[str], makes: Sequence[str]) -> Stage:
    return Stage(name, frozenset(needs), frozenset(makes), run)


def stages_of(
    algorithm: Algorithm, plan: StepPlan, *, correction: Callable[..., Any] | None = None
) -> tuple[Stage, ...]:
    """The built-in chain of `algorithm` under `plan` (module docstring), checked (`check_chain`).
    `correction`: `rlcore.step.steps.correction_step` with its levels bound, or None."""
    a, chain = algorithm, []
    if a.bypass:
        chain.append(_stage("old_logprobs", rollout_old_logprobs, ["rollout_logprobs"], ["old_logprobs"]))
    elif not a.on_policy:  # on-policy, the update's own forward gives them (and the rollout gap)
        chain.append(_stage("old_logprobs", recompute_old_logprobs, ["responses", "rollout_logprobs"],
                            ["old_logprobs"]))  # fmt: skip
    if correction is not None:
        weights = ["is_weights"] if a.correction_weights else []
        chain.append(_stage("correction", correct(correction), ["old_logprobs", "rollout_logprobs",
                            "response_mask"], ["response_mask", *weights]))  # fmt: skip
    if plan.needs_ref:
        chain.append(_stage("ref_logprobs", ref_logprobs, ["responses"], ["ref_logprobs"]))
    if a.distill is not None:
        chain.append(_stage("teacher_logprobs", teacher_logprobs, ["responses"], ["teacher_logprobs"]))
    if a.needs_critic:
        chain.append(_stage("values", values, ["state.critic"], ["values"]))
    chain.append(_stage("advantages", advantages, advantage_needs(a, plan), ["token_rewards", "advantages",
                                                                             "returns"]))  # fmt: skip
    if a.needs_critic:
        chain.append(_stage("critic_update", update_critic, ["state.critic", "values", "returns"],
                            ["state.critic"]))  # fmt: skip
    chain.append(_stage("actor_update", update_actor, actor_needs(a), ["state.actor"]))
    if plan.kl.adaptive:
        chain.append(_stage("kl_controller", control_kl, ["state.kl_coef"], ["state.kl_coef"]))
    return check_chain(chain, given(a))


def advantage_needs(a: Algorithm, plan: StepPlan) -> list[str]:
    """What `advantage_step` reads: the scores, the estimator's inputs, the teacher's term's and the KL
    penalty's log-probs."""
    needs = ["token_scores", "response_mask", *sorted(a.inputs & {"values", "baseline_rewards"})]
    if a.distill is not None:
        needs += ["old_logprobs", "teacher_logprobs"]
    if plan.needs_ref and not a.on_policy:  # a KL penalty in the reward (on-policy has none)
        needs += ["old_logprobs", "ref_logprobs"]
    return needs


def actor_needs(a: Algorithm) -> list[str]:
    """What `update_step` reads besides the sequence fields (`rlcore.step.actor_loss.needed_fields`)."""
    needs = ["state.actor", "advantages"] + ([] if a.on_policy else ["old_logprobs"])
    needs += ["ref_logprobs"] if a.kl_loss_coef > 0 else []
    needs += ["rollout_logprobs"] if a.tis_cap is not None else []
    return needs + (["is_weights"] if a.correction_weights else [])


def given(algorithm: Algorithm) -> frozenset[str]:
    """What the chain starts from: the rollout's keys (with ReMax's greedy `baseline_rewards`) and the
    state's parts (`state.critic` when the estimator reads values)."""
    batch = ROLLOUT | ({"baseline_rewards"} if algorithm.needs_greedy_baseline else set())
    return batch | {"state.actor", "state.kl_coef"} | ({"state.critic"} if algorithm.needs_critic else set())


def check_chain(stages: Sequence[Stage], given: frozenset[str]) -> tuple[Stage, ...]:
    """`stages` as a tuple, each stage's needs met by `given` or an earlier stage; else a ValueError."""
    have, names = set(given), [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"learn stages: each name once, got {names}")
    for i, stage in enumerate(stages):
        missing = sorted(stage.needs - have)
        if missing:
            raise ValueError(
                f"learn stage {stage.name!r} needs {', '.join(missing)}: neither the rollout, the state nor an "
                f"earlier stage ({', '.join(names[:i]) or 'none'}) makes it"
            )
        have |= stage.makes
    return tuple(stages)


def with_stage(
    algorithm: Algorithm, stage: Stage, *, before: str | None = None, after: str | None = None
) -> Algorithm:
    """`algorithm` with `stage` inserted before (or after) the stage of that name in its bound chain,
    the chain checked again."""
    names = [s.name for s in algorithm.stages]
    at = before if before is not None else after
    if (before is None) == (after is None) or at not in names:
        raise ValueError(f"with_stage: give one of before= / after= naming a stage of {names}, got {at!r}")
    i = names.index(at) + (after is not None)
    stages = (*algorithm.stages[:i], stage, *algorithm.stages[i:])
    return dataclasses.replace(algorithm, stages=check_chain(stages, given(algorithm)))


def compute_precision(dtype: torch.dtype, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The model passes' precision: torch.autocast to `dtype` (--model.compute-dtype), or a null context."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def reference(state: TrainState, h: Passes) -> Iterator[nn.Module]:
    """The reference policy: the frozen copy, or (LoRA) the actor itself with its adapter disabled."""
    if h.ref_model is not None:
        yield h.ref_model
        return
    from rlcore.models.lora import adapter_disabled

    with adapter_disabled(state.actor.model):
        yield state.actor.model


def teacher(h: Passes) -> nn.Module:
    """The frozen teacher of on-policy distillation (a run with `algorithm.distill` builds one)."""
    if h.teacher_model is None:
        raise ValueError("the algorithm distills from a teacher; the step's passes hold none (teacher_model)")
    return h.teacher_model


def next_kl_coef(h: Passes, coef: float, local_kl: torch.Tensor, control: KLControl, *, rows: int) -> float:
    """The adaptive controller's next coefficient from the KL of the global batch (ranks hold equal rows:
    the mean of the ranks' means), with verl's n_steps = the step's batch size over all ranks."""
    world = h.dist.world_size
    observed = all_reduce(local_kl.to(h.dist.device), h.mesh) / world
    return float(
        adaptive_kl_coef(coef, observed.cpu(), rows * world, target=control.target, horizon=control.horizon)
    )
