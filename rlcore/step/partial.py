"""Partial rollouts: an engine whose weights may change between decode steps, each token tagged with
the policy version that sampled it.

    engine = tagged(h.engine, version=lambda: state.policy_version, take=load_arrived_pushes)
    batch = engine.generate(prompts, sampling)      # batch["rollout_versions"]: (b*n, t) long

`take()` runs between the engine's decode steps (`each_step`, native and vLLM) and may load new
weights; a token sampled after a load carries the version `version()` then returns. Every generate
call is tagged on its own, so what the trainer's collection does with several calls composes:
dynamic sampling's extra rounds (each round's rows keep their tags through the group filter and the
concatenation), ReMax's greedy pass (its responses are only scored: a baseline from whichever
versions sampled it stays independent of the samples, so the estimator keeps its expectation), and
the agent loop's turns (each turn's tokens keep their tags in the episode; see `tagged`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.rollout.base import SamplingParams, Wrapping


def version_tags(shape: tuple[int, int], start: int, changes: list[tuple[Tensor, int]]) -> Tensor:
    """(b, t) long: `start`, then for each (sampled (b,), version) change in order, `version` from each
    row's token sampled[row] on."""
    versions = torch.full(shape, start, dtype=torch.long)
    columns = torch.arange(shape[1])
    for sampled, version in changes:
        later = columns[None, :] >= sampled[:, None]  # (b, t)
        versions = torch.where(later, torch.full_like(versions, version), versions)
    return versions


@dataclasses.dataclass(frozen=True)
class VersionTagged(Wrapping):
    """A `RolloutEngine` around `inner` (one with `each_step`) that takes pushes between decode steps
    and tags each generated token with its version (`rollout_versions`)."""

    inner: Any
    version: Callable[[], int]
    """The policy version the engine samples with now."""
    take: Callable[[], None]
    """Load the pushes that have arrived (called between decode steps)."""

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        start, changes = self.version(), []

        def between_steps(sampled: Tensor) -> None:
            before = self.version()
            self.take()
            if self.version() != before:
                changes.append((sampled.cpu(), self.version()))

        with self.inner.each_step(between_steps):
            out = self.inner.generate(prompts, sampling)
        versions = version_tags(tuple(out["responses"].shape), start, changes)
        return out.with_(rollout_versions=versions.to(out["responses"].device))


def tagged(engine: Any, version: Callable[[], int], take: Callable[[], None]) -> Any:
    """`engine` taking pushes between decode steps, its tokens tagged (`VersionTagged`). The agent loop
    (`rlcore.rollout.agent.loop.AgentEngine`) keeps its loop and gets a tagged inner engine: every turn's
    tokens carry their versions into the episode, and the episodes in flight (their environments, their
    contexts) are left as they are by a push, their later turns sampled with the new weights."""
    from rlcore.rollout.agent.loop import AgentEngine

    if isinstance(engine, AgentEngine):
        return dataclasses.replace(engine, inner=VersionTagged(engine.inner, version, take))
    return VersionTagged(engine, version, take)


__all__ = ["VersionTagged", "tagged", "version_tags"]
