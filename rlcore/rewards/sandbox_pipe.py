"""Interactive sandboxed programs: lines in on stdin, lines out on stdout, relayed by the caller.

    from rlcore.rewards.sandbox_pipe import PipeLimits, open_pipes, pump
    with open_pipes([echo_source], PipeLimits(timeout_s=5)) as (echo,):
        deadline = time.monotonic() + 5
        echo.send(b"hi")
        line = echo.next_line(deadline)     # b"hi", or None: closed, killed, or past the deadline

Each program runs in a sandbox of its own, built and limited exactly as `run_python`'s (sandbox.py:
the same bwrap arguments, rlimits and launcher; `timeout_s` is also the CPU-time limit), with its
stdin and stdout kept open as a channel. The caller owns the wall clock: `pump` moves bytes for
any number of pipes until a deadline and then kills them all ('wall_time'). A pipe kills its own
sandbox ('output') when one stdout line passes `max_line_bytes` or stderr passes
`max_output_bytes`; writes never block (a sandbox that reads nothing cannot stall the caller).
Leaving `open_pipes` kills every sandbox through its pid namespace, as `run_python` does at its end.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import selectors
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rlcore.rewards import sandbox
from rlcore.rewards.sandbox import MAX_OPEN_FILES, Limit, SandboxUnavailable

_SETUP_WAIT_S = 2.0  # at the end, how long to wait for a sandbox still being set up to report its pid 1


@dataclass(frozen=True, kw_only=True, slots=True)
class PipeLimits:
    """Limits of each sandbox (as `run_python`'s) and of one message."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 32
    disk_mb: int = 32
    max_output_bytes: int = 1 << 20
    """stderr kept per sandbox; passing it kills the sandbox."""
    max_line_bytes: int = 1 << 20
    """The longest stdout line (one message); a longer one kills the sandbox."""


class Pipe:
    """One running sandbox: `send` lines to its stdin; complete stdout lines gather in `lines`."""

    def __init__(self, proc: subprocess.Popen, info_fd: int, limits: PipeLimits) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self._stdin_file = proc.stdin
        self.proc, self.info_fd, self.limits = proc, info_fd, limits
        self.killer = sandbox._Killer(proc)
        self.lines: collections.deque[bytes] = collections.deque()
        self.stderr, self.limit, self.exit_code = bytearray(), None, None
        self.closed = False  # stdout reached its end
        self._partial, self._pending, self._end_input = bytearray(), bytearray(), False
        self._stdin, self._stdout = proc.stdin.fileno(), proc.stdout.fileno()
        self._open = {self._stdout, proc.stderr.fileno(), info_fd}  # fds not yet at their end
        for fd in (*self._open, self._stdin):
            os.set_blocking(fd, False)

    @property
    def timed_out(self) -> bool:
        return self.limit in ("wall_time", "cpu_time")

    def send(self, line: bytes) -> None:
        """Queue one line (without its newline) for the program's stdin."""
        if b"\n" in line:
            raise ValueError("a line must not contain a newline")
        if not self._end_input:
            self._pending += line + b"\n"

    def end_input(self) -> None:
        """Close the program's stdin once what was sent has been written."""
        self._end_input = True

    def next_line(self, deadline: float, *others: Pipe) -> bytes | None:
        """The next stdout line, pumping this pipe and `others`; None when closed or past the deadline."""
        while not self.lines:
            if self.closed or not pump((self, *others), deadline):
                return None
        return self.lines.popleft()

    def kill(self, limit: Limit) -> None:
        if self.limit is None:
            self.limit = limit
        self.killer.kill()

    def register(self, selector: selectors.BaseSelector) -> None:
        for fd in self._open:
            selector.register(fd, selectors.EVENT_READ, self)
        if self._stdin >= 0 and (self._pending or self._end_input):
            selector.register(self._stdin, selectors.EVENT_WRITE, self)

    def on_ready(self, fd: int) -> None:
        if fd == self._stdin:
            self._write()
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            self._open.discard(fd)
            self.closed = self.closed or fd == self._stdout
        elif fd == self.info_fd:
            self.killer.learn(chunk)
        elif fd == self._stdout:
            self._take(chunk)
        else:
            self.stderr += chunk[: self.limits.max_output_bytes + 1 - len(self.stderr)]
            if len(self.stderr) > self.limits.max_output_bytes:
                self.kill("output")

    def _take(self, chunk: bytes) -> None:
        self._partial += chunk
        *complete, rest = self._partial.split(b"\n")
        self._partial = bytearray(rest)
        cap = self.limits.max_line_bytes
        if len(rest) > cap or any(len(line) > cap for line in complete):
            self.kill("output")
            return
        self.lines.extend(bytes(line) for line in complete)

    def _write(self) -> None:
        try:
            written = os.write(self._stdin, self._pending[: 1 << 16])
        except BlockingIOError:
            return
        except OSError:  # the program is gone (EPIPE): nothing more goes in
            written = len(self._pending)
            self._end_input = True
        del self._pending[:written]
        if not self._pending and self._end_input:
            self._stdin_file.close()
            self._stdin = -1

    def _await_pid1(self, deadline: float) -> None:
        """Read bwrap's report of the sandbox's pid 1, waiting for a sandbox still being set up, so
        that the kill goes through the pid namespace rather than `kill_tree`."""
        while self.killer.pidfd is None and self.info_fd in self._open and _ready(self.info_fd, deadline):
            chunk = os.read(self.info_fd, 1 << 16)
            if not chunk:
                return
            self.killer.learn(chunk)

    def close(self) -> None:
        """Kill the sandbox (its whole pid namespace), wait for bwrap, release everything."""
        if self.exit_code is not None:
            return
        self._await_pid1(time.monotonic() + _SETUP_WAIT_S)
        self.killer.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=sandbox._KILL_GRACE_S)
        self.killer.reap()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        stderr = bytes(self.stderr).decode("utf-8", errors="replace")
        self.exit_code, self.limit = sandbox._classify(self.proc.returncode, stderr, self.limit)


def _ready(fd: int, deadline: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        return bool(selector.select(timeout=max(deadline - time.monotonic(), 0.0)))


def pump(pipes: Sequence[Pipe], deadline: float) -> bool:
    """Wait for any of `pipes` to be readable or writable and move bytes once. At the deadline kill
    them all ('wall_time') and return False."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        for pipe in pipes:
            pipe.kill("wall_time")
        return False
    with selectors.DefaultSelector() as selector:
        for pipe in pipes:
            pipe.register(selector)
        if not selector.get_map():
            return True
        for key, _ in selector.select(timeout=remaining):
            key.data.on_ready(key.fd)
    return True


@contextlib.contextmanager
def open_pipes(programs: Sequence[str], limits: PipeLimits) -> Iterator[tuple[Pipe, ...]]:
    """Start one sandbox per program (all at once); kill them all on leaving. Raises
    `SandboxUnavailable` when isolation is not available here."""
    sandbox._check_limits(
        limits.timeout_s, limits.memory_mb, limits.max_processes, limits.disk_mb, limits.max_output_bytes
    )
    reason = sandbox._unavailable_reason()
    if reason is not None:
        raise SandboxUnavailable(reason)
    rlimits = (math.ceil(limits.timeout_s), limits.memory_mb << 20, limits.disk_mb << 20)
    rlimits += (limits.max_processes, MAX_OPEN_FILES)
    with contextlib.ExitStack() as stack:
        pipes = []
        for program in programs:
            proc, info_fd = sandbox._spawn(
                stack, program, subprocess.PIPE, limits=rlimits, disk_mb=limits.disk_mb
            )
            pipes.append(Pipe(proc, info_fd, limits))
            stack.callback(pipes[-1].close)
        yield tuple(pipes)
