"""The `code` reward: program extraction, output comparison, test formats, and scores in the sandbox.

Expected scores are counts written out: `2 / 3` means two of three tests pass.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.rewards import code
from rlcore.rewards.code import compute_score, extract_program, outputs_match, parse_tests, score_code
from rlcore.rewards.sandbox import sandbox_available, unavailable_reason
from rlcore.rewards.sandbox_pipe import PipeLimits, open_pipes
from tests.rewards.test_sandbox import pids_with, tagged

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
        parse_tests(ground_truth)


def test_cases_of_each_format():
    cases = parse_tests(
        {"inputs": [["1 2", "3"]], "outputs": [["3", "3"]], "asserts": ["assert True", "assert 1"]}
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


# ---- forged passes (the verdict is computed where the program cannot reach) ----

ADD_ASSERTS = {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
FORGE_TAIL = "import os, re, sys\nprint('\\n'.join(found))\nsys.stdout.flush()\nos._exit(0)\n"
FROM_HARNESS_FILE = (
    "def add(a, b):\n    return 0\n\n"
    "found = re.findall(r'rlcore-pass-[0-9a-f]+', open('/sandbox/main.py').read())\n"
)
FROM_ARGV0 = (
    "def add(a, b):\n    return 0\n\nfound = re.findall(r'rlcore-pass-[0-9a-f]+', open(sys.argv[0]).read())\n"
)
FROM_FRAMES = (  # every str constant of every frame's code, the pass-looking ones last
    "def add(a, b):\n    return 0\n\nfound, frame = [], sys._getframe()\n"
    "while frame is not None:\n"
    "    found += [c for c in frame.f_code.co_consts if isinstance(c, str) and '\\n' not in c]\n"
    "    frame = frame.f_back\n"
    "found.sort(key=lambda c: 'pass' in c)\n"
)


@needs_sandbox
@pytest.mark.parametrize(
    "steal", [FROM_HARNESS_FILE, FROM_ARGV0, FROM_FRAMES], ids=["main.py", "argv0", "frames"]
)
def test_a_pass_marker_stolen_from_the_harness_does_not_pass(steal):
    program = "import os, re, sys\n" + steal + FORGE_TAIL
    assert compute_score("code", fenced(program), ADD_ASSERTS)["score"] == 0.0
    with_setup = {"setup": "import math", **ADD_ASSERTS}
    assert compute_score("code", fenced(program), with_setup)["score"] == 0.0


ALWAYS_EQUAL = (
    "class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n\ndef f(x):\n    return E()\n"
)


@needs_sandbox
def test_an_always_equal_object_does_not_pass():
    asserts = {
        "asserts": ["assert f(1) == 2", "assert f(2) == [4]", "assert [f(3)] == [6]", "assert f(4) in [8]"]
    }
    assert compute_score("code", fenced(ALWAYS_EQUAL), asserts)["score"] == 0.0
    calls = {"fn_name": "f", "inputs": ["1", "2"], "outputs": ["2", "[4]"]}
    assert compute_score("code", fenced(ALWAYS_EQUAL), calls)["score"] == 0.0
    method = "class Solution:\n    def f(self, x):\n        return E()\n"
    assert compute_score("code", fenced(ALWAYS_EQUAL + method), calls)["score"] == 0.0
    subclass = (
        "class L(list):\n    __eq__ = lambda s, o: True\n\ndef f(x):\n    return L()\n"  # a list subclass
    )
    assert compute_score("code", fenced(subclass), asserts)["score"] == 0.0
    assert compute_score("code", fenced(subclass), calls)["score"] == 0.0


@needs_sandbox
def test_printing_to_the_channel_does_not_pass():
    """Lines that look like any protocol's messages, on fd 1 and every other fd, change no verdict."""
    noise = (
        "import os\nfor fd in range(1, 20):\n    for line in ('[\"pass\"]', '[\"ok\", [\"b\", true]]', 'garbage'):\n"
        "        try:\n            os.write(fd, (line + '\\n').encode())\n        except OSError:\n            pass\n"
    )
    wrong = "def add(a, b):\n    " + noise.replace("\n", "\n    ") + "\n    return 0\n"
    assert compute_score("code", fenced(wrong), ADD_ASSERTS)["score"] == 0.0
    assert compute_score("code", fenced(noise + wrong), ADD_ASSERTS)["score"] == 0.0


# ---- honest programs keep their scores ----

LOUD = "print('x' * 1000 + '\\n', end='')\nprint('[\"pass\"]')\nprint('garbage \\x00 \\xff')\n"


@needs_sandbox
def test_honest_programs_pass_every_format():
    program = "import math\n\ndef add(a, b):\n    print('adding', a, b)\n    return a + b\n"
    tests = {
        "setup": "import math\nfrom fractions import Fraction\n",
        "asserts": [
            "assert add(1, 2) == 3",
            "assert add(a=1.5, b=0.25) == 1.75 and math.isclose(add(math.pi, 0), math.pi)",
            "assert add([1], [2]) == [1, 2] and add((1,), (2,)) == (1, 2) and add('a', 'b') == 'a' + 'b'",
            "assert add(float('inf'), 1) == float('inf') and math.isnan(add(float('nan'), 0))",
            "assert add(10 ** 30, 1) == 10 ** 30 + 1 and add(b'x', b'y') == b'xy' and add(1j, 1) == 1 + 1j",
            "assert add(float(Fraction(1, 2)), 0) == 0.5",
        ],
    }
    assert compute_score("code", fenced(LOUD * 50 + program), tests)["score"] == 1.0
    solution = (
        "class Solution:\n    def twoSum(self, nums, target):\n"
        "        seen = {}\n        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n                return [seen[target - n], i]\n"
        "            seen[n] = i\n"
        "\nclass Node:\n    def __init__(self, val, nxt=None):\n        self.val, self.next = val, nxt\n"
        "\ndef values(node):\n    while node:\n        yield node.val\n        node = node.next\n"
        "\ndef freq(xs):\n    import collections\n    return collections.Counter(xs)\n"
    )
    classy = {
        "asserts": [
            "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]",
            "s = Solution()\nassert s.twoSum(nums=[3, 2, 4], target=6) == [1, 2]",
            "head = Node(1, Node(2))\nassert head.val == 1 and head.next.next is None and list(values(head)) == [1, 2]",
            "assert 2 in values(Node(1, Node(2))) and 3 not in values(Node(1))",
            "assert freq('abca') == {'a': 2, 'b': 1, 'c': 1}",
            "assert {frozenset({1}), (1, 2)} == {(1, 2), frozenset([1])} and {1: {2}} == {1: {2}}",
        ]
    }
    assert compute_score("code", fenced(solution), classy)["score"] == 1.0
    calls = {
        "fn_name": "twoSum",
        "inputs": ["[2, 7, 11, 15]\n9", "[3, 3]\n6"],
        "outputs": ["[0, 1]", "[0, 1]"],
    }
    assert compute_score("code", fenced(LOUD + solution), calls)["score"] == 1.0
    assert compute_score("code", fenced(ADD), ADD_TESTS)["score"] == 1.0


@needs_sandbox
def test_a_program_exception_fails_only_that_test():
    program = "def inv(x):\n    return 1 / x\n"
    tests = {
        "asserts": [
            "assert inv(1) == 1",
            "assert inv(0) == 0",  # ZeroDivisionError in the program: this test fails
            "try:\n    inv(0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError\n",
            "assert inv(2) == 0.5",
        ]
    }
    assert score_code(program, tests) == code.CodeScore(passed=3, total=4, timeouts=0)
    calls = {"fn_name": "inv", "inputs": [[1], [0], [4]], "outputs": [1, 0, 0.25]}
    assert score_code(program, calls) == code.CodeScore(passed=2, total=3, timeouts=0)
    callback = {
        "asserts": ["assert inv(1) == 1", "assert apply(lambda x: x, 1) == 1"]
    }  # a test-side function
    assert score_code(program + "def apply(f, x):\n    return f(x)\n", callback).passed == 1


@needs_sandbox
def test_a_hanging_assert_program_costs_one_timeout():
    program = "def f(x):\n    while x == 2:\n        pass\n    return x\n"
    tests = {"asserts": ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"]}
    start = time.monotonic()
    assert score_code(program, tests, timeout_s=2.0) == code.CodeScore(passed=1, total=3, timeouts=1)
    assert time.monotonic() - start < 2 * 2.0 + 2.0  # the third test never ran
    calls = {"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [1, 2, 3]}
    assert score_code(program, calls, timeout_s=2.0) == code.CodeScore(passed=1, total=3, timeouts=1)
    loading = {"asserts": ["assert f(1) == 1", "assert f(3) == 3"]}  # hangs while loading the module
    assert score_code("while True:\n    pass\n", loading, timeout_s=1.0) == code.CodeScore(
        passed=0, total=2, timeouts=1
    )


# ---- the wire between the sandboxes (no sandbox) ----


def test_wire_round_trips_plain_data():
    from rlcore.rewards import code_wire

    values = [
        None, True, 0, -(10**5000), 2.5, float("inf"), -float("inf"), 1 + 2j, "é\ud800", b"\x00\xff",
        [1, (2, 3), {4: {5}}], (), frozenset({(1, "a")}), {"k": [None, {frozenset()}]},
    ]  # fmt: skip
    for value in values:
        wire = json.loads(json.dumps(code_wire.encode(value, ref=None)))
        back = code_wire.decode(wire, ref=None)
        assert back == value and type(back) is type(value)
    nan = code_wire.decode(json.loads(json.dumps(code_wire.encode(float("nan"), ref=None))), ref=None)
    assert type(nan) is float and nan != nan
    nested = code_wire.decode(code_wire.encode({"a": [(1, 2.0)]}, ref=None), ref=None)
    assert type(nested["a"]) is list and type(nested["a"][0]) is tuple and type(nested["a"][0][1]) is float


def test_wire_sends_objects_as_references_and_plain_subclasses_as_plain():
    from rlcore.rewards import code_wire

    class Thing:
        pass

    thing, seen = Thing(), []
    assert code_wire.encode([thing, 1], ref=lambda obj: seen.append(obj) or 7) == [
        "l",
        [["r", 7], ["i", "1"]],
    ]
    assert seen == [thing]
    always = type("Always", (int,), {"__eq__": lambda s, o: True, "__hash__": int.__hash__})(3)
    assert code_wire.encode(always, ref=None) == ["i", "3"]  # a subclass is sent as its plain value
    with pytest.raises(code_wire.WireError):
        code_wire.encode(thing, ref=None)  # no references allowed here


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('true')",
        '["e", "__import__(\'os\')"]',  # unknown tag
        '["p", "gASVAAAAAAAAAE4u"]',  # a pickle would be a tag like any other: unknown
        '["i", 3]',  # an int must be written in hex text
        '["f", "1' + "0" * 200 + '"]',  # an overlong float
        '["s"]',
        '["l", [["n"], 5]]',
        '["S", [["l", []]]]',  # an unhashable set element
        '["d", [[["i", "1"]]]]',
        '["r", 1]',  # a reference where none may be
        "[" * 100_000 + "]" * 100_000,  # nested past json's own recursion
        '["l", ' * 300 + '["n"]' + "]" * 300,  # nested past the wire's depth
        '["l", [' + ", ".join(['["n"]'] * 300_000) + "]]",  # more items than allowed
    ],
)
def test_wire_refuses_hostile_messages(hostile):
    from rlcore.rewards import code_wire

    with pytest.raises(code_wire.WireError):
        code_wire.decode(code_wire.loads(hostile.encode()), ref=None)


# ---- the interactive sandbox under the relay ----

ECHO = (
    "import sys\nfor line in sys.stdin:\n    print(line.strip()[::-1] * int(line.split()[0]), flush=True)\n"
)


@needs_sandbox
def test_pipes_bound_each_line_and_the_wall_clock_and_leave_nothing():
    token = f"rlcore-test-{secrets.token_hex(6)}"
    limits = PipeLimits(timeout_s=3.0, max_line_bytes=1000)
    start = time.monotonic()
    with open_pipes([tagged(ECHO, token)] * 2, limits) as (echo, overlong):
        echo.send(b"2 ab")
        assert echo.next_line(start + 3.0) == b"ba 2ba 2"
        assert pids_with(token)  # both sandboxes run
        overlong.send(b"500 xy")  # a 1500-byte line: killed for output
        assert overlong.next_line(start + 3.0) is None and overlong.limit == "output"
        echo.send(b"0 nothing")  # answers an empty line, then waits: killed at the deadline
        assert echo.next_line(start + 3.0) == b""
        assert echo.next_line(start + 3.0) is None and echo.limit == "wall_time"
    assert echo.timed_out and not overlong.timed_out
    assert time.monotonic() - start < 3.0 + 2.0
    assert pids_with(token) == []
