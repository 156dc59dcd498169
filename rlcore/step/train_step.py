"""One training step as a story: rollout and rewards, learning (the engine asleep), the weight push.

state, metrics = train_step(state, handles, algorithm, plan)
"""

from __future__ import annotations

import dataclasses
import time

from rlcore.algorithm import Algorithm
from rlcore.dist.reduce import all_reduce_int, reduce_metrics
from rlcore.plan import StepPlan
from rlcore.state import TrainState
from rlcore.step.collect import staleness, this_rank
from rlcore.step.handles import Handles
from rlcore.step.learn import learn
from rlcore.step.phases import phase
from rlcore.step.sft import sft_batch
from rlcore.step.update import update_step


def train_step(
    state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan
) -> tuple[TrainState, dict[str, float]]:
    """Rollout and rewards, then (the engine asleep) log-probs, advantages and updates, then weight sync."""
    if plan.sft:
        return sft_step(state, h, algorithm, plan)
    started, step, transport = time.perf_counter(), state.step + 1, h.transport
    rollout, state, metrics = transport.next_rollout(state, h, algorithm, plan)
    batch = rollout.batch
    metrics |= dict(rollout.metrics) | staleness(rollout.batch, state.policy_version)
    h.hooks.kill_point(step, "rollout")  # test-only fault injection (RLCORE_TEST_KILL_AT)
    batch = batch[: all_reduce_int(len(batch), h.mesh, op="min")]  # dynamic sampling: equal groups per rank
    if len(batch) == 0:  # no group with a signal on some rank: every rank skips the step together
        transport.push(None, h, plan, step=step, version=state.policy_version)  # the weights did not change
        return dataclasses.replace(state, step=step), {
            "train/empty_step": 1.0,
            "timing/step_s": time.perf_counter() - started,
        }
    with transport.learning(h) as slept:
        state, learned, batch = learn(state, h, algorithm, plan, batch)
        h.samples.write(step, batch)
        h.hooks.kill_point(step, "update")
    with phase("sync"):
        state, synced = push(state, h, plan, step=step)
    seconds = time.perf_counter() - started
    tokens = batch["attention_mask"].sum() + batch["response_attention"].sum()
    metrics |= (
        slept | learned | synced | {"timing/step_s": seconds, "throughput/tokens_per_s": tokens / seconds}
    )
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
        dataclasses.replace(state, actor=actor, cursor=cursor), h, plan, step=step
    )  # validation samples the engine
    metrics |= synced | {"timing/step_s": time.perf_counter() - started}
    return dataclasses.replace(state, step=step), reduce_metrics(metrics, h.mesh)


def push(state: TrainState, h: Handles, plan: StepPlan, *, step: int) -> tuple[TrainState, dict[str, float]]:
    """The actor's weights after `step` steps into the engine (one update of it; under split placement
    to the rollout ranks' engines); the state with the next policy version."""
    started, version = time.perf_counter(), state.policy_version + 1
    metrics = h.transport.push(state.actor.model, h, plan, step=step, version=version)
    metrics["timing/sync_s"] = time.perf_counter() - started
    return dataclasses.replace(state, policy_version=version), metrics
