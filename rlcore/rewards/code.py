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
  optional); each assert is one test, run after the setup in the program's namespace. It passes
  when it runs to the end: the harness then prints a random marker, so a program that exits early
  with status 0 (`sys.exit(0)`) does not pass.
For call-based and assert tests the program is loaded as a module named `solution`, so its
`if __name__ == "__main__":` block does not run (as in verl); stdin/stdout programs run as
`__main__`.

Every test runs in its own `run_python` sandbox (`timeout_s`, `memory_mb` per test). After the
first test that times out the remaining ones are not run and count as failed, so a solution that
hangs costs one timeout, not one per test. Deliberate departures from verl's prime_code: no
order-insensitive "set of tokens" comparison, no `from math import *`-style imports prepended to
the program, no 10-test cap (use `max_tests`), and the program runs in a real sandbox (the
standard library only) instead of in the scorer's process with some builtins disabled.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlcore.rewards.sandbox import SandboxResult, run_python

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


@dataclass(frozen=True, kw_only=True, slots=True)
class _Case:
    build: Callable[[str], str]  # program -> the main.py to run
    stdin: str
    judge: Callable[[str], bool]  # stdout of a run that exited 0 within limits -> passed


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
    cases = parse_tests(ground_truth, marker=f"rlcore-pass-{secrets.token_hex(8)}")
    cases = cases[:max_tests] if max_tests is not None else cases
    passed = timeouts = 0
    for case in cases:
        result = run_python(case.build(program), stdin=case.stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        if result.timed_out:
            timeouts += 1
            break
        passed += _passed(result, case)
    return CodeScore(passed=passed, total=len(cases), timeouts=timeouts)


def extract_program(solution_str: str) -> str:
    """The last ```python block (after removing <think>...</think>), else the last bare ``` block, else all."""
    text = _THINK.sub("", solution_str)
    blocks = _FENCE.findall(text)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    bare = [body for tag, body in blocks if not tag]
    return python[-1] if python else bare[-1] if bare else text


def parse_tests(ground_truth: Any, *, marker: str) -> list[_Case]:
    """Test cases of a ground truth (dict or JSON string); `marker` is the assert harness's pass line."""
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
            cases.append(
                _call_case(fn_name, given, expected, marker) if fn_name else _stdio_case(given, expected)
            )
    setup = tests.get("setup") or ""
    for line in tests.get("asserts", []):
        tail = f"exec(compile({setup + chr(10) + line!r}, 'tests.py', 'exec'), _ns)\nprint({marker!r})\n"
        cases.append(_Case(build=_as_module(tail), stdin="", judge=_ends_with(marker)))
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
    return _Case(build=lambda program: program, stdin=stdin, judge=lambda stdout: outputs_match(stdout, want))


def _call_case(fn_name: str, given: Any, expected: Any, marker: str) -> _Case:
    args = [json.loads(line) for line in given.split("\n")] if isinstance(given, str) else list(given)
    want = json.loads(expected) if isinstance(expected, str) else expected
    tail = (
        f"_fn = _ns['Solution']().{fn_name} if 'Solution' in _ns else _ns[{fn_name!r}]\n"
        f"print({marker!r} + json.dumps(_fn(*json.loads(sys.stdin.read()))))\n"
    )

    def judge(stdout: str) -> bool:
        line = stdout.rstrip("\n").rpartition("\n")[2]
        if not line.startswith(marker):
            return False
        got = json.loads(line[len(marker) :])
        return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])

    return _Case(build=_as_module(tail), stdin=json.dumps(args), judge=judge)


def _as_module(tail: str) -> Callable[[str], str]:
    """main.py that runs the program as module 'solution' (a __main__ block does not run), then `tail`."""
    head = "import json, sys\n_ns = {'__name__': 'solution'}\n"
    return lambda program: f"{head}exec(compile({program!r}, 'solution.py', 'exec'), _ns)\n{tail}"


def _ends_with(marker: str) -> Callable[[str], bool]:
    return lambda stdout: stdout.rstrip("\n").rpartition("\n")[2] == marker


def _passed(result: SandboxResult, case: _Case) -> bool:
    return result.ok and not result.truncated and case.judge(result.stdout)
