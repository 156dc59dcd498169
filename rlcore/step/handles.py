"""What a training step uses and never replaces: the run's `Handles`, built once by the shell
(`rlcore.trainer.build`), typed so that a reader knows what each one can do; and the `Transport`
protocol, what a training rank's step needs of its placement (implemented in rlcore.step.transport)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlcore.data.dataset import PromptDataset
from rlcore.dist.mesh import DistInfo
from rlcore.dist.placement import Placement
from rlcore.rewards.judge import Judge
from rlcore.rewards.pool import RewardScorer
from rlcore.rollout.base import RolloutEngine
from rlcore.step.faults import Hooks
from rlcore.step.weights import AdapterRelay

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcore.algorithm import Algorithm
    from rlcore.batch import Batch
    from rlcore.plan import StepPlan
    from rlcore.state import Rollout, TrainState


class MetricsSink(Protocol):
    """Where the loop's metrics go (the shell's metrics.jsonl, W&B and progress line)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def begin(self, step: int) -> None: ...
    def close(self) -> None: ...


class SampleSink(Protocol):
    """Where a step's decoded samples go (the shell's samples.jsonl)."""

    def write(self, step: int, batch: Batch, *, validation: bool = False) -> None: ...


class Transport(Protocol):
    """What the training ranks' step needs of its placement."""

    stops_at_once: bool
    """A preemption signal stops the run at once (else after the step, with a checkpoint)."""

    def next_rollout(
        self, state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan
    ) -> tuple[Rollout, TrainState, dict[str, float]]: ...

    def learning(self, h: Handles) -> contextlib.AbstractContextManager[dict[str, float]]: ...

    def push(
        self, model: nn.Module | None, h: Handles, plan: StepPlan, *, step: int, version: int
    ) -> dict[str, float]: ...

    def validation(self, h: Handles, plan: StepPlan, step: int) -> dict[str, float]: ...

    def finish(self, h: Handles) -> None: ...


class Outbox:
    """The trainer leader's weight pushes still in flight: in stream mode a push is sent without waiting
    for the rollout ranks to take it (they do between batches); each work holds its tensor's copy."""

    def __init__(self) -> None:
        self._works: list[Any] = []

    def add(self, works: list[Any]) -> None:
        self._works = [w for w in self._works + works if not w.is_completed()]

    def flush(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


@dataclasses.dataclass(frozen=True, kw_only=True)
class Handles:
    """What the steps use and never replace (the engine's weights change by pushes, its identity not)."""

    out_dir: Path
    placement: Placement
    """This rank's role (colocate: both) and the groups between the roles (rlcore.dist.placement)."""
    dist: DistInfo
    """This rank within its role: rank and world size of the role, device."""
    mesh: DeviceMesh | None
    """The role's data-parallel DeviceMesh (None for a role of one process)."""
    tokenizer: PreTrainedTokenizerBase
    train_ds: PromptDataset
    val_ds: PromptDataset | None
    scorer: RewardScorer | None
    """The reward scorer (None on a trainer rank of split placement)."""
    engine: RolloutEngine | None
    """The rollout engine (None on a trainer rank of split placement)."""
    judge: Judge | None = None
    """The generative judge, with its own engine (None without --reward.judge, and on a trainer rank of
    split placement)."""
    ref_model: nn.Module | None
    """The frozen reference policy (None without KL, and on a rollout rank)."""
    teacher_model: nn.Module | None = None
    """On-policy distillation's frozen teacher, sharded like the policy (None without --algo.teacher, and
    on a rollout rank)."""
    logger: MetricsSink
    samples: SampleSink
    """Each step's first --log.samples samples as text (a writer that writes nothing off rank 0)."""
    transport: Transport
    """How this training rank gets rollouts and pushes weights (rlcore.step.transport; a rollout rank
    of split placement runs rlcore.step.split's loop instead)."""
    model_base: dict[str, Any] = dataclasses.field(default_factory=lambda: {"lora_rank": 0})
    """What the policy's adapters are trained on (a resume must load the same base and LoRA shape)."""
    hooks: Hooks = dataclasses.field(default_factory=Hooks)
    """Test-only faults (rlcore.step.faults; the shell reads them from the environment once)."""
    outbox: Outbox | None = None
    """The trainer leader's weight pushes in flight (split placement; stream mode does not wait for them)."""
    relay: AdapterRelay | None = None
    """A rollout rank's copy of a LoRA policy (split placement), where the pushed adapters land."""
