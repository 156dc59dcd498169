"""The numbers of a step as data: a frozen `StepPlan`, bound once from the config by the shell.

    plan = StepPlan(forward=ForwardPlan(temperature=1.0, micro_batch_size=64), actor=UpdatePlan(),
                    critic=UpdatePlan(), horizon=64, batch_size=32)
    state, metrics, batch = learn(state, handles, algorithm, plan, batch)      # rlcore.step.learn

`Algorithm` (rlcore.algorithm) holds the run's callables; `StepPlan` the numbers around them (how the
model passes are cut and run, how the batch becomes updates, the KL controller, the horizon, seeds).
Neither holds state: what a step changes is in `rlcore.state.TrainState`. A research script builds a
plan itself; `rlcore.trainer.algorithm.bind(cfg)` builds both from the command line's config.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from rlcore.rewards.step import OverlongPenalty
from rlcore.rollout.base import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdatePlan:
    """How one step's batch becomes optimizer updates (the same plan drives actor and critic)."""

    ppo_epochs: int = 1
    """Passes over the batch."""
    mini_batch_size: int | None = None
    """Prompts per optimizer update over all ranks (None: the whole batch)."""
    micro_batch_size: int = 64
    """Rows per forward/backward (gradient accumulation inside a mini-batch)."""
    max_tokens_per_micro_batch: int | None = None
    """A token budget per micro-batch instead of a row count."""
    share_prompts: bool = True
    """Compute each prompt once for its samples (packed forwards) where it pays."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""


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
        """The keywords of `rlcore.step.steps.logprob_step`."""
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
class RolloutPlan:
    """How a step's batch is sampled and scored."""

    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    """The training samples (n per prompt, max_tokens, temperature, top-p/k); the seed is set per step."""
    dynamic: bool = False
    """DAPO's dynamic sampling: groups whose samples all scored the same are dropped, and prompts drawn
    again (up to `rounds` times) until every rank's share of the batch is full."""
    rounds: int = 1
    """Sampling rounds at most per step with dynamic sampling (without it: one)."""
    overlong: OverlongPenalty | None = None
    """DAPO's soft overlong penalty on the scores (None: off)."""
    val_n: int = 1
    """Samples per validation prompt (pass@k beside the greedy score)."""
    given_rewards: str | None = None
    """The batch field of rewards the rollout gives itself (an openai-client agent's, `agent_rewards`,
    `rlcore.gateway.agents`), which `score_step(given=...)` takes; None: the reward functions score every row."""

    def seeded(self, seed: int) -> SamplingParams:
        return dataclasses.replace(self.sampling, seed=seed)

    def greedy(self) -> SamplingParams:
        """One greedy sample per prompt, as long as the training samples (ReMax's baseline)."""
        return SamplingParams(n=1, max_tokens=self.sampling.max_tokens, temperature=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """When things happen over the run: its length, how far the rollouts run ahead, and the cadence of
    validation, checkpoints and weight pushes."""

    steps: int = 1
    """Training steps of the run."""
    max_staleness: int = 0
    """K: the batch of step t is generated with policy version t - 1 - K at the oldest (0: synchronous)."""
    stream: bool = False
    """Split placement's stream mode: the rollout ranks take pushes as they arrive (else lag mode)."""
    partial: bool = False
    """Stream mode with partial rollouts: pushes are taken between decode steps of a batch too."""
    val_every: int = 0
    """Validate every this many steps and after the last (0: never, and so without a validation set)."""
    save_every: int = 0
    """Save a checkpoint every this many steps and after the last (0: never)."""
    keep_last: int = 0
    """Checkpoints kept (0: all)."""
    sync_bucket_bytes: int = 1
    """The weight push's bucket size in bytes (at least 1: one tensor per bucket)."""
    push: Literal["full", "delta"] = "full"
    """Split placement's weight pushes: every tensor whole, or per tensor what changed since the rollout
    ranks' copy (rlcore.dist.delta; lag mode)."""

    def val_due(self, step: int) -> bool:
        """Whether the run validates after `step` (0: before the first step)."""
        return self._every(self.val_every, step)

    def save_due(self, step: int) -> bool:
        """Whether the run saves after `step`."""
        return self._every(self.save_every, step)

    def _every(self, every: int, step: int) -> bool:
        """Every `every` steps and after the last (0: never)."""
        return every > 0 and (step % every == 0 or step == self.steps)

    def due(self, trained: int, pending: int | None) -> range:
        """The steps whose batches may be generated now, with `trained` steps done and batches pending up
        to step `pending` (None: none): up to trained + 1 + K, capped at the last step, so that the batch
        of step t is generated with policy version max(0, t - 1 - K) at the oldest."""
        first = pending + 1 if pending is not None else trained + 1
        return range(first, min(trained + 1 + self.max_staleness, self.steps) + 1)


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
    rollout: RolloutPlan = RolloutPlan()
    """How the batch is sampled and scored."""
    schedule: Schedule = Schedule()
    """The run's length and cadences."""
    sft: bool = False
    """Supervised fine-tuning (teacher-forced targets) instead of rollouts."""
