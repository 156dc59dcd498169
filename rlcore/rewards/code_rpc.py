"""Assert and call-based code tests, judged where the program cannot reach: the program serves its
names from one sandbox; the test runs in a second one (asserts) or here (calls).

    verdict = run_assert(program, "assert add(1, 2) == 3", PipeLimits(timeout_s=5))
    verdict.passed, verdict.timed_out                        # True, False
    got, timed_out = run_call(program, "add", [1, 2], PipeLimits(timeout_s=5))   # 3, False

The program's sandbox runs `code_wire.serve`: the program is loaded as module `solution` and its
names are answered over a private channel (code_wire.py). For an assert, a second sandbox (its own
bwrap, pid and net namespace, tmpfs) runs `code_wire.run_test`: the setup and assert see the
program's names as proxies, and the sandbox writes PASS once the code ran to the end. This process
relays request and answer lines between the two and reads the verdict from the test sandbox only.
For a call, this process is the client: it calls the function (or `Solution().fn_name`) and decodes
the answer into plain data, which the caller compares. One fresh sandbox (pair) per test; the
wall clock (`timeout_s`) covers the pair, and both are killed at the end.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.rewards import code_wire
from rlcore.rewards.sandbox_pipe import Pipe, PipeLimits, open_pipes, pump

_PASS = code_wire.dumps(code_wire.PASS).rstrip(b"\n")
NO_RESULT: Any = object()
"""`run_call`'s result when the call raised, timed out or answered something undecodable."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    passed: bool
    timed_out: bool
    """The wall clock or a CPU-time limit ended the test (never together with passed)."""


@dataclass(frozen=True, slots=True)
class _Ref:
    """A reference to an object that stays in the program's sandbox (never plain data)."""

    number: int


class _Failed(Exception):
    pass


def run_assert(program: str, test: str, limits: PipeLimits) -> Verdict:
    """Run the test (setup + assert) against the program's names, each in its own sandbox."""
    start = time.monotonic()
    with open_pipes((_main(program, "serve"), _main(test, "run_test")), limits) as (served, tester):
        passed = _relay(served, tester, start + limits.timeout_s)
    return Verdict(passed=passed, timed_out=not passed and (served.timed_out or tester.timed_out))


def run_call(program: str, fn_name: str, args: list, limits: PipeLimits) -> tuple[Any, bool]:
    """The plain-data result of `fn_name(*args)` (`Solution().fn_name` when the program defines a
    class Solution), or NO_RESULT; and whether the test timed out."""
    start = time.monotonic()
    with open_pipes((_main(program, "serve"),), limits) as (served,):
        try:
            got = _call(_Client(served, start + limits.timeout_s), fn_name, args)
        except (_Failed, code_wire.WireError):
            got = NO_RESULT
    return got, got is NO_RESULT and served.timed_out


@functools.cache
def _wire_source() -> str:
    return Path(code_wire.__file__).read_text(encoding="utf-8")


def _main(text: str, entry: str) -> str:
    """A sandbox's main.py: the wire module's source, then `entry(text)`."""
    return f"{_wire_source()}\n{entry}({text!r})\n"


def _relay(served: Pipe, tester: Pipe, deadline: float) -> bool:
    """Forward lines both ways until the test sandbox says PASS (True), ends, or the deadline passes.
    The program may only answer what was asked (its hello, then one line per request): a line more
    fails the test, so nothing it writes piles up here."""
    asked = 1  # the hello
    while True:
        while tester.lines:
            line = tester.lines.popleft()
            if line == _PASS:
                return True
            served.send(line)
            asked += 1
        while served.lines and asked:
            tester.send(served.lines.popleft())
            asked -= 1
        if served.lines:
            return False
        if served.closed:
            tester.end_input()  # the test reads the end of its channel and fails
        if tester.closed or not pump((served, tester), deadline):
            return False


class _Client:
    """This process as the test side of a program's channel (plain data only: refs stay _Ref)."""

    def __init__(self, served: Pipe, deadline: float) -> None:
        self.served, self.deadline = served, deadline

    def read(self) -> Any:
        line = self.served.next_line(self.deadline)
        if line is None:
            raise _Failed("the program's sandbox ended or timed out")
        return code_wire.loads(line)

    def ask(self, op: str, target: Any, payload: tuple) -> Any:
        if type(target) is not _Ref:
            raise _Failed(f"not an object of the program: {type(target).__name__}")
        self.served.send(code_wire.dumps([op, target.number, code_wire.encode(payload, None)]).rstrip(b"\n"))
        answer = self.read()
        if type(answer) is list and len(answer) == 2 and answer[0] == "ok":
            return code_wire.decode(answer[1], _Ref)
        raise _Failed("the call raised")


def _call(client: _Client, fn_name: str, args: list) -> Any:
    hello = client.read()
    if type(hello) is not list or len(hello) != 2 or hello[0] != "hello" or type(hello[1]) is not list:
        raise _Failed("the program did not load")
    entries = [
        e for e in hello[1] if type(e) is list and len(e) == 2 and type(e[0]) is str and type(e[1]) is int
    ]
    names = {name: _Ref(number) for name, number in entries}
    if "Solution" in names:
        target = client.ask("getattr", client.ask("call", names["Solution"], ((), {})), (fn_name,))
    elif fn_name in names:
        target = names[fn_name]
    else:
        raise _Failed(f"the program defines no {fn_name!r}")
    return client.ask("call", target, (tuple(args), {}))
