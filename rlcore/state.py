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

from rlcore.data.dataset import Cursor
from rlcore.update import ModelState


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """The run's state between steps (see the module docstring)."""

    actor: ModelState
    """The policy with its optimizer and schedule; its `bad_updates` counts consecutive skipped updates."""
    critic: ModelState | None = None
    """The PPO critic (None without one)."""
    kl_coef: float = 0.0
    """The live coefficient of the KL penalty in the reward (the adaptive controller moves it)."""
    cursor: Cursor = dataclasses.field(default_factory=Cursor)
    """Where the next training batch starts in the train dataset."""
    step: int = 0
    """Training steps completed."""
    policy_version: int = 0
    """The version of the weights the rollout engine samples with: 0 the starting (or restored) ones,
    +1 per push after an update (the asynchronous pipeline bounds the gap to the trainer's by it)."""

    @property
    def bad_updates(self) -> int:
        """Consecutive actor updates skipped for a non-finite loss or gradient."""
        return self.actor.bad_updates


__all__ = ["TrainState"]
