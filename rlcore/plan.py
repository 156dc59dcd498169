"""The numbers of a step as data: a frozen `StepPlan`, bound once from the config by the shell.

    plan = StepPlan(forward=ForwardPlan(temperature=1.0, micro_batch_size=64), actor=UpdatePlan(),
                    critic=UpdatePlan(), horizon=64, batch_size=32)
    state, metrics, batch = learn(state, handles, algorithm, plan, batch)      # rlcore.trainer.learn

`Algorithm` (rlcore.algorithm) holds the run's callables; `StepPlan` the numbers around them (how the
model passes are cut and run, how the batch becomes updates, the KL controller, the horizon, seeds).
Neither holds state: what a step changes is in `rlcore.state.TrainState`. A research script builds a
plan by hand; `rlcore.trainer.algorithm.bind(cfg)` builds both from the command line's config.
"""

from __future__ import annotations

import dataclasses

import torch

from rlcore.update import UpdatePlan


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardPlan:
    """How the no-grad model passes (old and reference log-probs, values) run."""

    temperature: float = 1.0
    """The sampling temperature: log-probs are of the distribution the rollout sampled from."""
    micro_batch_size: int = 64
    """Rows per forward."""
    max_tokens: int | None = None
    """A token budget per micro-batch instead of a row count (None: rows)."""
    share_prompts: bool = True
    """Compute each prompt once for its samples (packed forwards) where it pays."""
    compute_dtype: torch.dtype = torch.float32
    """The passes' precision: autocast to it unless float32 (the advantage math stays float32)."""

    def forward_kwargs(self) -> dict[str, object]:
        """The keywords of `rlcore.steps.logprob_step`."""
        return {"temperature": self.temperature, "micro_batch_size": self.micro_batch_size,
                "max_tokens": self.max_tokens, "share_prompts": self.share_prompts}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLControl:
    """The KL coefficient's controller (Ziegler et al. 2019): fixed, or adaptive towards `target`."""

    adaptive: bool = False
    """Adapt the coefficient after each step from the observed KL (else it stays as it started)."""
    target: float = 0.1
    """The KL the adaptive controller aims at."""
    horizon: float = 10000.0
    """The adaptive controller's horizon in samples."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
    """Every number a training step needs beside the `Algorithm`; nothing under the step reads a config."""

    forward: ForwardPlan
    """The no-grad passes."""
    actor: UpdatePlan
    """How the batch becomes the actor's optimizer updates."""
    critic: UpdatePlan
    """The critic's (used only when the state has a critic)."""
    critic_warmup: int = 0
    """Steps in which only the critic learns."""
    kl: KLControl = KLControl()
    """The KL coefficient's controller (the coefficient itself is state)."""
    horizon: int
    """The longest response in tokens (--rollout.max-tokens): `seq-mean-token-sum-norm`'s divisor."""
    batch_size: int
    """Prompts per step over all ranks."""
    seed: int = 0
    """The run's seed: per-step seeds (sampling, losses that sample) derive from it and the step."""
    needs_ref: bool = False
    """Whether the step computes reference log-probs (a KL penalty in the reward, or a KL loss)."""
