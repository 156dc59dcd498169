"""Continuous batching in front of one `RolloutEngine`, and the record of what it sampled per session.

HTTP handlers run concurrently; the engine must not (the native engine's KV cache and generator are
not thread-safe, and one big `generate` is much cheaper than many small ones). So handlers only
`submit` (session, prompt ids, SamplingParams) and await a future; one worker thread owns the engine:

    loop: wait for a request, drain everything else pending,
          group the requests by SamplingParams (equal params -> one group),
          per group: left-pad the prompts into one prompt Batch, engine.generate(batch, params),
                     rows [i*n, (i+1)*n) answer request i (each prompt's n samples are consecutive;
                     a prompt that m requests ask is sent once with m*n samples where every
                     distinct prompt is asked m times: one prefill for all of them),
                     record each row as a `Call` under its session, stamped with `version`.

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
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad
from rlcore.gateway.record import Call
from rlcore.rollout.base import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Request:
    session: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    future: Future


_STOP = object()


class Batcher:
    """Owns `engine` on one worker thread; see the module docstring."""

    def __init__(self, engine: RolloutEngine, *, pad_id: int, version: int = 0) -> None:
        self.engine, self.pad_id = engine, pad_id
        self.version = version
        """The policy version stamped on each call from now on (its owner sets it after a weight push; the
        trainer's agent engine drops these stamps and stamps its batches itself, as for every engine)."""
        self.forced: SamplingParams | None = None
        """The run's sampling, imposed on every request while set (`forced`); None: the requests' own."""
        self.expected: Callable[[], int] | None = None
        """How many requests an engine call should wait for (the live episodes); None: none."""
        self.linger_s = 0.05
        """The longest wait for `expected` requests after the first one."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, list[Call]] = defaultdict(list)
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="gateway-engine", daemon=True)
        self._worker.start()

    def submit(self, session: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> Future:
        """A future of the `sampling.n` `Call`s sampled for `prompt_ids` (recorded under `session`)."""
        future: Future = Future()
        self._queue.put(_Request(session, tuple(prompt_ids), forced(sampling, self.forced), future))
        return future

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
        """Return once every request queued before this call has been served (a mark queued behind them is
        reached: the worker serves what it gathered before it looks at the queue again)."""
        mark: Future = Future()
        self._queue.put(mark)
        mark.result()

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._queue.put(_STOP)
        self._worker.join()

    def _run(self) -> None:
        while True:
            pending = self._gather()
            marks = [r for r in pending if isinstance(r, Future)]
            requests = [r for r in pending if r is not _STOP and not isinstance(r, Future)]
            groups: dict[SamplingParams, list[_Request]] = defaultdict(list)
            for request in requests:
                if request.future.set_running_or_notify_cancel():
                    groups[request.sampling].append(request)
            for sampling, group in groups.items():
                try:
                    self._serve(sampling, group)
                except Exception as e:  # the engine (or reading its output) failed: the handlers answer 500
                    log.error(
                        "gateway: engine call for %d requests failed: %s: %s", len(group), type(e).__name__, e
                    )
                    for request in group:
                        if not request.future.done():
                            request.future.set_exception(e)
            for mark in marks:
                mark.set_result(None)
            if _STOP in pending:
                return

    def _gather(self) -> list:
        """The next requests (and stop marks): the first to come, all that follow within the wait (above)."""
        pending = [self._queue.get()]
        deadline = time.monotonic() + self.linger_s
        while True:
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            left = deadline - time.monotonic()
            marked = any(r is _STOP or isinstance(r, Future) for r in pending)  # close / drain: no waiting
            if self.expected is None or len(pending) >= self.expected() or left <= 0 or marked:
                return pending
            try:
                pending.append(self._queue.get(timeout=left))
            except queue.Empty:
                return pending

    def _serve(self, sampling: SamplingParams, group: list[_Request]) -> None:
        """One engine call for `group`; each request's future gets its n calls, recorded first."""
        version = self.version
        prompts, rows = _shared_prompts(group, sampling.n)
        input_ids, attention_mask, position_ids = left_pad(prompts, self.pad_id)  # (b, p)
        batch = Batch.from_dict(
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        )
        per_prompt = sum(len(r) for r in rows) // len(prompts)  # samples of each prompt row
        out = self.engine.generate(batch, dataclasses.replace(sampling, n=per_prompt))
        results = [[_call(out, row, request.prompt_ids, version) for row in rows[i]]
                   for i, request in enumerate(group)]  # fmt: skip
        with self._lock:
            for request, calls in zip(group, results, strict=True):
                self._sessions[request.session].extend(calls)
        for request, calls in zip(group, results, strict=True):
            request.future.set_result(calls)


def _shared_prompts(group: list[_Request], n: int) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    """(the prompt rows of the engine call, the output rows of each request). Where every distinct prompt of
    the group is asked the same number of times m (GRPO's n episodes of one row all open with the same
    prompt), each is sent once with m * n samples, which the engine prefills once for all of them (as the
    agent loop's first turn does); otherwise every request is its own row."""
    asked: dict[tuple[int, ...], list[int]] = {}
    for i, request in enumerate(group):
        asked.setdefault(request.prompt_ids, []).append(i)
    counts = {len(v) for v in asked.values()}
    if len(counts) > 1 or counts == {1}:
        return [r.prompt_ids for r in group], [list(range(i * n, (i + 1) * n)) for i in range(len(group))]
    m = counts.pop()
    rows: list[list[int]] = [[] for _ in group]
    for u, requests in enumerate(asked.values()):
        for j, i in enumerate(requests):
            rows[i] = list(range((u * m + j) * n, (u * m + j + 1) * n))
    return list(asked), rows


def forced(asked: SamplingParams, run: SamplingParams | None) -> SamplingParams:
    """`asked` under the run's sampling `run`: its temperature, top-p, top-k and min-p, at most its `max_tokens`
    (the trainer's log-probs assume the run's distribution), and no seed: the engine's own generator runs on
    (one seed for every call would draw each turn's tokens from the same stream as the last turn's);
    `asked` itself without a run."""
    if run is None:
        return asked
    return dataclasses.replace(asked, temperature=run.temperature, top_p=run.top_p, top_k=run.top_k,
                               min_p=run.min_p, seed=None, max_tokens=min(asked.max_tokens, run.max_tokens))  # fmt: skip


def _call(out: Batch, row: int, prompt_ids: tuple[int, ...], version: int) -> Call:
    """Row `row` of an engine's output as a `Call` (its real tokens: `response_attention` 1)."""
    k = int(out["response_attention"][row].sum())
    ids = tuple(out["responses"][row, :k].tolist())
    logprobs = tuple(out["rollout_logprobs"][row, :k].tolist())
    return Call(prompt_ids, ids, logprobs, out["finish_reason"][row], version)
