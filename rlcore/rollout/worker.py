"""One engine worker: requests that arrive together become as few `generate` calls as their sampling allows.

Callers on many threads `submit` a prompt with its SamplingParams and get a future; one thread owns the
engine (the native engine's KV cache and generator are not thread-safe, and one big `generate` is much
cheaper than many small ones):

    loop: wait for a request, `gather` the ones that follow (the `Linger` policy says how long to wait),
          split them into groups by `key(i, sampling)` (equal keys -> one group, in order of arrival),
          per group: left-pad the prompts into one prompt Batch, engine.generate(batch, sampling),
                     hand each request its n samples (`Sample`), shaped by its `shape`,
                     or the exception of its group's call.

    from rlcore.rollout.worker import EngineWorker
    worker = EngineWorker(engine, pad_id=pad_id)
    samples = worker.submit((3, 4, 5), SamplingParams(n=2, max_tokens=8)).result()   # two `Sample`s
    worker.close()

The pieces are free functions too (`gather`, `grouped`, `generate`), for a server whose own thread runs
other work between engine calls (`rlcore.tinker.ops.Worker`: training operations in arrival order).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad
from rlcore.rollout.base import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled sequence: the engine's token ids, the log-prob of each, and why it ended."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    """"stop" (a stop token or string) or "length" (max_tokens reached)."""


GroupKey = Callable[[int, SamplingParams], Hashable]
"""(a request's place among those gathered, its sampling) -> its group: requests with equal keys share one call."""


def by_sampling(i: int, sampling: SamplingParams) -> Hashable:
    """Equal SamplingParams (the seed included) share one engine call."""
    return sampling


def grouped(samplings: Sequence[SamplingParams], key: GroupKey) -> list[list[int]]:
    """The indices of `samplings` in groups of equal `key`: groups in order of their first member, members
    in order."""
    groups: dict[Hashable, list[int]] = {}
    for i, sampling in enumerate(samplings):
        groups.setdefault(key(i, sampling), []).append(i)
    return list(groups.values())


def generate(
    engine: RolloutEngine, pad_id: int, prompts: Sequence[tuple[int, ...]], sampling: SamplingParams, *,
    share_prompts: bool = False,
) -> list[list[Sample]]:  # fmt: skip
    """One `engine.generate` for `prompts` (left-padded with `pad_id`): each prompt's `sampling.n` samples, in
    order. With `share_prompts`, where every distinct prompt is asked the same number of times m, each is sent
    once with m * n samples (one prefill for all of them); otherwise every prompt is its own row."""
    rows_in, rows = shared_prompts(prompts, sampling.n) if share_prompts else _own_rows(prompts, sampling.n)
    input_ids, attention_mask, position_ids = left_pad(rows_in, pad_id)  # (b, p)
    batch = Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})
    per_prompt = sum(len(r) for r in rows) // len(rows_in)  # samples of each prompt row
    out = engine.generate(batch, dataclasses.replace(sampling, n=per_prompt))
    return [[_sample(out, row) for row in own] for own in rows]


def _own_rows(prompts: Sequence[tuple[int, ...]], n: int) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    return list(prompts), [list(range(i * n, (i + 1) * n)) for i in range(len(prompts))]


def shared_prompts(prompts: Sequence[tuple[int, ...]], n: int) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    """(the prompt rows of the engine call, the output rows of each prompt). Where every distinct prompt is
    asked the same number of times m (GRPO's n episodes of one row all open with the same prompt), each is
    sent once with m * n samples, which the engine prefills once for all of them (as the agent loop's first
    turn does); otherwise every prompt is its own row."""
    asked: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        asked.setdefault(prompt, []).append(i)
    counts = {len(v) for v in asked.values()}
    if len(counts) > 1 or counts == {1}:
        return _own_rows(prompts, n)
    m = counts.pop()
    rows: list[list[int]] = [[] for _ in prompts]
    for u, askers in enumerate(asked.values()):
        for j, i in enumerate(askers):
            rows[i] = list(range((u * m + j) * n, (u * m + j + 1) * n))
    return list(asked), rows


def _sample(out: Batch, row: int) -> Sample:
    """Row `row` of an engine's output (its real tokens: `response_attention` 1)."""
    k = int(out["response_attention"][row].sum())
    return Sample(tuple(out["responses"][row, :k].tolist()), tuple(out["rollout_logprobs"][row, :k].tolist()),
                  out["finish_reason"][row])  # fmt: skip


class Linger(Protocol):
    def __call__(self, pending: list, first_at: float, last_at: float) -> float:
        """Seconds still to wait for more items after `pending` (the first came at `first_at`, the last at
        `last_at`, `time.monotonic()`); 0 or less: no more waiting."""
        ...


def after_last(seconds: float) -> Linger:
    """Wait up to `seconds` after each arrival (requests sent together arrive close to each other)."""
    return lambda pending, first_at, last_at: last_at + seconds - time.monotonic()


def gather(
    source: queue.Queue | queue.SimpleQueue, first: Any, linger: Linger, joins: Callable[[Any], bool] = lambda _: True
) -> tuple[list, Any | None]:
    """(`first` and the items of `source` that follow it, the item that ended the gathering or None): every
    item already waiting is taken, then more while `linger` says to wait; an item that `joins` refuses ends
    the gathering (the caller handles it next, before anything queued behind it)."""
    pending, first_at = [first], time.monotonic()
    last_at = first_at
    while True:
        left = linger(pending, first_at, last_at)
        try:
            item = source.get(timeout=left) if left > 0 else source.get_nowait()
        except queue.Empty:
            return pending, None
        if not joins(item):
            return pending, item
        pending.append(item)
        last_at = time.monotonic()


def _samples(samples: list[Sample], version: int) -> list[Sample]:
    return samples


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt to sample `sampling.n` sequences for; `future` gets `shape(its samples, the version)`."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    shape: Callable[[list[Sample], int], Any]
    future: Future


_STOP = object()


class EngineWorker:
    """Owns `engine` on one thread and serves the requests submitted to it in batches (module docstring).
    Requests whose `key` differs (another `max_tokens`, `stop` or `seed` for `by_sampling`) land in different
    groups. With a `seed`, a group's rows share one generator, so a seeded request's samples depend on its
    batch mates unless its `key` puts it in a group of its own."""

    def __init__(self, engine: RolloutEngine, *, pad_id: int, key: GroupKey = by_sampling,
                 share_prompts: bool = False, name: str = "rollout-engine") -> None:  # fmt: skip
        self.engine, self.pad_id, self.key, self.share_prompts = engine, pad_id, key, share_prompts
        self.version = 0
        """The version of the engine's weights (its owner sets it after a push): each request's `shape` gets
        the version current when its engine call started."""
        self.expected: Callable[[], int] | None = None
        """How many requests an engine call should wait for (e.g. the live episodes); None: none."""
        self.linger_s = 0.05
        """The longest wait for `expected` requests after the first one."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], sampling: SamplingParams,
               shape: Callable[[list[Sample], int], Any] = _samples) -> Future:  # fmt: skip
        """A future of `shape(the sampling.n samples of prompt, the weights' version)` (default: the samples);
        `shape` runs on the worker thread before the future is answered."""
        future: Future = Future()
        self._queue.put(Request(tuple(prompt), sampling, shape, future))
        return future

    def drain(self) -> None:
        """Return once every request queued before this call has been served (a mark queued behind them is
        reached: the worker serves what it gathered before it looks at the queue again)."""
        mark: Future = Future()
        self._queue.put(mark)
        mark.result()

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            pending, _ = gather(self._queue, self._queue.get(), self._linger)
            requests = [r for r in pending if isinstance(r, Request) and r.future.set_running_or_notify_cancel()]
            for members in grouped([r.sampling for r in requests], self.key):
                self._serve([requests[i] for i in members])
            for mark in pending:
                if isinstance(mark, Future):
                    mark.set_result(None)
            if _STOP in pending:
                return

    def _linger(self, pending: list, first_at: float, last_at: float) -> float:
        """Wait while fewer than `expected()` requests are pending, at most `linger_s` after the first; a
        `drain` or `close` mark ends the wait."""
        if any(r is _STOP or isinstance(r, Future) for r in pending) or self.expected is None:
            return 0.0
        return 0.0 if len(pending) >= self.expected() else first_at + self.linger_s - time.monotonic()

    def _serve(self, group: list[Request]) -> None:
        """One engine call for `group`: each future gets its shaped samples, or the call's exception."""
        version = self.version
        try:
            samples = generate(self.engine, self.pad_id, [r.prompt for r in group], group[0].sampling,
                               share_prompts=self.share_prompts)  # fmt: skip
            results = [r.shape(s, version) for r, s in zip(group, samples, strict=True)]
        except Exception as e:  # the engine (or reading its output) failed: every request of the group fails
            log.error("engine call for %d requests failed: %s: %s", len(group), type(e).__name__, e)
            for request in group:
                if not request.future.done():
                    request.future.set_exception(e)
            return
        for request, result in zip(group, results, strict=True):
            request.future.set_result(result)
