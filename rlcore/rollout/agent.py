"""The multi-turn agent loop: the model calls tools, the loop appends their results, over any engine.

    rollouts = run_agent(engine, prompts, SamplingParams(n=8, max_tokens=96), tokenizer)

Each prompt row is repeated `sampling.n` times (same `uid`). The first turn samples the n responses of
each prompt in one `engine.generate(prompts, n)` call; then, turn by turn, every unfinished sample's
context (prompt + its response so far, as token ids) is sent to `engine.generate` with n = 1. Every
call adds the tool-call end `</tool>` to the stop strings and asks for the largest remaining budget:

- the turn's sampled token ids are appended as they are (never decoded and re-encoded), with
  `response_mask = 1` and their `rollout_logprobs`;
- a turn whose text contains `</tool>` is a tool call (format: `rlcore.rollout.tools`): the loop parses
  `<tool>NAME: ARGUMENT</tool>`, runs `tools[NAME](ARGUMENT)` and appends the tokens of
  `<result>OBSERVATION</result>` with `response_mask = 0`, `response_attention = 1` and log-prob 0;
  a malformed call, an unknown tool or a tool that raises gives `<result>error: MESSAGE</result>`
  (`tool_format` changes the four tags);
- any other turn end is the answer (EOS, or one of `sampling.stop_strings`): finish_reason "stop";
- the whole response (model tokens and observations) holds at most `sampling.max_tokens` tokens;
  reaching it ends the sample with finish_reason "length" (an observation is cut to fit);
- a tool call in turn `max_turns` ends the sample unanswered: finish_reason "max_turns".

The output has the fields of `rlcore.rollout.base` (finish_reason may also be "max_turns") plus
`num_turns`, `num_tool_calls`, `num_tool_errors` ((b*n,) long). Because every turn is generated from the
exact token context a teacher-forced pass over prompt + response sees (positions continue across
turns), the trainer's recomputed log-probs match `rollout_logprobs` on the `response_mask` tokens.
Each turn re-encodes its context (no cache is kept between turns); an engine with prefix caching
(vLLM) reuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, pad_token_id
from rlcore.rollout.base import RolloutEngine, SamplingParams
from rlcore.rollout.tools import DEFAULT_FORMAT, TOOLS, Tool, ToolError, ToolFormat

_TURN_SEED_STRIDE = 1_000_003  # turn k of a seeded call samples with seed + k * stride


@dataclasses.dataclass
class _Trajectory:
    """One sample's growing response (plain lists; turned into tensors once at the end)."""

    context: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def append(self, tokens: list[int], logprobs: list[float], *, generated: bool) -> None:
        self.context += tokens
        self.tokens += tokens
        self.mask += [1.0 if generated else 0.0] * len(tokens)
        self.logprobs += logprobs if generated else [0.0] * len(tokens)


@dataclasses.dataclass(frozen=True)
class _Env:
    """What every turn needs besides the trajectory: how to tokenize, the tools, the limits."""

    tokenizer: Any
    tools: dict[str, Tool]
    fmt: ToolFormat
    budget: int
    max_chars: int


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
) -> Batch:
    """Roll out `sampling.n` multi-turn samples per prompt row (see the module docstring)."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if sampling.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens={sampling.max_tokens}: must be >= 1")
    tools = TOOLS if tools is None else tools
    env = _Env(tokenizer, tools, tool_format, sampling.max_tokens, max_observation_chars)
    rows = prompts.repeat_interleave(sampling.n)
    pad = pad_token_id(tokenizer)
    trajectories = [
        _Trajectory(context=ids[m.bool()].tolist())
        for ids, m in zip(rows["input_ids"].cpu(), rows["attention_mask"].cpu(), strict=True)
    ]
    for turn in range(max_turns):
        active = [t for t in trajectories if t.finish is None]
        if not active:
            break
        sp = _turn_sampling(sampling, env, active, turn)
        if turn == 0:  # the n samples of a prompt share their context: the engine prefills it once
            contexts = _context_batch(active[:: sampling.n], pad)
            out = engine.generate(contexts, dataclasses.replace(sp, n=sampling.n))
        else:
            out = engine.generate(_context_batch(active, pad), sp)
        for j, traj in enumerate(active):
            _take_turn(traj, out, j, env, last=turn == max_turns - 1)
    return _assemble(rows, trajectories, pad)


def _turn_sampling(
    sampling: SamplingParams, env: _Env, active: list[_Trajectory], turn: int
) -> SamplingParams:
    budget = max(env.budget - len(t.tokens) for t in active)
    close = env.fmt.call_close
    stops = sampling.stop_strings if close in sampling.stop_strings else (*sampling.stop_strings, close)
    seed = None if sampling.seed is None else sampling.seed + turn * _TURN_SEED_STRIDE
    return dataclasses.replace(sampling, n=1, max_tokens=budget, stop_strings=stops, seed=seed)


def _context_batch(active: list[_Trajectory], pad: int) -> Batch:
    input_ids, attention_mask, position_ids = left_pad([t.context for t in active], pad)
    return Batch.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    )


def _take_turn(traj: _Trajectory, out: Batch, j: int, env: _Env, *, last: bool) -> None:
    """Append row `j` of a turn's output to `traj`, run its tool call if any, and set `traj.finish`."""
    n = int(out["response_attention"][j].sum())
    tokens, logprobs = out["responses"][j, :n].tolist(), out["rollout_logprobs"][j, :n].tolist()
    room = env.budget - len(traj.tokens)
    traj.turns += 1
    traj.append(tokens[:room], logprobs[:room], generated=True)
    if n > room or out["finish_reason"][j] == "length":
        traj.finish = "length"
        return
    text = env.tokenizer.decode(tokens, skip_special_tokens=True)
    if env.fmt.call_close not in text:
        traj.finish = "stop"
        return
    if last:
        traj.finish = "max_turns"
        return
    observation, error = observe(text, env.tools, fmt=env.fmt, max_chars=env.max_chars)
    traj.tool_calls += 1
    traj.tool_errors += int(error)
    obs_ids = list(env.tokenizer(observation, add_special_tokens=False)["input_ids"])
    room = env.budget - len(traj.tokens)
    traj.append(obs_ids[:room], [], generated=False)
    if len(obs_ids) >= room:
        traj.finish = "length"


def _assemble(rows: Batch, trajectories: list[_Trajectory], pad: int) -> Batch:
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
        name: torch.tensor([getattr(x, name) for x in trajectories], dtype=torch.long, device=device)
        for name in ("turns", "tool_calls", "tool_errors")
    }
    return rows.with_(
        responses=responses.to(device),
        response_mask=mask.to(device),
        response_attention=attention.to(device),
        rollout_logprobs=logprobs.to(device),
        finish_reason=[x.finish or "length" for x in trajectories],
        num_turns=counts["turns"],
        num_tool_calls=counts["tool_calls"],
        num_tool_errors=counts["tool_errors"],
    )


@dataclasses.dataclass
class AgentEngine:
    """A `RolloutEngine` whose `generate` is the agent loop over `inner` (the trainer's multi-turn mode).

    Everything that takes an engine (the step's rollout, validation, ReMax's greedy baseline) then
    rolls out multi-turn; weights, sleep and wake go to `inner`.
    """

    inner: RolloutEngine
    tokenizer: Any
    max_turns: int = 4
    tools: dict[str, Tool] | None = None

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        return run_agent(
            self.inner, prompts, sampling, self.tokenizer, tools=self.tools, max_turns=self.max_turns
        )

    def load_weights(self, named_tensors: Any) -> None:
        self.inner.load_weights(named_tensors)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()
