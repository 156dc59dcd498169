"""Ctrl-C and preemption: what SIGINT, SIGTERM and SIGUSR1 do to a run.

    preemption = Preemption(grace_s=60.0, newest=...)  # the run shell holds it: the one owner of the flag
    with preemption.handling():            # train.py's run: handlers installed, the old ones restored after
        ...
        if preemption.requested(group):    # after each step, on every rank alike (a reduced decision)
            save the finished step, raise Preempted

SIGINT (Ctrl-C) keeps Python's KeyboardInterrupt: the phase in progress stops where it is, `run` prints
one line naming the newest checkpoint and exits 130; a second Ctrl-C while it closes exits at once.
SIGTERM and SIGUSR1 (what SLURM, Kubernetes and spot instances send before the kill) only raise a
flag: the step in progress finishes, every rank learns that some rank was signalled (one all-reduce
per step), the finished step is checkpointed and the run exits 143. A step still running
`grace_s` after the signal is abandoned: the process exits 143 at once, the newest checkpoint intact.

A checkpoint write is never cut short by a signal (`deferred`): an interrupt raised inside `torch.save`
or DCP would surface as their own exceptions, and ranks leaving a write midway would leave the others
waiting in its collectives. SIGINT, SIGTERM and SIGUSR1 that arrive during the write are held until
it finishes on every rank, then delivered to the handler in place before it (Ctrl-C's
KeyboardInterrupt, the preemption flag, `Terminated`). A second Ctrl-C during the write exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rlcore.dist.reduce import world_max

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEFERRABLE = (signal.SIGINT, *PREEMPT_SIGNALS)
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_PREEMPTED = 143  # 128 + SIGTERM


class Preempted(Exception):
    """The run stopped for a preemption signal after checkpointing step `step` at `path`."""

    def __init__(self, step: int, path: Any) -> None:
        super().__init__(f"preempted: wrote checkpoint {path} (step {step}); continue with --resume auto")
        self.step, self.path = step, path


class Terminated(Exception):
    """A preemption signal under split placement, whose roles do not meet after each step: stop now."""


class Preemption:
    """The preemption flag of this process and the handlers that raise it (SIGTERM / SIGUSR1). With
    `at_once` a signal raises `Terminated` where the main thread is instead (split placement). `newest()`
    names the newest checkpoint for the line printed when the grace period runs out."""

    def __init__(self, *, grace_s: float, newest: Callable[[], Any], at_once: bool = False) -> None:
        self.grace_s, self.newest, self.at_once = grace_s, newest, at_once
        self.signalled: float | None = None
        """Monotonic time of the first preemption signal this process received (None: none yet)."""

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.at_once:
            raise Terminated(signal.Signals(signum).name)
        if self.signalled is not None:
            return
        self.signalled = time.monotonic()
        print(f"{signal.Signals(signum).name}: finishing the step in progress, then checkpointing", file=sys.stderr,
              flush=True)  # fmt: skip
        threading.Thread(target=_abandon_after, args=(self.grace_s, self.newest), daemon=True).start()

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """SIGTERM / SIGUSR1 go to this object within the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in PREEMPT_SIGNALS}
        for s in PREEMPT_SIGNALS:
            signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.signalled = None

    def requested(self, group: Any = None) -> bool:
        """Whether any rank (of `group`, default the world) received a preemption signal: a collective
        every rank calls at the same point of each step, so they all stop after the same step."""
        return world_max([0 if self.signalled is None else 1], group) == [1]


def _abandon_after(grace_s: float, newest: Callable[[], Any]) -> None:
    time.sleep(grace_s)
    print(
        f"preempted: the step in progress ran past --trainer.preempt-grace-s {grace_s:g}; abandoned it, the "
        f"newest checkpoint is {newest() or 'none'}; continue with --resume auto",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_PREEMPTED)


def exit_at_once_on_sigint() -> None:
    """A second Ctrl-C while the run closes (engines, reward workers) exits immediately."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(EXIT_INTERRUPTED))


@contextlib.contextmanager
def deferred(*, second_sigint: Callable[[], None]) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGUSR1 within the block, and deliver them (once each, in the order they
    came) to the handlers in place before it when the block ends normally; if it raises, its error
    stands and the held signals are dropped (the run is stopping anyway). A second SIGINT within the
    block calls `second_sigint` (which should exit). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in DEFERRABLE}
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signum in held:
            second_sigint()
        if signum not in held:
            held.append(signum)

    for s in DEFERRABLE:
        signal.signal(s, hold)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for signum in held:
        _deliver(signum, previous[signum])


def _deliver(signum: int, handler: Any) -> None:
    """What `handler` (as `signal.getsignal` gave it) does with `signum`, now."""
    if callable(handler):
        handler(signum, None)  # default_int_handler raises KeyboardInterrupt
    elif handler != signal.SIG_IGN:  # SIG_DFL, or installed outside Python: the default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
