"""Tools for the multi-turn agent loop: a plain dict from a tool's name to a function `str -> str`.

The tool-call format (parsed by `rlcore.rollout.agent.loop`):

    model:   ... <tool>calculator: 2*(3+4)</tool>          (the closing tag ends the model's turn)
    loop:    <result>14</result>                            (observation tokens, response_mask = 0)
    model:   The answer is 14.<|eos|>                       (EOS outside a tool call ends the sample)

A tool receives the text after the first `:` (stripped) and returns the observation text. It
signals a problem by raising (`ToolError` for expected ones); the loop turns any exception into the
observation `<result>error: MESSAGE</result>`, so a bad call never crashes a rollout.

Built-ins:
- `calculator`: arithmetic on integer and decimal literals with + - * / // % ** and brackets, parsed
  with `ast` (never `eval`); exact on integers and fractions; bounded sizes;
- `python`: runs the argument as a Python program in the rewards sandbox
  (`rlcore.rewards.sandbox.run_python`, no network, own empty directory, time and memory limits) and
  returns its stdout.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable
from fractions import Fraction

Tool = Callable[[str], str]

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolFormat:
    """The tags of a tool call and of its observation (the defaults are the format above)."""

    call_open: str = TOOL_OPEN
    """Starts a tool call: `{call_open}NAME: ARGUMENT{call_close}`."""
    call_close: str = TOOL_CLOSE
    """Ends a tool call and the model's turn (added to the stop strings)."""
    result_open: str = RESULT_OPEN
    """Starts the observation the loop appends."""
    result_close: str = RESULT_CLOSE
    """Ends the observation."""


DEFAULT_FORMAT = ToolFormat()
"""`<tool>NAME: ARGUMENT</tool>` and `<result>OBSERVATION</result>`."""


MAX_EXPRESSION_CHARS = 200
"""Longest calculator expression accepted."""
MAX_RESULT_DIGITS = 100
"""Largest calculator magnitude, in decimal digits (bounds ** and *)."""
PYTHON_TIMEOUT_S = 5.0
"""Wall-clock limit of one `python` tool call."""
PYTHON_MEMORY_MB = 512
"""Address-space limit of one `python` tool call."""


class ToolError(Exception):
    """An expected tool failure; its message becomes the observation `error: MESSAGE`."""


_BINARY: dict[type, Callable[[Fraction | float, Fraction | float], Fraction | float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_LIMIT = 10**MAX_RESULT_DIGITS


def _checked(value: Fraction | float | int) -> Fraction | float:
    """`value` as a Fraction (exact) or float, or ToolError when it is too large or not finite."""
    if isinstance(value, int | Fraction):
        if abs(value) >= _LIMIT:
            raise ToolError(f"result has more than {MAX_RESULT_DIGITS} digits")
        return Fraction(value)
    if not math.isfinite(value) or abs(value) >= _LIMIT:
        raise ToolError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return value


def _number(node: ast.Constant) -> Fraction | float:
    if type(node.value) in (int, float):
        return _checked(node.value)
    raise ToolError(f"not a number: {node.value!r}")


def _power(base: Fraction | float, exponent: Fraction | float) -> Fraction | float:
    if isinstance(exponent, Fraction) and exponent.denominator == 1 and isinstance(base, Fraction):
        if base == 0 and exponent < 0:
            raise ToolError("division by zero")
        if abs(base) not in (0, 1) and abs(exponent) * abs(math.log10(abs(base))) > MAX_RESULT_DIGITS:
            raise ToolError(f"result out of range (about 10**±{MAX_RESULT_DIGITS} or beyond)")
        return base ** int(exponent)
    try:
        value = float(base) ** float(exponent)
    except (OverflowError, ZeroDivisionError) as e:
        raise ToolError(str(e)) from None
    if isinstance(value, complex):
        raise ToolError("complex result")
    return value


def _evaluate(node: ast.AST) -> Fraction | float:
    if isinstance(node, ast.Constant):
        return _number(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            value = _power(left, right)
        elif type(node.op) in _BINARY:
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError("division by zero")
            value = _BINARY[type(node.op)](left, right)
        else:
            raise ToolError(f"operator {type(node.op).__name__} is not supported")
        return _checked(value)
    raise ToolError(f"not arithmetic: {ast.unparse(node)!r} (use numbers, + - * / // % ** and brackets)")


def _format(value: Fraction | float) -> str:
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    number = float(value)
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, e.g. `calculator("2*(3+4)") == "14"`, `"7/2" -> "3.5"`."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {text!r}") from None
    try:
        return _format(_evaluate(tree.body))
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def python_tool(code: str) -> str:
    """stdout of `code` run in the rewards sandbox; a failure raises ToolError with stderr's last line."""
    from rlcore.rewards.sandbox import run_python  # imported on use: the sandbox is optional for other tools

    result = run_python(code, timeout_s=PYTHON_TIMEOUT_S, memory_mb=PYTHON_MEMORY_MB)
    if result.timed_out:
        raise ToolError(f"timed out after {PYTHON_TIMEOUT_S:g} s")
    if result.exit_code != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        raise ToolError(lines[-1] if lines else f"exit code {result.exit_code}")
    return result.stdout.strip()


TOOLS: dict[str, Tool] = {"calculator": calculator, "python": python_tool}
"""The built-in tools by name; pass your own dict to `run_agent(tools=...)` to add or replace some."""
