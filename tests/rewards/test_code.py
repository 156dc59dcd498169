"""The `code` reward: program extraction, output comparison, test formats, and scores in the sandbox.

Expected scores are counts written out: `2 / 3` means two of three tests pass.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.rewards import code
from rlcore.rewards.code import compute_score, extract_program, outputs_match, parse_tests, score_code
from rlcore.rewards.sandbox import sandbox_available, unavailable_reason

needs_sandbox = pytest.mark.skipif(
    not sandbox_available(), reason=f"sandbox unavailable: {unavailable_reason()}"
)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = {"inputs": ["1 2\n", "3 4\n", "10 -10\n"], "outputs": ["3\n", "7\n", "0\n"]}


def fenced(program: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{program}```\nIt reads two numbers."


# ---- extraction (no sandbox) ----


def test_extract_takes_the_last_python_block():
    text = f"{fenced('print(1)')}\nBetter:\n{fenced('print(2)', 'py')}\n{fenced('int main() {}', 'cpp')}"
    assert extract_program(text) == "print(2)"


def test_extract_ignores_think_and_falls_back():
    draft = "<think>maybe:\n```python\nprint('draft')\n```\n</think>"
    assert extract_program(f"{fenced('print(3)')}{draft}") == "print(3)"
    assert extract_program(f"{draft}print(8)") == "print(8)"
    assert extract_program("```\nprint(4)\n```") == "print(4)\n"  # a bare block
    assert extract_program("print(5)") == "print(5)"  # no block: the whole text
    assert extract_program("```python\nprint(6)\n") == "print(6)\n"  # cut off before the closing fence
    # a cpp block's closing fence must not open a bare block holding the prose after it
    assert extract_program("```cpp\nint x;\n```\nprint(7)") == "```cpp\nint x;\n```\nprint(7)"


# ---- comparison (no sandbox) ----


@pytest.mark.parametrize(
    ("got", "expected", "match"),
    [
        ("3\n", "3", True),
        ("1 2\n\n3  \n", "1\n2 3\n", True),  # whitespace and blank lines do not matter
        ("0.33333333", "0.3333333", True),  # |diff| = 3e-9 <= 1e-8 + 1e-5 * 0.33
        ("10", "10.0", True),  # one side is not an integer: compared as floats
        ("1.0001", "1.0", False),  # |diff| = 1e-4 > 1e-8 + 1e-5 * 1.0
        ("01", "1", False),  # two integers must be written the same
        ("123456789012345678", "123456789012345679", False),  # equal as floats, not as integers
        ("1 2", "1 2 3", False),
        ("yes", "YES", False),
        ("inf", "1e999", False),  # non-finite numbers only match as identical text
    ],
)
def test_outputs_match(got, expected, match):
    assert outputs_match(got, expected) is match


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.from_regex(r"[A-Za-z0-9.\-]{1,6}", fullmatch=True), min_size=1, max_size=8),
    gaps=st.lists(st.sampled_from([" ", "\n", "  ", "\t", "\n\n"]), min_size=8, max_size=8),
)
def test_outputs_match_ignores_layout(tokens, gaps):
    """Any re-spacing of the same tokens matches; dropping a token never does."""
    respaced = "".join(t + g for t, g in zip(tokens, gaps, strict=False))
    assert outputs_match(respaced, " ".join(tokens))
    assert not outputs_match(" ".join(tokens[:-1]), " ".join(tokens))


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("[1, 2]", "expected a dict"),
        ({"tests": []}, "expected a dict"),
        ({"inputs": ["1"]}, "outputs"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "as long as"),
        ({"inputs": ["1"], "outputs": ["1"], "fn_name": "f(); import os"}, "identifier"),
        ({"asserts": []}, "no test cases"),
    ],
)
def test_bad_ground_truth_is_a_clear_error(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(ground_truth, marker="m")


def test_cases_of_each_format():
    cases = parse_tests(
        {"inputs": [["1 2", "3"]], "outputs": [["3", "3"]], "asserts": ["assert True", "assert 1"]},
        marker="m",
    )
    assert len(cases) == 1 + 2
    assert cases[0].stdin == "1 2\n3" and cases[0].judge("3\n3\n")  # lists of lines are joined


# ---- scores in the sandbox ----


@needs_sandbox
def test_stdin_stdout_right_wrong_and_partial():
    assert compute_score("code", fenced(ADD), ADD_TESTS) == {
        "score": 1.0,
        "passed": 3.0,
        "total": 3.0,
        "timeouts": 0.0,
    }
    assert compute_score("code", fenced("print(3)\n"), ADD_TESTS)["score"] == 1 / 3  # right on the first only
    assert compute_score("code", fenced(ADD.replace("a + b", "abs(a + b)")), ADD_TESTS)["score"] == 1.0
    assert compute_score("code", fenced(ADD.replace("+", "-")), ADD_TESTS)["score"] == 0 / 3
    assert compute_score("code", "no code here", ADD_TESTS)["score"] == 0.0


@needs_sandbox
def test_ground_truth_as_json_string_and_line_lists():
    tests = json.dumps({"inputs": [["2", "5"]], "outputs": [["7"]]})
    program = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
    assert compute_score("code", program, tests)["score"] == 1.0


@needs_sandbox
def test_a_crash_fails_even_after_the_right_output():
    program = ADD + "raise SystemExit(1)\n"
    assert compute_score("code", fenced(program), ADD_TESTS)["passed"] == 0.0


@needs_sandbox
def test_asserts_right_partial_and_main_block_not_run():
    program = (
        "def add(a, b):\n    return a + b\n\n"
        "if __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"  # would die of EOFError
    )
    tests = {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]}
    assert compute_score("code", fenced(program), tests) == {
        "score": 2 / 3,
        "passed": 2.0,
        "total": 3.0,
        "timeouts": 0.0,
    }
    with_setup = {"setup": "import math", "asserts": ["assert add(math.pi, 0) == math.pi"]}
    assert compute_score("code", fenced(program), with_setup)["score"] == 1.0


@needs_sandbox
def test_asserts_cannot_be_skipped_by_exiting_early():
    tests = {"asserts": ["assert add(1, 2) == 3"]}
    for escape in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
        assert compute_score("code", "def add(a, b):\n    return 0\n" + escape, tests)["score"] == 0.0


@needs_sandbox
def test_call_based_function_and_solution_class():
    tests = {"fn_name": "two_sum", "inputs": ["[2, 7, 11]\n9", "[3, 3]\n6"], "outputs": ["[0, 1]", "[0, 1]"]}
    function = "def two_sum(nums, target):\n    return (0, 1)\n"  # a tuple: JSON turns it into a list
    assert compute_score("code", fenced(function), tests)["score"] == 1.0
    method = "class Solution:\n    def two_sum(self, nums, target):\n        return [0, 1] if target == 9 else []\n"
    assert compute_score("code", fenced(method), tests)["score"] == 1 / 2
    apps = {"fn_name": "double", "inputs": [[3], [4]], "outputs": [[6], [9]]}  # APPS: arguments and [result]
    assert compute_score("code", "def double(x):\n    return 2 * x\n", apps)["score"] == 1 / 2


@needs_sandbox
def test_a_hanging_solution_costs_one_timeout():
    start = time.monotonic()
    result = score_code("while True:\n    pass\n", ADD_TESTS, timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 1.0  # stopped after the first timeout, not one per test
    assert (result.passed, result.total, result.timeouts, result.score) == (0, 3, 1, 0.0)


@needs_sandbox
def test_max_tests_and_a_slow_test_after_passing_ones():
    program = "n = int(input())\nwhile n == 3:\n    pass\nprint(n)\n"  # hangs on the third test only
    tests = {"inputs": ["1", "2", "3", "4"], "outputs": ["1", "2", "3", "4"]}
    assert score_code(program, tests, timeout_s=1.0) == code.CodeScore(passed=2, total=4, timeouts=1)
    assert score_code(program, tests, max_tests=2) == code.CodeScore(passed=2, total=2, timeouts=0)
