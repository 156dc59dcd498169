"""Placement as one seam: how a training rank gets its rollouts and gives its weights back.

    rollout, state, metrics = transport.next_rollout(state, h, algorithm, plan)
    with transport.learning(h) as metrics: ...                # the engine asleep while the trainer learns
    metrics = transport.push(model, h, plan, step=s, version=v)   # model None: nothing changed (also the
                                                              # engine's start: the policy's own version)
    metrics = transport.validation(h, plan, step)
    transport.finish(h)

`Transport` (the protocol, in rlcore.step.handles beside the `Handles` that hold one) is what the
step needs; `Colocated` generates on the trainer's own ranks and pushes into its own engine; `SplitTrainer` receives
batches from the rollout ranks and pushes weights to them (rlcore.step.split holds the other side).
The step (`rlcore.step.train_step`) calls these and never asks which placement it runs under. A new
placement is one more class with these methods, chosen in `rlcore.trainer.build`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from torch import Tensor, nn

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch
from rlcore.dist.delta import PushCopy
from rlcore.dist.memory import gpu_free_mb
from rlcore.plan import StepPlan
from rlcore.state import Rollout, TrainState
from rlcore.step import split
from rlcore.step.collect import fill, step_seed
from rlcore.step.learn import compute_precision
from rlcore.step.steps import logprob_step
from rlcore.step.validation import validate_policy
from rlcore.step.weights import push_weights

if TYPE_CHECKING:
    from rlcore.step.handles import Handles, Transport


@dataclasses.dataclass(frozen=True)
class Colocated:
    """Rollout and training on the same ranks: the engine lives here and sleeps while the trainer learns."""

    stops_at_once: bool = False

    def next_rollout(
        self, state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan
    ) -> tuple[Rollout, TrainState, dict[str, float]]:
        """The batch of the next step, generated here (with up to K more ahead, lag mode)."""
        state = fill(state, h, algorithm, plan)
        return state.pending[0], dataclasses.replace(state, pending=state.pending[1:]), {}

    @contextlib.contextmanager
    def learning(self, h: Handles) -> Iterator[dict[str, float]]:
        metrics: dict[str, float] = {}
        free = gpu_free_mb()
        engines = [h.engine] + ([h.judge.engine] if h.judge is not None else [])  # the judge's sleeps too
        for engine in engines:
            engine.sleep()
        if free is not None:  # CUDA: what the engines' sleep gave back to the device (vLLM's pools too)
            metrics["perf/gpu_sleep_freed_mb"] = gpu_free_mb() - free
        try:
            yield metrics
        finally:
            for engine in engines:
                engine.wake()

    def push(
        self, model: nn.Module | None, h: Handles, plan: StepPlan, *, step: int, version: int
    ) -> dict[str, float]:
        if model is None:  # nothing changed: the engine keeps what it has
            return {}
        bucket = plan.schedule.sync_bucket_bytes
        return push_weights(model, h.engine, bucket_bytes=bucket, hooks=h.hooks)

    def validation(self, h: Handles, plan: StepPlan, step: int) -> dict[str, float]:
        """The engine's policy on the validation set."""
        assert h.val_ds is not None
        return validate_policy(
            h.engine,
            h.val_ds,
            h.scorer,
            h.tokenizer,
            max_tokens=plan.rollout.sampling.max_tokens,
            k=plan.rollout.val_n,
            seed=step_seed(plan.seed, step, "val"),
            samples=lambda batch: h.samples.write(step, batch, validation=True),
            teacher=teacher_pass(h, plan),
            judge=h.judge,
            given=plan.rollout.given_rewards,
        )

    def finish(self, h: Handles) -> None:
        pass


def teacher_pass(h: Handles, plan: StepPlan) -> Callable[[Batch], Tensor] | None:
    """A batch's teacher log-probs at temperature 1 (validation's samples are drawn at 1), None without a
    teacher here (a rollout rank of split placement validates without one)."""
    if h.teacher_model is None:
        return None
    forward = plan.forward.forward_kwargs() | {"temperature": 1.0}

    def score(batch: Batch) -> Tensor:
        with compute_precision(plan.forward.compute_dtype, h.dist.device):
            return logprob_step(h.teacher_model, batch, key="teacher_logprobs", **forward)["teacher_logprobs"]

    return score


@dataclasses.dataclass(frozen=True)
class SplitTrainer:
    """A trainer rank of split placement: batches come from the rollout ranks, weights go to them (the
    leader broadcasts); a preemption stops every role at once (their schedules cannot meet at a step)."""

    stops_at_once: bool = True
    base: PushCopy = dataclasses.field(default_factory=PushCopy)
    """--pipeline.push delta: what the leader pushed last (rlcore.dist.delta)."""

    def next_rollout(
        self, state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan
    ) -> tuple[Rollout, TrainState, dict[str, float]]:
        """The batch of the next step from the rollout ranks (`pipeline/trainer_idle_s`: the wait)."""
        rollout, waited = split.receive_rollout(state, h)
        return rollout, state, {"pipeline/trainer_idle_s": waited}

    @contextlib.contextmanager
    def learning(self, h: Handles) -> Iterator[dict[str, float]]:
        yield {}  # no engine on this rank

    def push(
        self, model: nn.Module | None, h: Handles, plan: StepPlan, *, step: int, version: int
    ) -> dict[str, float]:
        """The rollout ranks move on to `step` with `version` (and `model`'s weights, unless None)."""
        s = plan.schedule
        base = self.base if s.push == "delta" else None
        return split.push_weights(
            model, h, step=step, version=version, bucket_bytes=s.sync_bucket_bytes, stream=s.stream, base=base
        )

    def validation(self, h: Handles, plan: StepPlan, step: int) -> dict[str, float]:
        """What rollout rank 0 measured, received by the leader."""
        return split.receive_validation(h)

    def finish(self, h: Handles) -> None:
        if h.outbox is not None:  # stream mode: the rollout ranks take the last pushes
            h.outbox.flush()


def transport_of(role: str) -> Transport:
    """The transport of a training rank in `role` (colocate's "both", split's "trainer")."""
    return SplitTrainer() if role == "trainer" else Colocated()
