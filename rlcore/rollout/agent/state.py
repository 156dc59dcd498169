"""The state of one agent rollout (`rlcore.rollout.agent.loop`): the run's settings and each sample's trajectory.

    trajectories = start_trajectories(rows, setup)   # one per (prompt, sample) row, holding its prompt

A `Setup` is fixed for the whole call: how to tokenize and render, which tools answer which call format,
the environment, the token budget and the deadline of one call. A `Trajectory` is one sample's response
as it grows turn by turn, kept as plain lists (turned into tensors once, at the end) with the context the
next turn is generated from, its counts, its conversation (with a chat template), its environment and
its images. Both live apart from the loop so that the modules that reset environments, react to turns
and assemble the output can share them without importing the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlcore.batch import Batch
from rlcore.data.images import with_image_parts
from rlcore.data.vision import VisionProcessor
from rlcore.rollout.agent.chat import ChatRenderer, ChatTools, ToolCallFormat
from rlcore.rollout.agent.env import Message, as_messages
from rlcore.rollout.agent.images import Inputs
from rlcore.rollout.agent.tools import Tool, ToolFormat

TURN_SEED_STRIDE = 1_000_003  # turn k of a seeded call samples with seed + k * stride


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvOptions:
    """The environment of a run (`--rollout.env`): the class and the score of a faulty episode."""

    cls: type
    """Built with no arguments, one instance per sample (`rlcore.rollout.agent.env`)."""
    failure_score: float = 0.0
    """The score of an episode whose environment raised, returned bad output or timed out."""


@dataclasses.dataclass
class Trajectory:
    """One sample's growing response (plain lists; turned into tensors once at the end)."""

    context: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    """The policy version of each token, when the engine tags them (partial rollouts)."""
    finish: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    messages: list[Message] | None = None
    """The conversation so far, with the chat template (assistant turns as their decoded text)."""
    env: Any = None
    env_reward: float = 0.0
    env_fault: str | None = None
    """Set when the environment failed ("error" or "timeout"); the episode ended there."""
    images: list[Inputs] = dataclasses.field(default_factory=list)
    """A vision-language policy's: the vision inputs of the context's placeholder runs, in order."""

    def append(
        self, tokens: list[int], logprobs: list[float], *, generated: bool, versions: list[int] | None = None
    ) -> None:
        """Add a model turn's tokens (`generated`, with their log-probs and versions when tagged) or an
        observation's (log-prob 0, the version of the turn before it)."""
        self.context += tokens
        self.tokens += tokens
        self.mask += [1.0 if generated else 0.0] * len(tokens)
        self.logprobs += logprobs if generated else [0.0] * len(tokens)
        self.observation_tokens += 0 if generated else len(tokens)
        if versions is not None or (self.versions and not generated):
            self.versions += versions if versions is not None else [self.versions[-1]] * len(tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What every turn needs besides the trajectory: how to tokenize and render, the tools, the env."""

    tokenizer: Any
    legacy_tools: dict[str, Tool] | None  # `<tool>NAME: ARG</tool>` calls (no chat template)
    fmt: ToolFormat
    chat_tools: ChatTools | None  # calls in the template's format (`call_format`)
    call_format: ToolCallFormat
    renderer: ChatRenderer | None
    env: EnvOptions | None
    budget: int
    max_chars: int
    timeout_s: float | None  # of one reset / step / tool call
    vision: VisionProcessor | None = None  # a vision-language policy's image processing


def raw_prompts(rows: Batch) -> list[Any]:
    """Each row's `raw_prompt` (messages or a string; "" where the batch has none)."""
    return list(rows["raw_prompt"]) if "raw_prompt" in rows else [""] * len(rows)


def prompt_messages(raw_prompt: Any, images: bool = False) -> list[Message]:
    """A row's prompt as chat messages (a string is one user message; "" none); with `images`, its
    `<image>` placeholders as image parts."""
    messages = as_messages(raw_prompt) if isinstance(raw_prompt, str) else [dict(m) for m in raw_prompt]
    return with_image_parts(messages) if images else messages


def start_trajectories(rows: Batch, setup: Setup) -> list[Trajectory]:
    """One trajectory per row: its context the row's prompt tokens (the left padding removed), with the
    template its prompt as messages, and the row's vision inputs where it has images."""
    images = list(rows["multi_modal_inputs"]) if "multi_modal_inputs" in rows else [{}] * len(rows)
    return [
        Trajectory(
            context=ids[m.bool()].tolist(),
            messages=prompt_messages(raw, bool(x)) if setup.renderer else None,
            images=[x] if x else [],
        )
        for ids, m, raw, x in zip(
            rows["input_ids"].cpu(), rows["attention_mask"].cpu(), raw_prompts(rows), images, strict=True
        )
    ]
