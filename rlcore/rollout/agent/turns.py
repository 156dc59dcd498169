"""What follows a model turn in the agent loop (`rlcore.rollout.agent.loop`): tool answers, environment steps
and the end of a sample.

    react_all(pending, setup, last=turn == max_turns - 1)   # every sample whose turn did not hit the budget
    observation, error = observe(text, tools)               # a `<tool>NAME: ARGUMENT</tool>` call answered

Each finished turn is planned first: a turn with tool calls (in the chat template's format, or the
`<tool>` format of `rlcore.rollout.agent.tools`) is answered by its tools, a turn without them is the action of
the sample's environment, and without tools or an environment the turn is the answer. What can be
decided at once (the answer, a tool call in the last turn) is; the tool calls and environment steps of
all samples then run concurrently, each with the run's deadline, because they are user code that may be
slow or hang. A tool that fails is an error observation and the episode goes on; an environment that
fails ends its episode (`rlcore.rollout.agent.envs`). The reaction's observation is then appended to the
sample (`response_mask` 0), or it ends the sample.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from rlcore.rollout.agent.calls import run_concurrently
from rlcore.rollout.agent.chat import ToolCall, call_tool
from rlcore.rollout.agent.env import Message, checked_step
from rlcore.rollout.agent.envs import describe_error, end_on_fault, observation_images
from rlcore.rollout.agent.images import Inputs, expanded, template_messages
from rlcore.rollout.agent.state import Setup, Trajectory
from rlcore.rollout.agent.tools import DEFAULT_FORMAT, Tool, ToolError, ToolFormat


@dataclasses.dataclass(frozen=True)
class _Reaction:
    """What follows a model turn: observation messages (template) or text (no template), or the end."""

    messages: tuple[Message, ...] = ()
    text: str = ""
    reward: float = 0.0
    finish: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    images: Inputs | None = None  # the vision inputs of the messages' image parts


def parse_tool_call(text: str, fmt: ToolFormat = DEFAULT_FORMAT) -> tuple[str, str]:
    """(name, argument) of the last `<tool>NAME: ARGUMENT</tool>` ending at the first `</tool>` of `text`."""
    head = text[: text.index(fmt.call_close)]
    start = head.rfind(fmt.call_open)
    if start < 0:
        raise ToolError(f"malformed tool call: {fmt.call_close} without {fmt.call_open}")
    name, colon, argument = head[start + len(fmt.call_open) :].partition(":")
    if not colon or not name.strip():
        raise ToolError(f"malformed tool call: expected {fmt.call_open}NAME: ARGUMENT{fmt.call_close}")
    return name.strip(), argument.strip()


def observe(
    text: str, tools: dict[str, Tool], *, fmt: ToolFormat = DEFAULT_FORMAT, max_chars: int = 256
) -> tuple[str, bool]:
    """(observation text `<result>...</result>`, whether it is an error) for the tool call in `text`."""
    try:
        name, argument = parse_tool_call(text, fmt)
        if name not in tools:
            raise ToolError(f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
        content, error = str(tools[name](argument)), False
    except Exception as e:  # a tool's failure is an observation, never a crash
        content, error = (f"error: {e}" if str(e) else f"error: {type(e).__name__}"), True
    if len(content) > max_chars:
        content = content[:max_chars] + "..."
    return f"{fmt.result_open}{content}{fmt.result_close}", error


def _plan(traj: Trajectory, tokens: list[int], setup: Setup, last: bool) -> _Reaction | tuple[str, Any]:
    """The reaction to a finished turn: decided now (a `_Reaction`), or a (kind, call) to run concurrently."""
    text = setup.tokenizer.decode(tokens, skip_special_tokens=True)
    if setup.chat_tools is not None and setup.call_format.marker in text:
        if last:
            return _Reaction(finish="max_turns")
        calls = setup.call_format.parse(text)
        return "tools", functools.partial(_chat_tool_results, setup, calls)
    if setup.legacy_tools is not None and setup.fmt.call_close in text:
        if last:
            return _Reaction(finish="max_turns")
        return "tools", functools.partial(_legacy_tool_result, setup, text)
    if setup.env is None:
        return _Reaction(finish="stop")
    return "env", functools.partial(_env_step, traj.env, text, last, setup)


def _chat_tool_results(setup: Setup, calls: list[ToolCall]) -> _Reaction:
    answers = [call_tool(setup.chat_tools, c, max_chars=setup.max_chars) for c in calls]
    return _Reaction(messages=tuple(m for m, _ in answers), tool_calls=len(answers),
                     tool_errors=sum(e for _, e in answers))  # fmt: skip


def _legacy_tool_result(setup: Setup, text: str) -> _Reaction:
    observation, error = observe(text, setup.legacy_tools, fmt=setup.fmt, max_chars=setup.max_chars)
    return _Reaction(text=observation, tool_calls=1, tool_errors=int(error))


def _env_step(env: Any, text: str, last: bool, setup: Setup) -> _Reaction:
    step = checked_step(env.step(text))
    finish = "stop" if step.terminated else "truncated" if step.truncated else "max_turns" if last else None
    if finish:
        return _Reaction(reward=step.reward, finish=finish)
    images = observation_images(setup, step.messages)
    return _Reaction(messages=tuple(step.messages), reward=step.reward, images=images)


def react_all(pending: list[tuple[Trajectory, list[int]]], setup: Setup, *, last: bool) -> None:
    """React to every finished turn: tool calls and environment steps run concurrently."""
    plans = [_plan(traj, tokens, setup, last) for traj, tokens in pending]
    calls = [p for p in plans if not isinstance(p, _Reaction)]
    timeout = setup.timeout_s
    outcomes = iter(run_concurrently([fn for _, fn in calls], timeout_s=timeout) if calls else [])
    for (traj, tokens), plan in zip(pending, plans, strict=True):
        if isinstance(plan, _Reaction):
            _apply(traj, tokens, plan, setup)
            continue
        kind, outcome = plan[0], next(outcomes)
        if outcome.ok:
            _apply(traj, tokens, outcome.value, setup)
        elif kind == "env":
            end_on_fault(traj, outcome, setup, "step")
        else:  # a tool that hung or broke the loop's own code: an error observation, the episode goes on
            what = f"timed out after {timeout:g} s" if outcome.timed_out else describe_error(outcome.error)
            error = {"role": "tool", "name": "", "content": f"error: tool call {what}"}
            text = f"{setup.fmt.result_open}error: tool call {what}{setup.fmt.result_close}"
            _apply(traj, tokens, _Reaction(messages=(error,), text=text, tool_calls=1, tool_errors=1), setup)


def _apply(traj: Trajectory, tokens: list[int], reaction: _Reaction, setup: Setup) -> None:
    """Add a reaction to `traj`: rewards and counts, then its observation tokens (mask 0) or its end."""
    traj.env_reward += reaction.reward
    traj.tool_calls += reaction.tool_calls
    traj.tool_errors += reaction.tool_errors
    if reaction.finish is not None:
        traj.finish = reaction.finish
        return
    obs_ids = _observation_ids(traj, tokens, reaction, setup)
    room = setup.budget - len(traj.tokens)
    if reaction.images and len(obs_ids) > room:  # an image is never cut: the sample ends before it
        traj.finish = "length"
        return
    traj.append(obs_ids[:room], [], generated=False)
    traj.images += [reaction.images] if reaction.images else []
    if len(obs_ids) >= room:
        traj.finish = "length"


def _observation_ids(traj: Trajectory, tokens: list[int], reaction: _Reaction, setup: Setup) -> list[int]:
    """The token ids of a reaction's observation: with the template, its messages rendered after what the
    model sampled of its end-of-turn (images expanded), and added to the conversation; else its text."""
    if setup.renderer is not None:
        sampled = setup.tokenizer.decode(tokens, skip_special_tokens=False)
        text = setup.renderer.observation_text(template_messages(reaction.messages), sampled)
        if reaction.images:
            text = expanded(setup.vision, text, [reaction.images])
        obs_ids = setup.renderer.encode(text)
        traj.messages.extend(reaction.messages)
    else:
        text = reaction.text or "\n".join(m["content"] for m in reaction.messages)
        obs_ids = list(setup.tokenizer(text, add_special_tokens=False)["input_ids"])
    return obs_ids
