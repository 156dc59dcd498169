"""One training step as a story: rollout and rewards, learning (the engine asleep), the weight push.

state, metrics = train_step(state, handles, algorithm, plan)
"""

from __future__ import annotations

import dataclasses
import time

from rlcore.algorithm import Algorithm
from rlcore.dist.reduce import all_reduce_int, reduce_metrics
from rlcore.plan import StepPlan
from rlcore.state import Rollout, TrainState
from rlcore.trainer import faults, models, split
from rlcore.trainer.collect import fill, staleness, this_rank
from rlcore.trainer.handles import Handles
from rlcore.trainer.learn import learn
from rlcore.trainer.logger import gpu_free_mb
from rlcore.trainer.phases import phase
from rlcore.trainer.sft import sft_batch
from rlcore.update import update_step


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
