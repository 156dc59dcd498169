"""OpenAI's PRM800K answer grader, in the two dialects verl scores with: `prime_math` and mathruler.

`grade_answer(given, truth, dialect)` is True when either
1. both answers are equal after Hendrycks' MATH normalisation (`math_reward.normalize`, with a
   `\\text{...}` wrapper removed first; where normalising raises, the stripped answer is compared), or
2. both are equal after the grader's own normalisation (`normalize`, below), or their elements are:
   a tuple or interval (`(a, b)`, `[a, b)`) is compared element by element, with the same brackets;
   an element pair of fractions `a/b` must be written identically (unreduced fractions are wrong);
   an integer must meet an integer; anything else is equal when sympy simplifies `(truth)-(given)`
   to 0 (only for expressions of at most two letters and no `^{`, `^(`, `^12` or `^2^`).

The grader's normalisation, in order: drop a `\\text{...}` wrapper, `$`, `%` (`\\%`, `\\$` too);
` or ` / ` and ` -> ` , `; million / billion / trillion -> `*10^6` / `^9` / `^12`; drop units (degree,
cm, meter, mile, second, ..., yard; plural, with a power) and `^\\circ`; drop one pair of outer
braces and `,\\!`; an integral float -> that integer; LaTeX -> text (pylatexenc, `√` -> `sqrt`, `π` ->
`pi`, ...); `- 3` -> `-3`; a mixed number `7 3/4` -> `7+3/4`; lower case; `1,000` -> `1000`.

The dialects differ in three details: `prime_math` (verl's `numina_*` sources) also drops the unit
`liter`; mathruler (verl's `hiyouga/geometry3k`) removes every space and brace after the mixed-number
step and drops a bare `%` in Hendrycks' normalisation. verl bounds prime_math's sympy check by 10 s
and mathruler's not at all; here both stop at `SYMPY_LIMIT_S` (where mathruler would hang, this
scores 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

from rlcore.rewards.math_reward import VERL_PERCENT
from rlcore.rewards.math_reward import normalize as hendrycks_normalize

SYMPY_LIMIT_S = 10.0
"""The longest one sympy equivalence check may run (verl's prime_math: 10 s); then the pair is unequal."""

UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
         "month", "year", "foot", "feet", "inch", "yard")  # fmt: skip
_TEXT_WRAPPER = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_FORMATTED_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_RISKY_POWERS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_BRACKETS = "()[]"


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one copy of the grader normalises (see the module docstring)."""

    units: tuple[str, ...]
    percent: tuple[str, ...]
    """The percent marks Hendrycks' normalisation drops."""
    squash: bool
    """Remove spaces and braces after the mixed-number step."""


PRIME = Dialect(units=(*UNITS, "liter"), percent=VERL_PERCENT, squash=False)
MATHRULER = Dialect(units=UNITS, percent=("\\%", "%"), squash=True)


@functools.cache
def _unit_patterns(units: tuple[str, ...]) -> list[re.Pattern[str]]:
    return [re.compile(f"{unit}(es)?(s)? *(\\^[0-9]+)?") for unit in units]


def mathd_normalize(answer: str, dialect: Dialect) -> str:
    """Hendrycks' normalisation after stripping and removing a `\\text{}` wrapper; on failure, the answer
    as far as it got."""
    answer = answer.strip()
    try:
        wrapped = _TEXT_WRAPPER.search(answer)
        if wrapped is not None:
            answer = wrapped.group("text").strip()
        return hendrycks_normalize(answer, dialect.percent)
    except Exception:
        return answer


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_integral(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def strip_formatted_commas(text: str) -> str:
    """`1,234,567` -> `1234567`, leaving tuple commas (`1,2`) alone."""
    while True:
        stripped = _FORMATTED_COMMA.sub(r"\1\3\4", text)
        if stripped == text:
            return text
        text = stripped


def is_integer_text(text: str) -> bool:
    """Whether `text` (formatted commas removed) is a number within 1e-7 of an integer."""
    try:
        return _is_integral(float(strip_formatted_commas(text)))
    except ValueError:
        return False


@functools.cache
def _latex_converter() -> Any:
    from pylatexenc.latex2text import LatexNodes2Text

    logging.getLogger("pylatexenc").setLevel(logging.ERROR)  # a warning per malformed \\frac in model text
    return LatexNodes2Text()  # holds its settings only: one serves every call (building one costs 0.3 ms)


def latex_to_text(expr: str) -> str:
    """LaTeX -> plain text sympy can read (pylatexenc), `\\frac` kept apart from a preceding integer."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = _latex_converter().latex_to_text(expr)
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, name)
    return expr.strip()


def normalize(expr: str, dialect: Dialect) -> str:
    """The grader's own normalisation (see the module docstring)."""
    wrapped = _TEXT_WRAPPER.search(expr)
    if wrapped is not None:
        expr = wrapped.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):  # fmt: skip
        expr = expr.replace(old, new)
    for unit in _unit_patterns(dialect.units):
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_integral(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        with contextlib.suppress(Exception):
            expr = latex_to_text(expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", re.sub("- *", "-", expr))
    if dialect.squash:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if is_integer_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_may_parse(expr: str) -> bool:
    """At most two distinct letters (besides `sqrt` / `frac`) and no power that sympy may hang on."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (
        len(letters) <= 2
        and "^{" not in expr
        and "^(" not in expr
        and not any(p.search(expr) for p in _RISKY_POWERS)
    )


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the block after `seconds` (SIGALRM: the main thread only; elsewhere the reward
    pool's per-sample timeout is the bound)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def equal_under_sympy(truth: str, given: str) -> bool:
    """sympy simplifies `(truth)-(given)` to 0 within `SYMPY_LIMIT_S` (implicit products allowed)."""
    expr = f"({truth})-({given})"
    if not _sympy_may_parse(expr):
        return False
    import sympy
    from sympy.parsing import sympy_parser

    try:
        with time_limit(SYMPY_LIMIT_S):
            rules = (*sympy_parser.standard_transformations, sympy_parser.implicit_multiplication_application)
            return (
                sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=rules)) == 0
            )
    except Exception:  # parse errors, sympy's own failures, TimeoutError
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval `(a, b]` (no nested brackets), else `[expr]`; [] for ''."""
    expr = strip_formatted_commas(expr)
    if not expr:
        return []
    if (
        len(expr) > 2
        and expr[0] in _BRACKETS
        and expr[-1] in _BRACKETS
        and not any(c in expr[1:-1] for c in _BRACKETS)
    ):
        return [element.strip() for element in expr[1:-1].split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given
    if is_integer_text(truth) != is_integer_text(given):
        return False
    return equal_under_sympy(truth, given)


def grade_answer(given: str | None, truth: str, dialect: Dialect) -> bool:
    """Whether `given` is a correct answer for `truth` (see the module docstring)."""
    if given is None:
        return False
    if mathd_normalize(truth, dialect) == mathd_normalize(given, dialect):
        return True
    truth, given = normalize(truth, dialect), normalize(given, dialect)
    if truth == given:
        return True
    if not given:
        return False
    truths, givens = split_tuple(truth), split_tuple(given)
    if len(truths) != len(givens) or (len(truths) > 1 and (truth[0], truth[-1]) != (given[0], given[-1])):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truths, givens, strict=True))
