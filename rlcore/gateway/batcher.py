"""The gateway's engine worker, and the record of what it sampled per session.

HTTP handlers run concurrently; the engine must not. So handlers only `submit` (session, prompt ids,
SamplingParams) and await a future; one `rlcore.rollout.worker.EngineWorker` owns the engine and turns the
requests pending together into one `generate` per group of equal SamplingParams (the seed included). A
prompt that m requests of a group ask is sent once with m*n samples where every distinct prompt is asked m
times (one prefill for all of them). Each request's samples are recorded as `Call`s under its session,
stamped with `version`, before its future answers.

While the engine runs, new requests queue up, so 64 concurrent agents cost a handful of engine calls.
Before a call, the worker may wait for more: while fewer requests are pending than `expected()` (the
episodes that are live, when the caller knows them: `rlcore.gateway.agents`), for at most `linger_s`
after the first one. Without that, the first agent to ask would get an engine call of its own, as long
as the batch's that follows it.
Requests whose params differ (another `max_tokens`, `stop` or `seed`) land in different groups. With a
`seed`, a group's rows share one generator, so a seeded request's samples depend on its batch mates:
seeds make a whole engine call reproducible, not one request.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from rlcore.gateway.record import Call
from rlcore.rollout.base import RolloutEngine, SamplingParams
from rlcore.rollout.worker import EngineWorker, Sample


class Batcher:
    """Owns `engine` on one worker thread; see the module docstring."""

    def __init__(self, engine: RolloutEngine, *, pad_id: int, version: int = 0) -> None:
        self.engine, self.pad_id = engine, pad_id
        self.forced: SamplingParams | None = None
        """The run's sampling, imposed on every request while set (`forced`); None: the requests' own."""
        self._sessions: dict[str, list[Call]] = defaultdict(list)
        self._lock = threading.Lock()
        self._worker = EngineWorker(engine, pad_id=pad_id, share_prompts=True, name="gateway-engine")
        self._worker.version = version

    @property
    def version(self) -> int:
        """The policy version stamped on each call from now on (its owner sets it after a weight push; the
        trainer's agent engine drops these stamps and stamps its batches itself, as for every engine)."""
        return self._worker.version

    @version.setter
    def version(self, value: int) -> None:
        self._worker.version = value

    @property
    def expected(self) -> Callable[[], int] | None:
        """How many requests an engine call should wait for (the live episodes); None: none."""
        return self._worker.expected

    @expected.setter
    def expected(self, count: Callable[[], int] | None) -> None:
        self._worker.expected = count

    @property
    def linger_s(self) -> float:
        """The longest wait for `expected` requests after the first one."""
        return self._worker.linger_s

    @linger_s.setter
    def linger_s(self, seconds: float) -> None:
        self._worker.linger_s = seconds

    def submit(self, session: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> Future:
        """A future of the `sampling.n` `Call`s sampled for `prompt_ids` (recorded under `session`)."""
        prompt = tuple(prompt_ids)
        record = functools.partial(self._record, session, prompt)
        return self._worker.submit(prompt, forced(sampling, self.forced), record)

    def discard(self, prefix: str) -> None:
        """Forget every session whose name starts with `prefix` (calls no one will take)."""
        with self._lock:
            for session in [s for s in self._sessions if s.startswith(prefix)]:
                del self._sessions[session]

    def take(self, session: str) -> list[Call]:
        """Remove and return the calls recorded under `session`, in the order they were sampled."""
        with self._lock:
            return self._sessions.pop(session, [])

    def sessions(self) -> list[str]:
        """The sessions with recorded calls not yet taken."""
        with self._lock:
            return list(self._sessions)

    def drain(self) -> None:
        """Return once every request queued before this call has been served."""
        self._worker.drain()

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._worker.close()

    def _record(self, session: str, prompt: tuple[int, ...], samples: list[Sample], version: int) -> list[Call]:
        """A request's samples as `Call`s, recorded under `session` (on the worker thread, before its future
        answers)."""
        calls = [Call(prompt, s.tokens, s.logprobs, s.finish_reason, version) for s in samples]
        with self._lock:
            self._sessions[session].extend(calls)
        return calls


def forced(asked: SamplingParams, run: SamplingParams | None) -> SamplingParams:
    """`asked` under the run's sampling `run`: its temperature, top-p, top-k and min-p, at most its `max_tokens`
    (the trainer's log-probs assume the run's distribution), and no seed: the engine's own generator runs on
    (one seed for every call would draw each turn's tokens from the same stream as the last turn's);
    `asked` itself without a run."""
    if run is None:
        return asked
    return dataclasses.replace(asked, temperature=run.temperature, top_p=run.top_p, top_k=run.top_k,
                               min_p=run.min_p, seed=None, max_tokens=min(asked.max_tokens, run.max_tokens))  # fmt: skip
