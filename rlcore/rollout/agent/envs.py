"""The environments of an agent rollout (`rlcore.rollout.agent.loop`): built and reset, failed, closed.

    reset_all(trajectories, rows, setup, seed)     # one instance per sample; its first observation
    end_on_fault(traj, outcome, setup, "step")     # an env that raised or hung: failure score, abandoned
    close_envs(trajectories, setup)

Each sample gets its own instance of the environment class, reset with its row and a seed shared by the
samples of a prompt (so they play the same instance of the task, the same in every run); a first
observation follows the prompt as the next user message, so the sample's context is the prompt rendered
again with it. Environments are user code: one that raises, returns something malformed or misses its
deadline ends only its own episode, with the failure score, and is never touched again (its call may
still be running on an abandoned thread); the first such fault of each kind is logged once.
"""

from __future__ import annotations

import functools
import logging
import zlib
from typing import Any

from rlcore.batch import Batch
from rlcore.data.prompts import render_prompt
from rlcore.rollout.agent.calls import Outcome, run_concurrently
from rlcore.rollout.agent.env import EnvOutputError, Message, checked_reset
from rlcore.rollout.agent.images import (
    Inputs,
    expanded,
    message_images,
    observation_inputs,
    template_messages,
)
from rlcore.rollout.agent.state import TURN_SEED_STRIDE, Setup, Trajectory, prompt_messages, raw_prompts

log = logging.getLogger("rlcore.rollout.agent.loop")  # the agent loop's logger, its warnings named as before


def _env_seed(uid: str, seed: int | None) -> int:
    """One seed per prompt (its samples play the same instance of the task), stable across runs."""
    return (zlib.crc32(str(uid).encode()) + TURN_SEED_STRIDE * (seed or 0)) % 2**31


def reset_all(trajectories: list[Trajectory], rows: Batch, setup: Setup, seed: int | None) -> None:
    """Build and reset one environment per sample (concurrently); the first observation follows the prompt."""
    cls = setup.env.cls

    def start(i: int) -> Any:
        row = {key: rows[key][i] for key in ("data_source", "ground_truth", "extra_info")}
        row["prompt"] = raw_prompts(rows)[i]
        instance = cls()
        observation = checked_reset(
            instance.reset(seed=_env_seed(rows["uid"][i], seed), options={"row": row})
        )
        if not observation and not prompt_messages(row["prompt"]):
            raise EnvOutputError(
                "reset returned no observation for a row without a prompt: nothing to answer"
            )
        return instance, observation, observation_images(setup, observation)

    outcomes = run_concurrently([functools.partial(start, i) for i in range(len(trajectories))],
                                timeout_s=setup.timeout_s)  # fmt: skip
    for i, (traj, outcome) in enumerate(zip(trajectories, outcomes, strict=True)):
        if not outcome.ok:
            end_on_fault(traj, outcome, setup, "reset")
            continue
        traj.env, observation, images = outcome.value
        messages = prompt_messages(raw_prompts(rows)[i], bool(traj.images)) + observation
        traj.images += [images] if images else []
        if observation:
            traj.context = _prompt_tokens(setup, messages, traj.images)
        if traj.messages is not None:
            traj.messages = messages


def _prompt_tokens(setup: Setup, messages: list[Message], images: list[Inputs]) -> list[int]:
    """The token ids of the prompt `messages` (images expanded), as the policy sees them."""
    if setup.renderer is not None and setup.vision is not None:
        text = setup.renderer.prompt_text(template_messages(messages))
        return setup.renderer.encode(expanded(setup.vision, text, images))
    if setup.renderer is not None:
        return setup.renderer.prompt_ids(messages)
    text, special = render_prompt(setup.tokenizer, messages)
    return list(setup.tokenizer(text, add_special_tokens=special)["input_ids"])


def end_on_fault(traj: Trajectory, outcome: Outcome, setup: Setup, call: str) -> None:
    """End `traj` on an environment fault: the failure score, the env abandoned (never touched again)."""
    traj.env_fault = "timeout" if outcome.timed_out else "error"
    traj.finish = f"env_{traj.env_fault}"
    traj.env_reward = setup.env.failure_score
    traj.env = None
    what = f"timed out after {setup.timeout_s:g} s" if outcome.timed_out else describe_error(outcome.error)
    _warn_once(f"environment {setup.env.cls.__name__}.{call} {what}; the episode ends with failure score "
               f"{setup.env.failure_score:g} (agent/env_errors, agent/env_timeouts count them)")  # fmt: skip


def describe_error(error: BaseException | None) -> str:
    """`raised TYPE: FIRST LINE` of an exception, for a log line or an observation."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"raised {type(error).__name__}: {lines[0] if lines else '(no message)'}"


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    key = message.split(";")[0][:120]
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def observation_images(setup: Setup, messages: list[Message]) -> Inputs | None:
    """The vision inputs of an observation's images (EnvOutputError where the loop cannot show them)."""
    if setup.renderer is None and message_images(messages):
        raise EnvOutputError(
            "an observation carries an image, but the tokenizer has no chat template to place it"
        )
    return observation_inputs(setup.vision, messages)


def close_envs(trajectories: list[Trajectory], setup: Setup) -> None:
    """`close()` every live environment (concurrently, errors ignored); drop them."""
    live = [t.env for t in trajectories if t.env is not None and callable(getattr(t.env, "close", None))]
    if live:
        run_concurrently([e.close for e in live], timeout_s=setup.timeout_s)
    for t in trajectories:
        t.env = None
