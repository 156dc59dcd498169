"""One step's learning: `learn(state, handles, algorithm, plan, batch) -> (state, metrics, batch)`.

Old, reference and (distillation) teacher log-probs, values, KL penalty and advantages, then the critic's and the actor's
updates (`rlcore.step.update.run_updates`, the one update loop), then the adaptive KL controller on the
KL of the global batch. Every number comes from the `StepPlan` (rlcore.plan), none from a config. The
model passes run under the plan's compute dtype (`compute_precision`); the advantage math does not. The engine sleeps meanwhile (the caller's job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch
from rlcore.dist import memory
from rlcore.dist.mesh import DistInfo
from rlcore.dist.reduce import all_reduce
from rlcore.plan import KLControl, StepPlan
from rlcore.pure.kl import adaptive_kl_coef
from rlcore.state import TrainState
from rlcore.step.collect import step_seed
from rlcore.step.critic import compute_values, critic_update
from rlcore.step.phases import phase
from rlcore.step.steps import advantage_step, logprob_gap, logprob_step
from rlcore.step.update import SAVED_KEY, update_step


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


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


def learn(
    state: TrainState, h: Passes, algorithm: Algorithm, plan: StepPlan, batch: Batch
) -> tuple[TrainState, dict[str, Any], Batch]:
    """Old/reference/teacher log-probs, values, advantages, then the critic and actor updates of one step;
    the batch comes back with what the step computed for it (those log-probs, values, advantages)."""
    step, metrics, forward = state.step + 1, {}, plan.forward.forward_kwargs()
    amp = functools.partial(
        compute_precision, plan.forward.compute_dtype, h.dist.device
    )  # the passes' precision
    if algorithm.bypass:  # the rollout's log-probs are the old policy: no recompute pass
        batch = batch.with_(old_logprobs=batch["rollout_logprobs"], overwrite=True)
    elif not algorithm.on_policy:  # else the update's own forward gives them (and the rollout gap)
        started = time.perf_counter()
        with amp(), phase("logprobs"):
            batch = logprob_step(state.actor.model, batch, key="old_logprobs", **forward)
        metrics |= logprob_gap(batch, batch["old_logprobs"])  # rollout vs trainer log-probs
        metrics["timing/old_logprobs_s"] = time.perf_counter() - started
    if algorithm.correction is not None:  # IS weights, rejected units out of the mask (before advantages)
        batch, corr = algorithm.correction(batch)
        metrics |= corr
    if plan.needs_ref:
        with amp(), phase("ref_logprobs"), reference(state, h) as ref:
            batch = logprob_step(ref, batch, key="ref_logprobs", **forward)
    if algorithm.distill is not None:  # on-policy distillation: the teacher scores the sampled tokens
        started = time.perf_counter()
        with amp(), phase("teacher_logprobs"):
            batch = logprob_step(teacher(h), batch, key="teacher_logprobs", **forward)
        metrics["timing/teacher_s"] = time.perf_counter() - started
    if state.critic is not None:
        with amp(), phase("values"):
            values = compute_values(state.critic.model, batch, micro_batch_size=plan.forward.micro_batch_size,
                                    share_prompts=plan.forward.share_prompts)  # fmt: skip
        batch = batch.with_(values=values)
    with phase("advantages"):
        batch, am = advantage_step(batch, algorithm, kl_coef=state.kl_coef)
    batch = h.hooks.poison(batch, step)  # test-only NaN injection (RLCORE_TEST_NAN_AT_STEPS)
    metrics |= am
    update_started = time.perf_counter()
    if state.critic is not None:
        with amp(), phase("critic_update"):
            critic, cm = critic_update(state.critic, batch, algorithm.value_loss_fn, plan.critic, mesh=h.mesh,
                                       horizon=plan.horizon)  # fmt: skip
        state, metrics = dataclasses.replace(state, critic=critic), metrics | cm
        if step <= plan.critic_warmup:  # only the critic learns during its warm-up
            return state, metrics, batch
    with amp(), phase("update"):
        actor, um = update_step(
            state.actor,
            batch,
            algorithm,
            plan.actor,
            mesh=h.mesh,
            horizon=plan.horizon,
            temperature=plan.forward.temperature,
            seed=step_seed(plan.seed, step, "loss"),
        )
    saved = max(um[SAVED_KEY], metrics.get(SAVED_KEY, 0.0))  # the critic's micro-batches may save more
    metrics |= um | memory.state_mb(actor.model, actor.optimizer) | {SAVED_KEY: saved}
    metrics["timing/update_s"] = time.perf_counter() - update_started
    kl_coef = state.kl_coef
    if plan.kl.adaptive:
        kl_coef = next_kl_coef(h, kl_coef, metrics["actor/reward_kl_penalty"], plan.kl, rows=len(batch))
    return dataclasses.replace(state, actor=actor, kl_coef=kl_coef), metrics, batch


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


def check_bad_updates(
    bad_updates: int,
    step: int,
    update_metrics: dict[str, float],
    last_finite: dict[str, float],
    *,
    limit: int,
) -> dict[str, float]:
    """Skipped updates are counted by the update loop; more than `limit` in a row abort with the last
    finite metrics. Returns the metrics to remember as the last finite ones."""
    if bad_updates == 0:
        return {k: v for k, v in update_metrics.items() if math.isfinite(v)}
    if bad_updates > limit:
        last = ", ".join(f"{k}={v:.4g}" for k, v in sorted(last_finite.items())) or "none"
        raise TrainingDiverged(
            f"step {step}: {bad_updates} consecutive updates had a non-finite loss or gradient "
            f"(--trainer.max-bad-updates {limit}); last finite metrics: {last}"
        )
    return last_finite
