"""`TrainState`: everything one training step changes, as one frozen value.

    state = TrainState(actor=ModelState(...), critic=None, kl_coef=0.0, cursor=Cursor())
    state, metrics = train_step(state, handles, algorithm)        # rlcore.trainer.run
    save(state, ...) / state = resume(...)                        # rlcore.trainer.checkpoints

A step returns a new TrainState (`dataclasses.replace`); the models' parameters and optimizer states
change in place inside `optimizer.step()`, the one documented exception. Nothing else carries run
state: checkpoints save exactly this (plus the RNG), and whatever must agree across ranks (the KL
coefficient, the cursor, the number of sampling rounds) is computed from reduced values, so every
rank holds the same TrainState scalars.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlcore.batch import Batch
from rlcore.data.dataset import Cursor
from rlcore.dist.transfer import json_tensor, rows_from_json, rows_to_json, tensor_json


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelState:
    """A trained model with its optimizer and schedule (the actor's or the critic's); replaced, never
    mutated, by `run_updates`.

    The model's parameters and the optimizer's state change in place (`optimizer.step()`): the one
    documented exception to immutability.
    """

    model: nn.Module
    """A plain module (1 process) or an FSDP2-sharded one."""
    optimizer: Optimizer
    """AdamW over the model's parameters (`build_optimizer`)."""
    scheduler: LRScheduler
    """Learning-rate schedule, stepped once per optimizer update (`build_scheduler`)."""
    step: int = 0
    """`run_updates` calls so far (training steps that updated this model)."""
    bad_updates: int = 0
    """Consecutive optimizer updates skipped for a non-finite loss or gradient norm."""


@dataclasses.dataclass(frozen=True)
class Health:
    """What the run-health checks carry from step to step (`rlcore.trainer.health.check_health`)."""

    no_signal_streak: int = 0
    """Consecutive steps in which every prompt group's samples scored the same."""
    first_entropy: float | None = None
    """The policy entropy of the first step that had one (the entropy-collapse reference)."""
    on: frozenset[str] = frozenset()
    """The conditions that held at the last step (a warning is printed when one starts)."""

    def to_json(self) -> dict:
        return {
            "no_signal_streak": self.no_signal_streak,
            "first_entropy": self.first_entropy,
            "on": sorted(self.on),
        }

    @classmethod
    def from_json(cls, doc: Mapping) -> Health:
        return cls(doc["no_signal_streak"], doc["first_entropy"], frozenset(doc["on"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollout:
    """A batch generated ahead of the step that trains on it (lag mode)."""

    step: int
    """The training step this batch is for."""
    batch: Batch
    """This rank's rows, scored, with `rollout_versions`."""
    metrics: Mapping[str, float]
    """Its rollout and reward metrics, logged at `step`."""
    version: int
    """The policy version that generated it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """The run's state between steps (see the module docstring)."""

    actor: ModelState | None
    """The policy with its optimizer and schedule; its `bad_updates` counts consecutive skipped updates.
    None on a rollout rank of split placement, whose state is the cursor, the batches it sent that are
    not trained yet (`pending`), and the step and version of the weights it last received."""
    critic: ModelState | None = None
    """The PPO critic (None without one)."""
    kl_coef: float = 0.0
    """The live coefficient of the KL penalty in the reward (the adaptive controller moves it)."""
    cursor: Cursor = dataclasses.field(default_factory=Cursor)
    """Where the next training batch starts in the train dataset."""
    step: int = 0
    """Training steps completed."""
    pending: tuple[Rollout, ...] = ()
    """Batches generated for the next steps, oldest first (up to K of them between steps)."""
    policy_version: int = 0
    """The version of the weights the rollout engine samples with: 0 the starting (or restored) ones,
    +1 per push after an update (the asynchronous pipeline bounds the gap to the trainer's by it)."""
    health: Health = Health()
    """The run-health checks' memory (streaks, the first entropy, the conditions on), checkpointed so a
    resumed run reports and warns as the uninterrupted one."""

    @property
    def bad_updates(self) -> int:
        """Consecutive actor updates skipped for a non-finite loss or gradient."""
        return self.actor.bad_updates if self.actor is not None else 0


def rollouts_to_tensors(pending: tuple[Rollout, ...]) -> dict[str, Tensor]:
    """The pending batches as one flat dict of tensors (for a checkpoint's per-rank tensor file): each
    batch's tensors under `pending/<i>/<name>`, its per-row values and bookkeeping as JSON bytes under
    `pending/<i>/json` (loaded back with `weights_only`, no pickle)."""
    out: dict[str, Tensor] = {}
    for i, r in enumerate(pending):
        out |= {f"pending/{i}/{name}": t for name, t in r.batch.tensors.items()}
        rows, row_tensors = rows_to_json(r.batch.non_tensors)  # tensors in rows (images): each once
        out |= {f"pending/{i}/rows/{k}": t.contiguous() for k, t in enumerate(row_tensors)}
        doc = {"step": r.step, "version": r.version, "metrics": dict(r.metrics), "rows": rows,
               "row_tensors": len(row_tensors), "meta": dict(r.batch.meta)}  # fmt: skip
        try:
            out[f"pending/{i}/json"] = json_tensor(doc)
        except (TypeError, ValueError) as e:  # a row value JSON cannot carry: say which, not a traceback
            raise ValueError(
                f"the batch of step {r.step}, generated ahead, holds a value JSON cannot carry ({e})"
            ) from None
    return out


def rollouts_from_tensors(tensors: Mapping[str, Tensor]) -> tuple[Rollout, ...]:
    """Inverse of `rollouts_to_tensors` (other keys are ignored)."""
    pending = []
    for i in range(sum(1 for k in tensors if k.startswith("pending/") and k.endswith("/json"))):
        prefix = f"pending/{i}/"
        doc = tensor_json(tensors[prefix + "json"])
        fields = {
            k.removeprefix(prefix): t
            for k, t in tensors.items()
            if k.startswith(prefix) and k != prefix + "json" and not k.startswith(prefix + "rows/")
        }
        row_tensors = [tensors[f"{prefix}rows/{k}"] for k in range(doc.get("row_tensors", 0))]
        rows = rows_from_json(doc["rows"], row_tensors)
        batch = Batch(tensors=fields, non_tensors=rows, meta=doc["meta"])
        pending.append(Rollout(step=doc["step"], batch=batch, metrics=doc["metrics"], version=doc["version"]))
    return tuple(pending)


__all__ = ["Rollout", "TrainState", "rollouts_from_tensors", "rollouts_to_tensors"]
