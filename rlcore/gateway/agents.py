"""Agents written against the `openai` client, rolled out through the gateway: `--rollout.agent FILE.py:FN`.

    async def run(client: openai.AsyncOpenAI, row: dict) -> float | dict | None:
        reply = await client.chat.completions.create(model="any", messages=row["prompt"])
        ...                                  # tools, more turns, anything the agent does
        return 1.0                            # or None: the row's reward function scores the final answer

`GatewayAgentEngine` is a rollout engine (`rlcore.rollout.base`) around the trainer's own engine. Its `generate`
runs the agent `n` times per prompt row, each run with its own session (`rlcore.gateway.server`: the
client's base URL, `/s/<session>/v1`, with the run's random key as its API key; the session names are
random too, so no other process on the machine can post into an episode), at most `concurrency` at once
on one asyncio loop, while the gateway batches their requests into the inner engine. Then each session's
recorded calls become training rows from their token ids alone (`rlcore.gateway.record`): one row per
segment, so a session whose history broke the prefix chain (a template that drops `<think>`, an edited
history) gives several rows, each counted in `agent_split`. A session without a call gives one empty row
(it trains nothing; its group keeps n rows or more).

The run decides how the policy samples, whatever the agent asks: temperature, top-p and top-k are the
run's (`SamplingParams` of the step; greedy in validation), and each call's
`max_tokens` is at most the run's `--rollout.max-tokens`, which also bounds a whole trajectory's response
(observations included; a longer one is cut, finish_reason "length"). The trainer's log-probs assume
exactly these settings, so the agent cannot move the policy off them.

The row an agent gets is verl's: `prompt` (chat messages), `data_source`, `reward_model.ground_truth`,
`extra_info`. What it returns: a number (the reward of every row of its session), a dict with `reward`
(and more numbers, logged as `agent/<key>` means), or None (the row's reward function scores the
response). An agent that raises, returns something else or runs past `timeout_s` is a failed episode:
its rows score `failure_score` and count in `agent/failures`; the run goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import itertools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from rlcore.batch import Batch
from rlcore.data.prompts import pad_token_id
from rlcore.gateway.record import Call, RecordedSample, sample, segments, to_batch
from rlcore.rewards.custom import existing_file, import_file, split_spec
from rlcore.rollout.agent.env import EnvSpecError
from rlcore.rollout.base import RolloutEngine, SamplingParams, Wrapping

log = logging.getLogger(__name__)

AGENT_FLAG = "--rollout.agent"

Agent = Callable[[Any, dict], Awaitable[Any]]
"""`async def run(client: openai.AsyncOpenAI, row: dict) -> float | dict | None`."""

GIVEN = "agent_rewards"
"""(b,) float64: the reward each row's agent returned, NaN where it left the scoring to the reward function
(`rlcore.rewards.step.score_step(given=...)`)."""


def load_agent(spec: str) -> Agent:
    """The agent function named by `spec` ('path/to/file.py:function'), checked to be `async def f(client,
    row)`, or a `verifiers` environment's rollouts ('verifiers:<module>', `rlcore.gateway.verifiers_env`);
    a bad spec is an `EnvSpecError` (one line naming the flag and the fix)."""
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        raise EnvSpecError(f"{AGENT_FLAG}: {', '.join(missing)} not installed; pip install -e '.[gateway]'")
    if str(spec).startswith("verifiers:"):
        from rlcore.gateway.verifiers_env import verifiers_agent

        return verifiers_agent(spec[len("verifiers:") :])
    path, name = split_spec(spec, flag=AGENT_FLAG, error=EnvSpecError, form="function", example="agent.py:run")
    path = existing_file(path, spec, flag=AGENT_FLAG, error=EnvSpecError)
    fn = getattr(import_file(AGENT_FLAG, spec, path, EnvSpecError), name, None)
    if not inspect.iscoroutinefunction(fn):
        what = "nothing" if fn is None else f"a {type(fn).__name__}"
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: {name!r} in {path.name} is {what}; write it as "
                           "`async def run(client, row)`")  # fmt: skip
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as e:
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                           f"{name}(client, row) ({e})") from None  # fmt: skip
    return fn


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
    """How one episode ended."""

    reward: float | None
    """The agent's reward (None: the reward function scores the rows)."""
    failed: bool = False
    """The agent raised, returned something unusable or timed out (its rows score `failure_score`)."""
    extras: dict[str, float] = dataclasses.field(default_factory=dict)
    """The other numbers of a returned dict."""


def outcome_of(value: Any) -> EpisodeOutcome:
    """An agent's return value as an `EpisodeOutcome` (raises ValueError for anything else)."""
    if value is None:
        return EpisodeOutcome(None)
    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        raise ValueError(f"returned a {type(value).__name__}; return a number, a dict with 'reward', or None")
    if not isinstance(value, dict):
        return EpisodeOutcome(float(value))
    numbers = {k: v for k, v in value.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    if "reward" not in value or (value["reward"] is not None and "reward" not in numbers):
        raise ValueError("returned a dict without a numeric 'reward' (None: the reward function scores it)")
    reward = numbers.pop("reward", None)
    return EpisodeOutcome(None if reward is None else float(reward), extras={k: float(v) for k, v in numbers.items()})


def agent_row(prompts: Batch, i: int) -> dict[str, Any]:
    """Prompt row `i` as verl's dataset row: prompt messages, data_source, reward_model, extra_info."""
    return {"prompt": list(prompts["raw_prompt"][i]), "data_source": prompts["data_source"][i],
            "reward_model": {"ground_truth": prompts["ground_truth"][i]},
            "extra_info": dict(prompts["extra_info"][i] or {})}  # fmt: skip


class GatewayAgentEngine(Wrapping):
    """`inner` driven by an openai-client agent through the gateway (module docstring)."""

    def __init__(self, inner: RolloutEngine, tokenizer: Any, agent: Agent, *, concurrency: int = 64,
                 timeout_s: float = 300.0, failure_score: float = 0.0, call_format: str = "hermes") -> None:  # fmt: skip
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}: must be >= 1")
        self.inner, self.tokenizer, self.agent = inner, tokenizer, agent
        self.concurrency, self.timeout_s, self.failure_score = concurrency, timeout_s, failure_score
        from rlcore.gateway.server import Gateway  # the server stack (the `gateway` extra), only when used

        self._key = secrets.token_urlsafe(32)  # the run's own: no other local process can post into it
        self.gateway = Gateway(inner, tokenizer, key=self._key, call_format=call_format).__enter__()
        self._episodes = itertools.count()
        self._live = 0  # episodes holding the concurrency gate: an engine call waits for their requests
        self.gateway.expect(lambda: self._live)

    def close(self) -> None:
        self.gateway.__exit__(None, None, None)
        self.inner.close()

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """`sampling.n` episodes per prompt row, as training rows (module docstring)."""
        prefix = f"e{next(self._episodes)}-{secrets.token_hex(16)}-"  # unguessable, even with the key
        sessions = [[f"{prefix}p{i}-s{j}" for j in range(sampling.n)] for i in range(len(prompts))]
        self.gateway.force(sampling)
        try:
            outcomes = asyncio.run(self._run_all(prompts, sessions))
            self.gateway.drain()  # what timed-out episodes still had queued is served before the rows
        finally:
            self.gateway.force(None)
        rows = self._rows(prompts, sessions, outcomes, sampling.max_tokens)
        self.gateway.discard(prefix)  # and nothing of this call's episodes is kept past it
        return rows

    async def _run_all(self, prompts: Batch, sessions: list[list[str]]) -> list[list[EpisodeOutcome]]:
        import openai

        gate = asyncio.Semaphore(self.concurrency)
        rows = [agent_row(prompts, i) for i in range(len(prompts))]
        # one HTTP connection pool for every episode, with the run's key; each episode's client differs by its
        # base URL alone, which carries its session
        async with openai.AsyncOpenAI(base_url=self.gateway.base_url, api_key=self._key, max_retries=0,
                                      timeout=self.timeout_s) as shared:  # fmt: skip
            runs = [[self._episode(gate, shared.with_options(base_url=self.gateway.url_for(s)), s, rows[i])
                     for s in row] for i, row in enumerate(sessions)]  # fmt: skip
            done = await asyncio.gather(*(r for row in runs for r in row))
        n = len(sessions[0]) if sessions else 0
        return [list(done[i * n : (i + 1) * n]) for i in range(len(sessions))]

    async def _episode(self, gate: asyncio.Semaphore, client: Any, session: str, row: dict) -> EpisodeOutcome:
        async with gate:
            self._live += 1
            try:
                value = await asyncio.wait_for(self.agent(client, row), self.timeout_s)
                return outcome_of(value)
            except Exception as e:  # the agent's own failure ends its episode, never the run
                why = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                log.warning("%s: episode %s failed: %s", AGENT_FLAG, session, why)
                return EpisodeOutcome(self.failure_score, failed=True)
            finally:
                self._live -= 1

    def _rows(self, prompts: Batch, sessions: list[list[str]], outcomes: list[list[EpisodeOutcome]],
              budget: int) -> Batch:  # fmt: skip
        """Every session's recorded calls as rows, with its prompt row's fields and its outcome."""
        samples: list[RecordedSample] = []
        source: list[tuple[int, EpisodeOutcome, bool]] = []  # (prompt row, outcome, a split's later segment)
        for i, (row_sessions, row_outcomes) in enumerate(zip(sessions, outcomes, strict=True)):
            for session, outcome in zip(row_sessions, row_outcomes, strict=True):
                calls = self.gateway.take(session) or [_empty(prompts, i)]
                for k, segment in enumerate(segments(calls)):
                    samples.append(sample(segment))
                    source.append((i, outcome, k > 0))
        rows = [i for i, _, _ in source]
        batch = to_batch(samples, pad_id=pad_token_id(self.tokenizer), max_response=budget,
                         uids=[prompts["uid"][i] for i in rows])  # fmt: skip
        given = [math.nan if o.reward is None else o.reward for _, o, _ in source]
        fields = {key: [prompts[key][i] for i in rows] for key in ("data_source", "ground_truth", "extra_info",
                                                                   "raw_prompt")}  # fmt: skip
        return batch.select(*(k for k in batch.keys() if k != "rollout_versions")).with_(  # noqa: SIM118
            **fields, **{GIVEN: torch.tensor(given, dtype=torch.float64)},
            agent_metrics=[o.extras for _, o, _ in source],
            agent_failed=torch.tensor([o.failed for _, o, _ in source]),
            agent_split=torch.tensor([split for _, _, split in source]),
        )


def _empty(prompts: Batch, i: int) -> Call:
    """A session without a call: the row's own prompt and no response (it trains nothing)."""
    ids = prompts["input_ids"][i][prompts["attention_mask"][i] != 0].tolist()
    return Call(tuple(ids), (), (), "stop", 0)
