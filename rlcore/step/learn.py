"""One step's learning: `learn(state, handles, algorithm, plan, batch) -> (state, metrics, batch)`.

The algorithm's stages run in order (`rlcore.step.stages`): old, reference and (distillation) teacher
log-probs, values, KL penalty and advantages, then the critic's and the actor's updates
(`rlcore.step.update.run_updates`, the one update loop), then the adaptive KL controller on the KL of the
global batch. Every number comes from the `StepPlan` (rlcore.plan), none from a config. The model passes
run under the plan's compute dtype (`compute_precision`); the advantage math does not. The engine sleeps
meanwhile (the caller's job).
"""

from __future__ import annotations

import math
from typing import Any

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch
from rlcore.plan import StepPlan
from rlcore.state import TrainState
from rlcore.step.stages import Ctx, Passes, compute_precision, stages_of


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


def learn(
    state: TrainState, h: Passes, algorithm: Algorithm, plan: StepPlan, batch: Batch
) -> tuple[TrainState, dict[str, Any], Batch]:
    """The algorithm's stages over one step's batch (an Algorithm bound without stages, as a script may
    build one, runs `stages_of(algorithm, plan)`); the batch comes back with what the step computed for
    it (log-probs, values, advantages)."""
    ctx = Ctx(state=state, h=h, algorithm=algorithm, plan=plan, batch=batch, step=state.step + 1)
    for stage in algorithm.stages or stages_of(algorithm, plan):
        ctx = stage.run(ctx)
        if ctx.done:  # the critic's warm-up: only the critic learns
            break
    return ctx.state, ctx.metrics, ctx.batch


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


__all__ = ["Passes", "TrainingDiverged", "check_bad_updates", "compute_precision", "learn"]
