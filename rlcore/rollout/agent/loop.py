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
  (`rlcore.rollout.agent.chat.TOOL_CALL_FORMATS`, Hermes `<tool_call>{json}</tool_call>` by default; several
  per turn allowed), each answered by a `tool` message; the prompts must be rendered with the tools'
  schemas (`PromptDataset(tools=...)`). Otherwise (the built-in tools, or `chat_tools` with a template
  without a tool role) `<tool>NAME: ARGUMENT</tool>` (`rlcore.rollout.agent.tools`; `</tool>` is added to the
  stop strings), answered by `<result>OBSERVATION</result>`. A malformed call, an unknown tool or a
  tool that raises is an `error: MESSAGE` answer; a tool call in turn `max_turns` ends the sample
  unanswered (finish_reason "max_turns");
- environment (`env`, `rlcore.rollout.agent.env`): one instance per sample, built with no arguments, reset
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
  they are the new messages rendered by it (`rlcore.rollout.agent.chat.ChatRenderer.observation_ids`: only
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

The loop is here; its parts live beside it: the run's settings and each sample's state
(`rlcore.rollout.agent.state`), the environments' reset, faults and close (`agent_envs`), the reactions
to a turn (`agent_turns`, with the `<tool>` format's `parse_tool_call` and `observe`), the output batch
(`agent_batch`) and a vision-language policy's images (`agent_images`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, pad_token_id
from rlcore.data.vision import VisionProcessor
from rlcore.rollout.agent.batch import assemble
from rlcore.rollout.agent.chat import TOOL_CALL_FORMATS, ChatRenderer, ChatTools, renders_roles
from rlcore.rollout.agent.envs import close_envs, reset_all
from rlcore.rollout.agent.images import context_fields
from rlcore.rollout.agent.state import TURN_SEED_STRIDE, EnvOptions, Setup, Trajectory, start_trajectories
from rlcore.rollout.agent.tools import DEFAULT_FORMAT, TOOLS, Tool, ToolFormat
from rlcore.rollout.agent.turns import observe, parse_tool_call, react_all
from rlcore.rollout.base import RolloutEngine, SamplingParams, Wrapping

__all__ = ["AgentEngine", "EnvOptions", "observe", "parse_tool_call", "run_agent"]


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
    vision-language policy's image processing (`rlcore.rollout.agent.images`)."""
    _check_arguments(max_turns, sampling, call_format)
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
    trajectories = start_trajectories(rows, setup)
    if env is not None:
        reset_all(trajectories, rows, setup, sampling.seed)
    prompt_ids = [list(t.context) for t in trajectories]
    try:
        for turn in range(max_turns):
            if not _play_turn(
                engine, trajectories, sampling, setup, pad, turn=turn, last=turn == max_turns - 1
            ):
                break
    finally:
        close_envs(trajectories, setup)
    return assemble(rows, trajectories, prompt_ids, pad, setup)


def _check_arguments(max_turns: int, sampling: SamplingParams, call_format: str) -> None:
    """Refuse a run that could not take one turn, or a tool-call format that does not exist."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if sampling.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens={sampling.max_tokens}: must be >= 1")
    if call_format not in TOOL_CALL_FORMATS:
        raise ValueError(f"call_format={call_format!r}: expected one of {', '.join(TOOL_CALL_FORMATS)}")


def _setup(
    tokenizer: Any, tools: dict[str, Tool] | None, chat_tools: ChatTools | None, env: EnvOptions | None
) -> Any:
    """`Setup` with the turn rules bound: the template renders when it has the roles in play (tool for
    chat tools, user for an env's observations); chat tools without a tool role take the `<tool>` format;
    with neither tools nor an env, the built-in tools."""
    chat = chat_tools is not None and renders_roles(tokenizer, ("tool",))
    templated = chat or (env is not None and renders_roles(tokenizer, ("user",)))
    renderer = ChatRenderer(tokenizer, chat_tools.schemas if chat else ()) if templated else None
    legacy = _legacy_tools(tools, chat_tools, env, chat=chat)
    return functools.partial(
        Setup, tokenizer=tokenizer, legacy_tools=legacy, chat_tools=chat_tools if chat else None,
        renderer=renderer, env=env,
    )  # fmt: skip


def _legacy_tools(
    tools: dict[str, Tool] | None, chat_tools: ChatTools | None, env: EnvOptions | None, *, chat: bool
) -> dict[str, Tool] | None:
    """The tools called in the `<tool>` format: chat tools whose template has no tool role (`chat`
    False), else with neither chat tools nor an env `tools` (the built-in ones by default), else none."""
    if chat_tools is not None and not chat:
        return {name: _one_argument(fn) for name, fn in chat_tools.functions.items()}
    if chat_tools is None and env is None:
        return TOOLS if tools is None else tools
    return None


def _one_argument(fn: Any) -> Tool:
    return lambda argument: str(fn(argument))


def _play_turn(
    engine: RolloutEngine, trajectories: list[Trajectory], sampling: SamplingParams, setup: Setup, pad: int,
    *, turn: int, last: bool,
) -> bool:  # fmt: skip
    """One model turn of every unfinished sample, and the reactions to it; False when none was left."""
    active = [t for t in trajectories if t.finish is None]
    if not active:
        return False
    out = _generate(
        engine,
        active,
        _turn_sampling(sampling, setup, active, turn),
        pad,
        n=sampling.n if turn == 0 and len(active) == len(trajectories) else 1,
        vision=setup.vision,
    )
    turn_tokens = [_take_turn(traj, out, j, setup) for j, traj in enumerate(active)]
    pending = [(t, tokens) for t, tokens in zip(active, turn_tokens, strict=True) if tokens is not None]
    react_all(pending, setup, last=last)
    return True


def _turn_sampling(
    sampling: SamplingParams, setup: Setup, active: list[Trajectory], turn: int
) -> SamplingParams:
    budget = max(setup.budget - len(t.tokens) for t in active)
    stops = sampling.stop_strings
    close = setup.fmt.call_close
    if setup.legacy_tools is not None and close not in stops:  # a `<tool>` call ends the model's turn
        stops = (*stops, close)
    seed = None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE
    return dataclasses.replace(sampling, n=1, max_tokens=budget, stop_strings=stops, seed=seed)


def _generate(
    engine: RolloutEngine, active: list[Trajectory], sp: SamplingParams, pad: int, *, n: int,
    vision: VisionProcessor | None,
) -> Batch:  # fmt: skip
    """One turn for every active sample; the first turn prefills each group's shared context once."""
    groups = [active[i : i + n] for i in range(0, len(active), n)]
    if n > 1 and all(t.context == g[0].context for g in groups for t in g):
        first = [g[0] for g in groups]
        return engine.generate(_context_batch(first, pad, vision), dataclasses.replace(sp, n=n))
    return engine.generate(_context_batch(active, pad, vision), sp)


def _context_batch(active: list[Trajectory], pad: int, vision: VisionProcessor | None) -> Batch:
    input_ids, attention_mask, position_ids = left_pad([t.context for t in active], pad)
    fields = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if vision is not None:
        fields |= context_fields(vision, [t.context for t in active], [t.images for t in active], pad)
    return Batch.from_dict(fields)


def _take_turn(traj: Trajectory, out: Batch, j: int, setup: Setup) -> list[int] | None:
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
