"""The multi-turn agent loop over any engine: the model calls tools or acts in an environment, the loop
appends what comes back.

    rollouts = run_agent(engine, prompts, SamplingParams(n=8, max_tokens=96), tokenizer)          # built-in tools
    rollouts = run_agent(engine, prompts, sampling, tokenizer, chat_tools=load_tools("tools.py"))  # template calls
    rollouts = run_agent(engine, prompts, sampling, tokenizer, env=EnvOptions(cls=MyEnv), timeout_s=60)

Each prompt row is repeated `sampling.n` times (same `uid`). The first turn samples the n responses of
each prompt in one `engine.generate(prompts, n)` call (when the n contexts are equal); then, turn by
turn, every unfinished sample's context (prompt + its response so far, as token ids) is sent to
`engine.generate` with n = 1, asking for the largest remaining budget. After each model turn:

- the turn's sampled token ids are appended as they are (never decoded and re-encoded), with
  `response_mask = 1` and their `rollout_logprobs`;
- tool calls. With `chat_tools` and a chat template that has a tool role: calls in `call_format`
  (`rlcore.rollout.chat.TOOL_CALL_FORMATS`, Hermes `<tool_call>{json}</tool_call>` by default; several
  per turn allowed), each answered by a `tool` message; the prompts must be rendered with the tools'
  schemas (`PromptDataset(tools=...)`). Otherwise (the built-in tools, or `chat_tools` with a template
  without a tool role) `<tool>NAME: ARGUMENT</tool>` (`rlcore.rollout.tools`; `</tool>` is added to the
  stop strings), answered by `<result>OBSERVATION</result>`. A malformed call, an unknown tool or a
  tool that raises is an `error: MESSAGE` answer; a tool call in turn `max_turns` ends the sample
  unanswered (finish_reason "max_turns");
- environment (`env`, `rlcore.rollout.env`): one instance per sample, built with no arguments, reset
  before the first turn with the row (`options["row"]`) and a seed shared by the samples of a prompt.
  Its first observation, when not empty, follows the row's prompt as the next user message (the
  prompt tensors of the output include it). A turn without tool calls is its action: `step(text)`
  returns (observation, reward, terminated, truncated, info); terminated ends the sample with "stop",
  truncated with "truncated", turn `max_turns` with "max_turns"; else the observation follows.
  Rewards are summed into `env_rewards`. An env that raises, returns something malformed or misses
  `timeout_s` ends its episode ("env_error" / "env_timeout") with `failure_score`, and is never
  touched again; the other samples go on. Steps and tool calls of a turn run concurrently;
- without tools or an env, a turn's end is the answer: finish_reason "stop";
- observations get `response_mask = 0`, `response_attention = 1` and log-prob 0. With a chat template
  they are the new messages rendered by it (`rlcore.rollout.chat.ChatRenderer.observation_ids`: only
  the new messages, after what the model already sampled of its end-of-turn); without, their text;
- the whole response (model tokens and observations) holds at most `sampling.max_tokens` tokens;
  reaching it ends the sample with finish_reason "length" (an observation is cut to fit).

The output has the fields of `rlcore.rollout.base` plus `num_turns`, `num_tool_calls`, `num_tool_errors`,
`num_observation_tokens` ((b*n,) long); with an env `env_rewards` (float), `env_errors`, `env_timeouts`
(bool); with the template rendering, `retokenize_mismatch` (1.0 where re-rendering the whole
conversation would not give the tokens the policy saw: the template is not prefix-stable there). Because
every turn is generated from the exact token context a teacher-forced pass over prompt + response sees
(positions continue across turns), the trainer's recomputed log-probs match `rollout_logprobs` on the
`response_mask` tokens. Each turn re-encodes its context (no cache is kept between turns); an engine
with prefix caching (vLLM) reuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import zlib
from typing import Any

import torch

from rlcore.batch import Batch
from rlcore.data.images import with_image_parts
from rlcore.data.prompts import left_pad, pad_token_id, render_prompt
from rlcore.data.vision import VisionProcessor
from rlcore.rollout.agent_images import (
    Inputs,
    assembled_fields,
    context_fields,
    expanded,
    message_images,
    observation_inputs,
    template_messages,
)
from rlcore.rollout.base import RolloutEngine, SamplingParams, Wrapping
from rlcore.rollout.calls import Outcome, run_concurrently
from rlcore.rollout.chat import (
    TOOL_CALL_FORMATS,
    ChatRenderer,
    ChatTools,
    ToolCall,
    ToolCallFormat,
    call_tool,
    renders_roles,
)
from rlcore.rollout.env import EnvOutputError, Message, as_messages, checked_reset, checked_step
from rlcore.rollout.tools import DEFAULT_FORMAT, TOOLS, Tool, ToolError, ToolFormat

log = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 1_000_003  # turn k of a seeded call samples with seed + k * stride


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvOptions:
    """The environment of a run (`--rollout.env`): the class and the score of a faulty episode."""

    cls: type
    """Built with no arguments, one instance per sample (`rlcore.rollout.env`)."""
    failure_score: float = 0.0
    """The score of an episode whose environment raised, returned bad output or timed out."""


@dataclasses.dataclass
class _Trajectory:
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
class _Setup:
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


def run_agent(
    engine: RolloutEngine,
    prompts: Batch,
    sampling: SamplingParams,
    tokenizer: Any,
    *,
    tools: dict[str, Tool] | None = None,
    tool_format: ToolFormat = DEFAULT_FORMAT,
    max_turns: int = 4,
    max_observation_chars: int = 256,
    chat_tools: ChatTools | None = None,
    call_format: str = "hermes",
    env: EnvOptions | None = None,
    timeout_s: float | None = None,
    vision: VisionProcessor | None = None,
) -> Batch:
    """Roll out `sampling.n` multi-turn samples per prompt row (see the module docstring); `vision`: a
    vision-language policy's image processing (`rlcore.rollout.agent_images`)."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if sampling.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens={sampling.max_tokens}: must be >= 1")
    if call_format not in TOOL_CALL_FORMATS:
        raise ValueError(f"call_format={call_format!r}: expected one of {', '.join(TOOL_CALL_FORMATS)}")
    setup = _setup(tokenizer, tools, chat_tools, env)(
        fmt=tool_format,
        call_format=TOOL_CALL_FORMATS[call_format],
        budget=sampling.max_tokens,
        max_chars=max_observation_chars,
        timeout_s=timeout_s,
        vision=vision,
    )
    rows = prompts.repeat_interleave(sampling.n)
    pad = pad_token_id(tokenizer)
    images = list(rows["multi_modal_inputs"]) if "multi_modal_inputs" in rows else [{}] * len(rows)
    trajectories = [
        _Trajectory(context=ids[m.bool()].tolist(), messages=_messages(raw, bool(x)) if setup.renderer else None,
                    images=[x] if x else [])
        for ids, m, raw, x in zip(
            rows["input_ids"].cpu(), rows["attention_mask"].cpu(), _raw_prompts(rows), images, strict=True
        )
    ]  # fmt: skip
    if env is not None:
        _reset_all(trajectories, rows, setup, sampling.seed)
    prompt_ids = [list(t.context) for t in trajectories]
    try:
        for turn in range(max_turns):
            active = [t for t in trajectories if t.finish is None]
            if not active:
                break
            out = _generate(
                engine,
                active,
                _turn_sampling(sampling, setup, active, turn),
                pad,
                n=sampling.n if turn == 0 and len(active) == len(trajectories) else 1,
                vision=vision,
            )
            turn_tokens = [_take_turn(traj, out, j, setup) for j, traj in enumerate(active)]
            pending = [
                (t, tokens) for t, tokens in zip(active, turn_tokens, strict=True) if tokens is not None
            ]
            _react_all(pending, setup, last=turn == max_turns - 1)
    finally:
        _close_envs(trajectories, setup)
    return _assemble(rows, trajectories, prompt_ids, pad, setup)


def _setup(
    tokenizer: Any, tools: dict[str, Tool] | None, chat_tools: ChatTools | None, env: EnvOptions | None
) -> Any:
    """`_Setup` with the turn rules bound: the template renders when it has the roles in play (tool for
    chat tools, user for an env's observations); chat tools without a tool role take the `<tool>` format;
    with neither tools nor an env, the built-in tools."""
    chat = chat_tools is not None and renders_roles(tokenizer, ("tool",))
    templated = chat or (env is not None and renders_roles(tokenizer, ("user",)))
    renderer = ChatRenderer(tokenizer, chat_tools.schemas if chat else ()) if templated else None
    legacy = None
    if chat_tools is not None and not chat:
        legacy = {name: _one_argument(fn) for name, fn in chat_tools.functions.items()}
    elif chat_tools is None and env is None:
        legacy = TOOLS if tools is None else tools
    return functools.partial(
        _Setup, tokenizer=tokenizer, legacy_tools=legacy, chat_tools=chat_tools if chat else None,
        renderer=renderer, env=env,
    )  # fmt: skip


def _one_argument(fn: Any) -> Tool:
    return lambda argument: str(fn(argument))


def _raw_prompts(rows: Batch) -> list[Any]:
    return list(rows["raw_prompt"]) if "raw_prompt" in rows else [""] * len(rows)


def _messages(raw_prompt: Any, images: bool = False) -> list[Message]:
    """A row's prompt as chat messages (a string is one user message; "" none); with `images`, its
    `<image>` placeholders as image parts."""
    messages = as_messages(raw_prompt) if isinstance(raw_prompt, str) else [dict(m) for m in raw_prompt]
    return with_image_parts(messages) if images else messages


def _env_seed(uid: str, seed: int | None) -> int:
    """One seed per prompt (its samples play the same instance of the task), stable across runs."""
    return (zlib.crc32(str(uid).encode()) + _TURN_SEED_STRIDE * (seed or 0)) % 2**31


def _reset_all(trajectories: list[_Trajectory], rows: Batch, setup: _Setup, seed: int | None) -> None:
    """Build and reset one environment per sample (concurrently); the first observation follows the prompt."""
    cls = setup.env.cls

    def start(i: int) -> Any:
        row = {key: rows[key][i] for key in ("data_source", "ground_truth", "extra_info")}
        row["prompt"] = _raw_prompts(rows)[i]
        instance = cls()
        observation = checked_reset(
            instance.reset(seed=_env_seed(rows["uid"][i], seed), options={"row": row})
        )
        if not observation and not _messages(row["prompt"]):
            raise EnvOutputError(
                "reset returned no observation for a row without a prompt: nothing to answer"
            )
        return instance, observation, _observation_images(setup, observation)

    outcomes = run_concurrently([functools.partial(start, i) for i in range(len(trajectories))],
                                timeout_s=setup.timeout_s)  # fmt: skip
    for i, (traj, outcome) in enumerate(zip(trajectories, outcomes, strict=True)):
        if not outcome.ok:
            _fail(traj, outcome, setup, "reset")
            continue
        traj.env, observation, images = outcome.value
        messages = _messages(_raw_prompts(rows)[i], bool(traj.images)) + observation
        traj.images += [images] if images else []
        if observation:
            traj.context = _prompt_tokens(setup, messages, traj.images)
        if traj.messages is not None:
            traj.messages = messages


def _prompt_tokens(setup: _Setup, messages: list[Message], images: list[Inputs]) -> list[int]:
    if setup.renderer is not None and setup.vision is not None:
        text = setup.renderer.prompt_text(template_messages(messages))
        return setup.renderer.encode(expanded(setup.vision, text, images))
    if setup.renderer is not None:
        return setup.renderer.prompt_ids(messages)
    text, special = render_prompt(setup.tokenizer, messages)
    return list(setup.tokenizer(text, add_special_tokens=special)["input_ids"])


def _fail(traj: _Trajectory, outcome: Outcome, setup: _Setup, call: str) -> None:
    """End `traj` on an environment fault: the failure score, the env abandoned (never touched again)."""
    traj.env_fault = "timeout" if outcome.timed_out else "error"
    traj.finish = f"env_{traj.env_fault}"
    traj.env_reward = setup.env.failure_score
    traj.env = None
    what = f"timed out after {setup.timeout_s:g} s" if outcome.timed_out else _describe(outcome.error)
    _warn_once(f"environment {setup.env.cls.__name__}.{call} {what}; the episode ends with failure score "
               f"{setup.env.failure_score:g} (agent/env_errors, agent/env_timeouts count them)")  # fmt: skip


def _describe(error: BaseException | None) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"raised {type(error).__name__}: {lines[0] if lines else '(no message)'}"


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    key = message.split(";")[0][:120]
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def _turn_sampling(
    sampling: SamplingParams, setup: _Setup, active: list[_Trajectory], turn: int
) -> SamplingParams:
    budget = max(setup.budget - len(t.tokens) for t in active)
    stops = sampling.stop_strings
    close = setup.fmt.call_close
    if setup.legacy_tools is not None and close not in stops:  # a `<tool>` call ends the model's turn
        stops = (*stops, close)
    seed = None if sampling.seed is None else sampling.seed + turn * _TURN_SEED_STRIDE
    return dataclasses.replace(sampling, n=1, max_tokens=budget, stop_strings=stops, seed=seed)


def _generate(
    engine: RolloutEngine, active: list[_Trajectory], sp: SamplingParams, pad: int, *, n: int,
    vision: VisionProcessor | None,
) -> Batch:  # fmt: skip
    """One turn for every active sample; the first turn prefills each group's shared context once."""
    groups = [active[i : i + n] for i in range(0, len(active), n)]
    if n > 1 and all(t.context == g[0].context for g in groups for t in g):
        first = [g[0] for g in groups]
        return engine.generate(_context_batch(first, pad, vision), dataclasses.replace(sp, n=n))
    return engine.generate(_context_batch(active, pad, vision), sp)


def _context_batch(active: list[_Trajectory], pad: int, vision: VisionProcessor | None) -> Batch:
    input_ids, attention_mask, position_ids = left_pad([t.context for t in active], pad)
    fields = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if vision is not None:
        fields |= context_fields(vision, [t.context for t in active], [t.images for t in active], pad)
    return Batch.from_dict(fields)


def _take_turn(traj: _Trajectory, out: Batch, j: int, setup: _Setup) -> list[int] | None:
    """Append row `j` of a turn's output to `traj`; its tokens, or None when the budget ended the sample."""
    n = int(out["response_attention"][j].sum())
    tokens, logprobs = out["responses"][j, :n].tolist(), out["rollout_logprobs"][j, :n].tolist()
    room = setup.budget - len(traj.tokens)
    versions = out["rollout_versions"][j, :n].tolist()[:room] if "rollout_versions" in out else None
    traj.turns += 1
    traj.append(tokens[:room], logprobs[:room], generated=True, versions=versions)
    if traj.messages is not None:
        text = setup.tokenizer.decode(tokens[:room], skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": text})
    if n > room or out["finish_reason"][j] == "length":
        traj.finish = "length"
        return None
    return tokens


def _plan(traj: _Trajectory, tokens: list[int], setup: _Setup, last: bool) -> _Reaction | tuple[str, Any]:
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


def _chat_tool_results(setup: _Setup, calls: list[ToolCall]) -> _Reaction:
    answers = [call_tool(setup.chat_tools, c, max_chars=setup.max_chars) for c in calls]
    return _Reaction(messages=tuple(m for m, _ in answers), tool_calls=len(answers),
                     tool_errors=sum(e for _, e in answers))  # fmt: skip


def _legacy_tool_result(setup: _Setup, text: str) -> _Reaction:
    observation, error = observe(text, setup.legacy_tools, fmt=setup.fmt, max_chars=setup.max_chars)
    return _Reaction(text=observation, tool_calls=1, tool_errors=int(error))


def _env_step(env: Any, text: str, last: bool, setup: _Setup) -> _Reaction:
    step = checked_step(env.step(text))
    finish = "stop" if step.terminated else "truncated" if step.truncated else "max_turns" if last else None
    if finish:
        return _Reaction(reward=step.reward, finish=finish)
    images = _observation_images(setup, step.messages)
    return _Reaction(messages=tuple(step.messages), reward=step.reward, images=images)


def _observation_images(setup: _Setup, messages: list[Message]) -> Inputs | None:
    """The vision inputs of an observation's images (EnvOutputError where the loop cannot show them)."""
    if setup.renderer is None and message_images(messages):
        raise EnvOutputError(
            "an observation carries an image, but the tokenizer has no chat template to place it"
        )
    return observation_inputs(setup.vision, messages)


def _react_all(pending: list[tuple[_Trajectory, list[int]]], setup: _Setup, *, last: bool) -> None:
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
            _fail(traj, outcome, setup, "step")
        else:  # a tool that hung or broke the loop's own code: an error observation, the episode goes on
            what = f"timed out after {timeout:g} s" if outcome.timed_out else _describe(outcome.error)
            error = {"role": "tool", "name": "", "content": f"error: tool call {what}"}
            text = f"{setup.fmt.result_open}error: tool call {what}{setup.fmt.result_close}"
            _apply(traj, tokens, _Reaction(messages=(error,), text=text, tool_calls=1, tool_errors=1), setup)


def _apply(traj: _Trajectory, tokens: list[int], reaction: _Reaction, setup: _Setup) -> None:
    """Add a reaction to `traj`: rewards and counts, then its observation tokens (mask 0) or its end."""
    traj.env_reward += reaction.reward
    traj.tool_calls += reaction.tool_calls
    traj.tool_errors += reaction.tool_errors
    if reaction.finish is not None:
        traj.finish = reaction.finish
        return
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
    room = setup.budget - len(traj.tokens)
    if reaction.images and len(obs_ids) > room:  # an image is never cut: the sample ends before it
        traj.finish = "length"
        return
    traj.append(obs_ids[:room], [], generated=False)
    traj.images += [reaction.images] if reaction.images else []
    if len(obs_ids) >= room:
        traj.finish = "length"


def _close_envs(trajectories: list[_Trajectory], setup: _Setup) -> None:
    """`close()` every live environment (concurrently, errors ignored); drop them."""
    live = [t.env for t in trajectories if t.env is not None and callable(getattr(t.env, "close", None))]
    if live:
        run_concurrently([e.close for e in live], timeout_s=setup.timeout_s)
    for t in trajectories:
        t.env = None


def _assemble(
    rows: Batch, trajectories: list[_Trajectory], prompt_ids: list[list[int]], pad: int, setup: _Setup
) -> Batch:
    t = max((len(x.tokens) for x in trajectories), default=0)
    b = len(trajectories)
    responses = torch.full((b, t), pad, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.float32)
    attention = torch.zeros((b, t), dtype=torch.float32)
    logprobs = torch.zeros((b, t), dtype=torch.float32)
    for i, x in enumerate(trajectories):
        k = len(x.tokens)
        responses[i, :k] = torch.tensor(x.tokens, dtype=torch.long)
        mask[i, :k] = torch.tensor(x.mask)
        attention[i, :k] = 1.0
        logprobs[i, :k] = torch.tensor(x.logprobs, dtype=torch.float32)
    device = rows["input_ids"].device
    counts = {
        f"num_{name}": torch.tensor([getattr(x, name) for x in trajectories], dtype=torch.long, device=device)
        for name in ("turns", "tool_calls", "tool_errors", "observation_tokens")
    }
    fields: dict[str, Any] = {}
    if any(x.versions for x in trajectories):  # the engine tagged each token's version (partial rollouts)
        versions = torch.zeros((b, t), dtype=torch.long)
        for i, x in enumerate(trajectories):
            versions[i, : len(x.versions)] = torch.tensor(x.versions, dtype=torch.long)
        fields["rollout_versions"] = versions.to(device)
    if (
        setup.env is not None or setup.vision is not None
    ):  # the prompts the policy saw (+ a first observation)
        input_ids, attention_mask, position_ids = left_pad(prompt_ids, pad)
        fields |= {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
                   "position_ids": position_ids.to(device)}  # fmt: skip
    if setup.vision is not None:
        vision = assembled_fields(setup.vision, prompt_ids, [x.tokens for x in trajectories],
                                  [x.images for x in trajectories], t)  # fmt: skip
        fields |= {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vision.items()}
    if setup.env is not None:
        fields["env_rewards"] = torch.tensor(
            [x.env_reward for x in trajectories], dtype=torch.float32, device=device
        )
        for fault in ("error", "timeout"):
            fields[f"env_{fault}s"] = torch.tensor(
                [x.env_fault == fault for x in trajectories], device=device
            )
    if setup.renderer is not None:
        stable = [x.messages is None or _reencodes(setup, x) for x in trajectories]
        fields["retokenize_mismatch"] = torch.tensor(
            [not s for s in stable], dtype=torch.float32, device=device
        )
    return rows.with_(
        responses=responses.to(device),
        response_mask=mask.to(device),
        response_attention=attention.to(device),
        rollout_logprobs=logprobs.to(device),
        finish_reason=[x.finish or "length" for x in trajectories],
        **counts,
        **fields,
        overwrite=True,
    )


def _reencodes(setup: _Setup, traj: _Trajectory) -> bool:
    """Whether the whole conversation, rendered again (images expanded), gives the context the policy saw."""
    if setup.vision is None:
        return setup.renderer.reencodes(traj.messages, traj.context)
    text = setup.renderer.conversation_text(template_messages(traj.messages))
    return (
        setup.renderer.encode(expanded(setup.vision, text, traj.images))[: len(traj.context)] == traj.context
    )


@dataclasses.dataclass
class AgentEngine(Wrapping):
    """A `RolloutEngine` whose `generate` is the agent loop over `inner` (the trainer's multi-turn mode).

    Everything that takes an engine (the step's rollout, validation, ReMax's greedy baseline) then
    rolls out multi-turn; weights, sleep and wake go to `inner`.
    """

    inner: RolloutEngine
    tokenizer: Any
    max_turns: int = 4
    tools: dict[str, Tool] | None = None
    chat_tools: ChatTools | None = None
    call_format: str = "hermes"
    env: EnvOptions | None = None
    timeout_s: float | None = None
    vision: VisionProcessor | None = None

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        return run_agent(self.inner, prompts, sampling, self.tokenizer, tools=self.tools, max_turns=self.max_turns,
                         chat_tools=self.chat_tools, call_format=self.call_format, env=self.env,
                         timeout_s=self.timeout_s, vision=self.vision)  # fmt: skip
