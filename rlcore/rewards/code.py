"""Code reward: run the response's Python program against test cases in the sandbox; score = fraction passed.

    from rlcore.rewards import code
    code.compute_score("code", response, {"inputs": ["1 2\\n"], "outputs": ["3\\n"]})
    # {"score": 1.0, "passed": 1.0, "total": 1.0, "timeouts": 0.0}

The program is the last ```python (or ```py) fenced block of the response after `<think>...</think>`
is removed, else the last bare ``` block, else the whole text (verl's prime_code takes the last
```python block the same way). `ground_truth` is a dict or its JSON string holding one or both of:

- stdin/stdout cases, as verl's prime_code data (APPS, TACO, CodeContests):
  `{"inputs": [...], "outputs": [...]}`. Each input is the program's stdin (a list of lines is
  joined with newlines); the program passes when it exits with status 0 and its stdout matches
  the expected output token by token (whitespace and blank lines ignored; two integers must be
  equal as written; other numbers match within numpy.allclose's default tolerance, as verl's).
- call-based cases: the same plus `"fn_name"`. `inputs[i]` holds the arguments (a JSON list, or a
  string with one JSON value per line as verl's prime data stores them), `outputs[i]` the return
  value (JSON, or a JSON string). With a `class Solution` the method `Solution().fn_name` is
  called. A return value passes when it equals the expected one after a JSON round trip (tuples
  become lists), or equals its only element when the expected value is a one-element list (APPS).
- assert-style tests: `{"asserts": ["assert f(1) == 2", ...], "setup": "import math"}` (setup
  optional); each assert is one test, run after the setup; it passes when it runs to the end.
For call-based and assert tests the program is loaded as a module named `solution`, so its
`if __name__ == "__main__":` block does not run (as in verl); stdin/stdout programs run as
`__main__`.

How the verdict is computed, out of the program's reach (code_rpc.py, code_wire.py): a stdin/stdout
program runs in a `run_python` sandbox and its stdout is compared here. For the other formats the
program runs in a sandbox as a server of its names: a harness loads it and answers calls,
attribute and item lookups over a private channel (the program's own prints go to stderr). A call
test is made from here: the result comes back in a tagged encoding that decodes to exact builtin
types only (never pickle or eval, bounded in size and depth) and is compared here; an object that
is not plain data comes back as a reference, which never equals an expected value. An assert test
runs in a second sandbox of its own (own pid and net namespace, own tmpfs) where the program's
names are proxies: results are plain data decoded as above, or references compared by identity; a
program exception is raised there as an exception naming its type (a builtin type is also a base,
so `except ValueError` in a test catches it). That sandbox alone says whether the assert ran to the
end; this process only relays lines between the two. Reading its files, argv, frames or
environment gives the program nothing that passes, and printing or writing to the channel only
claims return values.

What is still forgeable: a program sees each call's arguments and can special-case them (a lookup
table of the tests' inputs passes). A test that takes a helper from the program (its own `check`,
or `isclose` the program imported) trusts the program; names of builtins and of stdlib modules
(`math.isclose`) are never taken from it. Not supported, so such tests fail: passing a callback or
any other non-plain object of the test's (a lambda) to the program, setting attributes on the
program's objects, arithmetic on them. An instance of a subclass of a plain type (Counter,
namedtuple, IntEnum) comes back as its base type's plain value, losing its own attributes.

Every test gets fresh sandboxes (`timeout_s`, `memory_mb` per test; the wall clock covers both of
an assert's pair, and both are killed at its end), so no program state leaks between tests. After
the first test that times out the remaining ones are not run and count as failed, so a solution
that hangs costs one timeout, not one per test. Deliberate departures from verl's prime_code: no
order-insensitive "set of tokens" comparison, no `from math import *`-style imports prepended to
the program, no 10-test cap (use `max_tests`), and the program runs in a real sandbox (the
standard library only) instead of in the scorer's process with some builtins disabled.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from rlcore.rewards.code_rpc import NO_RESULT, Verdict, run_assert, run_call
from rlcore.rewards.sandbox import run_python
from rlcore.rewards.sandbox_pipe import PipeLimits

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "python3", "py")
_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True, kw_only=True, slots=True)
class CodeScore:
    """How a program did on its test cases."""

    passed: int
    total: int
    timeouts: int
    """Tests that ran past `timeout_s` (at most 1: the rest are skipped after a timeout)."""

    @property
    def score(self) -> float:
        return self.passed / self.total


@dataclass(frozen=True, slots=True)
class _StdioCase:
    stdin: str
    want: str

    def judge(self, stdout: str) -> bool:
        return outputs_match(stdout, self.want)

    def run(self, program: str, limits: PipeLimits) -> Verdict:
        result = run_python(program, stdin=self.stdin, timeout_s=limits.timeout_s, memory_mb=limits.memory_mb)
        passed = result.ok and not result.truncated and self.judge(result.stdout)
        return Verdict(passed=passed, timed_out=result.timed_out)


@dataclass(frozen=True, slots=True)
class _CallCase:
    fn_name: str
    args: list
    want: Any

    def run(self, program: str, limits: PipeLimits) -> Verdict:
        got, timed_out = run_call(program, self.fn_name, self.args, limits)
        return Verdict(passed=got is not NO_RESULT and _same(got, self.want), timed_out=timed_out)


@dataclass(frozen=True, slots=True)
class _AssertCase:
    test: str  # setup, then one assert

    def run(self, program: str, limits: PipeLimits) -> Verdict:
        return run_assert(program, self.test, limits)


_Case = _StdioCase | _CallCase | _AssertCase


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, float]:
    """verl-signature code reward: the fraction of tests passed, plus the counts (logged as extras)."""
    result = score_code(solution_str, ground_truth)
    return {
        "score": result.score,
        "passed": float(result.passed),
        "total": float(result.total),
        "timeouts": float(result.timeouts),
    }


def score_code(
    solution_str: str,
    ground_truth: Any,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_tests: int | None = None,
) -> CodeScore:
    """Run the program of `solution_str` on each test of `ground_truth` (formats: module docstring)."""
    program = extract_program(solution_str)
    cases = parse_tests(ground_truth)
    cases = cases[:max_tests] if max_tests is not None else cases
    limits = PipeLimits(timeout_s=timeout_s, memory_mb=memory_mb)
    passed = timeouts = 0
    for case in cases:
        verdict = case.run(program, limits)
        if verdict.timed_out:
            timeouts += 1
            break
        passed += verdict.passed
    return CodeScore(passed=passed, total=len(cases), timeouts=timeouts)


def extract_program(solution_str: str) -> str:
    """The last ```python block (after removing <think>...</think>), else the last bare ``` block, else all."""
    text = _THINK.sub("", solution_str)
    blocks = _FENCE.findall(text)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    bare = [body for tag, body in blocks if not tag]
    return python[-1] if python else bare[-1] if bare else text


def parse_tests(ground_truth: Any) -> list[_Case]:
    """Test cases of a ground truth (dict or JSON string)."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict) or not ({"inputs", "asserts"} & tests.keys()):
        raise ValueError(
            f"code ground_truth {str(ground_truth)[:120]!r}: expected a dict (or JSON) with "
            '"inputs" and "outputs" (optionally "fn_name"), and/or "asserts"'
        )
    cases: list[_Case] = []
    if "inputs" in tests:
        inputs, outputs = tests["inputs"], tests.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise ValueError(
                f'code ground_truth: "outputs" must be a list as long as "inputs" ({len(inputs)})'
            )
        fn_name = tests.get("fn_name")
        if fn_name is not None and not (isinstance(fn_name, str) and fn_name.isidentifier()):
            raise ValueError(f'code ground_truth: "fn_name" must be a Python identifier, got {fn_name!r}')
        for given, expected in zip(inputs, outputs, strict=True):
            cases.append(_call_case(fn_name, given, expected) if fn_name else _stdio_case(given, expected))
    setup = tests.get("setup") or ""
    cases += [_AssertCase(f"{setup}\n{line}") for line in tests.get("asserts", [])]
    if not cases:
        raise ValueError("code ground_truth has no test cases")
    return cases


def outputs_match(got: str, expected: str) -> bool:
    """Token-wise comparison: equal tokens, or two non-integer numbers within allclose's tolerance."""
    got_tokens, expected_tokens = got.split(), expected.split()
    return len(got_tokens) == len(expected_tokens) and all(map(_tokens_match, got_tokens, expected_tokens))


def _tokens_match(got: str, expected: str) -> bool:
    if got == expected:
        return True
    if _INT.fullmatch(got) and _INT.fullmatch(expected):
        return False  # integers must be written the same
    try:
        a, b = float(got), float(expected)
    except ValueError:
        return False
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-8 + 1e-5 * abs(b)  # numpy.allclose


def _stdio_case(given: Any, expected: Any) -> _Case:
    stdin = "\n".join(given) if isinstance(given, list) else str(given)
    want = "\n".join(map(str, expected)) if isinstance(expected, list) else str(expected)
    return _StdioCase(stdin, want)


def _call_case(fn_name: str, given: Any, expected: Any) -> _Case:
    args = [json.loads(line) for line in given.split("\n")] if isinstance(given, str) else list(given)
    want = json.loads(expected) if isinstance(expected, str) else expected
    return _CallCase(fn_name, args, want)


def _same(got: Any, want: Any) -> bool:
    """A call's plain-data result against the expected one, after a JSON round trip (as verl's)."""
    try:
        got = json.loads(json.dumps(got))
    except (TypeError, ValueError):  # not JSON data (a set, bytes, a reference to an object)
        return False
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])
