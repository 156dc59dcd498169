"""Scoring a batch of responses in parallel, with a per-sample timeout, without ever taking the run down.

    with RewardScorer(custom=None, data_sources={"openai/gsm8k"}, num_workers=8, timeout_s=10) as scorer:
        scores = scorer.score(data_sources, responses, ground_truths, extra_infos)   # every step

Workers are `multiprocessing` processes of the "forkserver" context (the server preloads the
trainer's main module and `rlcore.rewards.worker` once, so a new worker starts in milliseconds),
started once and kept across steps. Each runs one sample at a time. A sample whose function raises
(or returns something that is not a finite number / a dict with a finite 'score') or whose worker
dies gets `failure_score` and counts in `errors`; a sample still running after `timeout_s` gets
`failure_score` and counts in `timeouts`, and its worker is killed with its whole process group
(anything the reward function started) and replaced. The first traceback and the first timeout
are logged once. If more than `max_error_rate` of a step's samples fail, `RewardError` is raised:
the reward itself is broken. With `num_workers=0` the function runs in this process (no timeout).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from contextlib import suppress
from multiprocessing.connection import Connection, wait
from typing import Any

from rlcore.rewards.custom import RewardSpecError, split_spec
from rlcore.rewards.dispatch import find_reward, resolve_reward_fn, unknown_sources_error
from rlcore.rewards.worker import Outcome, call_reward, serve

logger = logging.getLogger(__name__)
PRELOAD = ["__main__", "rlcore.rewards.worker"]
_LIVE: weakref.WeakSet[RewardScorer] = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's own exit hook, so it runs first: that hook joins
def _close_live_scorers() -> None:  # the (non-daemon) workers and would wait forever on open ones
    for scorer in list(_LIVE):
        scorer.close()


class RewardError(RuntimeError):
    """The reward function is broken: too many samples of a step failed, or a worker cannot start."""


@dataclasses.dataclass(frozen=True)
class Scores:
    """Per-sample results of one `RewardScorer.score` call."""

    scores: tuple[float, ...]
    """The score of each sample (`failure_score` where it failed)."""
    extras: tuple[dict[str, float], ...]
    """Numeric extra values of each sample (the non-'score' keys of a returned dict); {} if none/failed."""
    status: tuple[str, ...]
    """'ok', 'error' or 'timeout' per sample."""

    @property
    def errors(self) -> int:
        return self.status.count("error")

    @property
    def timeouts(self) -> int:
        return self.status.count("timeout")

    def extra_means(self) -> dict[str, float]:
        """Mean of each extra key over the samples that reported it."""
        sums: dict[str, list[float]] = {}
        for extras in self.extras:
            for key, value in extras.items():
                sums.setdefault(key, []).append(value)
        return {key: math.fsum(values) / len(values) for key, values in sums.items()}


@dataclasses.dataclass
class _Worker:
    process: Any  # multiprocessing.Process
    conn: Connection
    deadline: float  # start-up deadline until ready; then the running sample's deadline (inf when idle)
    ready: bool = False
    task: int | None = None  # index of the sample it is scoring


class RewardScorer:
    """Scores responses with the run's reward function (see the module docstring)."""

    def __init__(
        self,
        custom: str | None = None,
        *,
        data_sources: Iterable[str] = (),
        num_workers: int = 0,
        timeout_s: float = 10.0,
        failure_score: float = 0.0,
        max_error_rate: float = 0.5,
        start_timeout_s: float = 120.0,
        math_verifier: str = "verl",
    ) -> None:
        _check_options(num_workers, timeout_s, failure_score, max_error_rate, start_timeout_s)
        self.num_workers, self.timeout_s, self.start_timeout_s = num_workers, timeout_s, start_timeout_s
        self.failure_score, self.max_error_rate = failure_score, max_error_rate
        self._sources = tuple(sorted(set(data_sources)))
        # raises here, at start-up, if unusable
        self._fn = resolve_reward_fn(self._sources, custom, math_verifier)
        self._math_verifier = math_verifier
        self._custom = None if custom is None else ":".join(map(str, split_spec(custom)))  # absolute path
        self._logged_error = self._logged_timeout = False
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)  # a scorer dropped unclosed
        _LIVE.add(self)
        if num_workers:
            self._ctx = _context()
            self._workers.extend(self._start() for _ in range(num_workers))

    def covers(self, data_source: str) -> bool:
        """Whether a reward function scores `data_source` (the custom one scores every data_source)."""
        return self._custom is not None or find_reward(data_source) is not None

    def score(
        self,
        data_sources: Sequence[str],
        solutions: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any],
    ) -> Scores:
        """Score every sample; raise `RewardError` if more than `max_error_rate` of them failed."""
        tasks = list(zip(data_sources, solutions, ground_truths, extra_infos, strict=True))
        unknown = {s for s in data_sources if find_reward(s) is None} if self._custom is None else set()
        if unknown:
            raise unknown_sources_error(unknown)
        if self.num_workers and not self._workers:
            raise RewardError("RewardScorer.score called after close()")
        if self._workers:
            try:
                outcomes = self._run_pool(tasks)
            except BaseException:  # workers may hold samples of this step: never reuse them
                self.close()
                raise
        else:
            outcomes = [call_reward(self._fn, *task) for task in tasks]
        return self._collect(outcomes, data_sources)

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (empty in-process or after `close`)."""
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Kill the workers (idempotent)."""
        _kill_all(self._workers)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pool ---------------------------------------------------------------------------------

    def _start(self) -> _Worker:
        parent_end, child_end = self._ctx.Pipe()
        process = self._ctx.Process(  # not daemonic: reward functions may start processes of their own
            target=serve,
            args=(child_end, self._custom, self._sources, self._math_verifier),
            name="rlcore-reward",
            daemon=False,
        )
        process.start()
        child_end.close()  # so that the worker's death reads as EOF here
        return _Worker(process=process, conn=parent_end, deadline=time.monotonic() + self.start_timeout_s)

    def _replace(self, worker: _Worker) -> None:
        _kill(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def _run_pool(self, tasks: list[tuple]) -> list[Outcome]:
        outcomes: list[Any] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        while queue or any(w.task is not None for w in self._workers):
            for w in list(self._workers):
                if w.ready and w.task is None and queue:
                    self._send(w, queue.popleft(), tasks, queue, outcomes)
            waiting = {w.conn: w for w in self._workers if w.task is not None or not w.ready}
            if not waiting:  # every remaining sample failed to be sent
                continue
            timeout = max(0.0, min(w.deadline for w in waiting.values()) - time.monotonic())
            for conn in wait(list(waiting), timeout):
                self._receive(waiting[conn], outcomes)
            self._expire(outcomes)
        return outcomes

    def _send(
        self, worker: _Worker, index: int, tasks: list[tuple], queue: deque, outcomes: list[Any]
    ) -> None:
        try:
            worker.conn.send(tasks[index])
        except (BrokenPipeError, ConnectionError, EOFError):  # died while idle: replace it, retry the sample
            queue.appendleft(index)
            self._replace(worker)
            return
        except Exception:  # the sample cannot be pickled (nothing was written)
            outcomes[index] = ("error", traceback.format_exc())
            return
        worker.task, worker.deadline = index, time.monotonic() + self.timeout_s

    def _receive(self, worker: _Worker, outcomes: list[Any]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)
            if worker.task is None:
                raise RewardError(
                    f"a reward worker exited (code {worker.process.exitcode}) before it was ready"
                ) from None
            outcomes[worker.task] = ("error", f"reward worker died (exit code {worker.process.exitcode})\n")
            self._replace(worker)
            return
        if message[0] == "ready":
            worker.ready, worker.deadline = True, math.inf
        elif message[0] == "failed":
            raise RewardError(f"a reward worker could not load the reward function: {_last_line(message[1])}")
        else:
            outcomes[worker.task] = message
            worker.task, worker.deadline = None, math.inf

    def _expire(self, outcomes: list[Any]) -> None:
        now = time.monotonic()
        for worker in [w for w in self._workers if w.deadline <= now]:
            if worker.task is None:
                raise RewardError(
                    f"a reward worker did not start within start_timeout_s={self.start_timeout_s}"
                )
            outcomes[worker.task] = ("timeout", self.timeout_s)
            self._replace(worker)

    # -- results ------------------------------------------------------------------------------------

    def _collect(self, outcomes: list[Outcome], data_sources: Sequence[str]) -> Scores:
        status = tuple(o[0] for o in outcomes)
        scores = tuple(o[1] if o[0] == "ok" else self.failure_score for o in outcomes)
        extras = tuple(o[2] if o[0] == "ok" else {} for o in outcomes)
        result = Scores(scores=scores, extras=extras, status=status)
        first_error = next((i for i, o in enumerate(outcomes) if o[0] == "error"), None)
        first_timeout = next((i for i, o in enumerate(outcomes) if o[0] == "timeout"), None)
        failed = result.errors + result.timeouts  # past the rate: one line, no traceback logged
        if outcomes and failed > self.max_error_rate * len(outcomes):
            first = _last_line(outcomes[first_error][1]) if first_error is not None else "timeouts only"
            raise RewardError(
                f"the reward failed on {failed} of {len(outcomes)} samples in this step ({result.errors} raised, "
                f"{result.timeouts} timed out after {self.timeout_s} s), more than max_error_rate="
                f"{self.max_error_rate}; first error: {first}. Fix the reward function, or raise "
                "--reward.max-error-rate / --reward.timeout-s"
            )
        if first_error is not None and not self._logged_error:
            self._logged_error = True
            logger.error(
                "reward function failed on a data_source=%r sample; it scores failure_score=%s and counts in "
                "reward/errors (only this first traceback is logged):\n%s",
                data_sources[first_error],
                self.failure_score,
                outcomes[first_error][1],
            )
        if first_timeout is not None and not self._logged_timeout:
            self._logged_timeout = True
            logger.warning(
                "reward function ran past timeout_s=%s on a data_source=%r sample; its worker was killed and "
                "replaced, the sample scores failure_score=%s and counts in reward/timeouts (logged once)",
                self.timeout_s,
                data_sources[first_timeout],
                self.failure_score,
            )
        return result


def _check_options(
    num_workers: int, timeout_s: float, failure_score: float, max_error_rate: float, start_timeout_s: float
) -> None:
    """Raise RewardSpecError (a user error: one line, exit code 2 in train.py) on a bad option."""
    if not isinstance(num_workers, int) or num_workers < 0:
        raise RewardSpecError(
            f"--reward.num-workers={num_workers!r}: expected an integer >= 0 (0 = in-process)"
        )
    if not timeout_s > 0:
        raise RewardSpecError(f"--reward.timeout-s={timeout_s!r}: expected a number of seconds > 0")
    if not start_timeout_s > 0:
        raise RewardSpecError(f"start_timeout_s={start_timeout_s!r}: expected a number of seconds > 0")
    if not math.isfinite(failure_score):
        raise RewardSpecError(f"--reward.failure-score={failure_score!r}: expected a finite number")
    if not 0 <= max_error_rate <= 1:
        raise RewardSpecError(f"--reward.max-error-rate={max_error_rate!r}: expected a fraction in [0, 1]")


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # only takes effect if the fork server is not running yet
    return ctx


def _kill(worker: _Worker) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.process.pid, signal.SIGKILL)  # the worker's group: it and its children
    if worker.process.is_alive():  # not yet in its own group (still starting)
        worker.process.kill()
    worker.process.join()
    worker.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    while workers:
        _kill(workers.pop())


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"
