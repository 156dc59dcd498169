"""Run a batch of blocking calls (environment steps, tool calls) concurrently, each with a deadline.

    outcomes = run_concurrently([lambda: env.step(text) for env, text in pairs], timeout_s=30.0)
    outcomes[i].value / .error / .timed_out

Each call runs on its own daemon thread, so one slow episode does not serialise the others and a
call that never returns cannot keep the trainer from exiting. A call still running at its deadline
is abandoned (its thread is left to finish or hang on its own; Python cannot kill a thread): the
caller must not touch what that call owns again. Every call's deadline is `timeout_s` after the
batch started, so a batch takes at most `timeout_s` (plus thread start-up).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one call did: returned `value`, raised `error`, or was still running (`timed_out`)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class _Call(threading.Thread):
    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True, name="rlcore-call")
        self.fn, self.outcome = fn, None

    def run(self) -> None:
        try:
            self.outcome = Outcome(value=self.fn())
        except BaseException as e:  # an env or tool failure is data for the caller, never a crash here
            self.outcome = Outcome(error=e)


def run_concurrently(fns: Sequence[Callable[[], Any]], *, timeout_s: float | None) -> list[Outcome]:
    """The outcome of each call of `fns`, run at once on daemon threads (`None`: no deadline)."""
    if len(fns) == 1 and timeout_s is None:  # nothing to overlap: no thread
        call = _Call(fns[0])
        call.run()
        return [call.outcome]
    calls = [_Call(fn) for fn in fns]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for call in calls:
        call.start()
    for call in calls:
        call.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [Outcome(timed_out=True) if call.is_alive() else call.outcome for call in calls]
