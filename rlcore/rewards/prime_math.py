"""PRIME's math reward, verl's rules for the `numina_*` data sources: 1 / 0.

verl scores `numina_aops_forum`, `numina_synthetic_math`, `numina_amc_aime`, `numina_synthetic_amc`,
`numina_cn_k12` and `numina_olympiads` with `verl/utils/reward_score/prime_math`:

1. **Extract** the answer (`extract_answer`): cut after the last `answer:` / `answer is` / `answers are`
   (in turn, case-insensitive), before the last `is answer` / `is the answer` / `are answers` / `are the
   answers`; take the last `\\boxed{}` (or `\\fbox{}`) of what is left, then what precedes its last `". "`,
   then what follows the last `be ` / `is ` / `are ` / `=` / `: ` / `get ` (in turn). An unboxed answer
   counts: `x = 5` gives `5`.
2. **Grade** it with the PRM800K grader (`prm800k.grade_answer`, prime dialect).
3. **Else compare** it as PRIME's `math_equal` does (`math_equal`): case and spaces ignored; as numbers
   within 1e-4 relative, also against truth / 100 and truth * 100 (percent either way); `$5` and `5%`
   as 5; `1010_2` as 1010; `\\pi` as 3.141592653589793 or as 3.14 (either may match) in an answer that
   is plain arithmetic once it is substituted (`2\\pi` -> 6.28...); `Interval(a, b)` as `[a, b]`;
   brackets and braces ignored unless both sides are intervals, then element by element with the same
   brackets; comma-separated lists element by element; `Point(a, b)` against `(a, b)`; `Matrix([...])`
   or a nested list against a `pmatrix`. Where one of these raises (an answer `x_1`: its base is not a
   number), the response scores 0, as in verl.

verl 0.9.1's last fallback (`symbolic_equal`, sympy parsing and `simplify(a - b)`) never compares: it
uses the decorator `timeout_limit` as a context manager, which raises TypeError, which it swallows; so
here it is absent. The score is the correctness alone (verl drops the format flag it computes).

verl `eval()`s the answer text in two places (the substituted `\\pi` answer; a list answer beside a
`pmatrix`). Here those go through `arithmetic`, which evaluates numbers, arithmetic, comparisons,
tuples and lists and nothing else (no names, calls or attributes; powers and repetitions bounded),
and a `Matrix(...)` answer reaches sympy only when it names nothing but sympy's math functions.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from typing import Any

from rlcore.data.answers import last_box_span
from rlcore.rewards import prm800k

DATA_SOURCES = tuple(f"numina_{name}" for name in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc",
                                                   "cn_k12", "olympiads"))  # fmt: skip
TOLERANCE = 1e-4
PIS = (math.pi, 3.14)
"""The values tried for `\\pi` where the answer or the truth has one."""

_AFTER_MARKERS = ("answer:", "answer is", "answers are")
_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def last_boxed_content(text: str) -> str | None:
    """The stripped content of the last `\\boxed{...}` (else `\\fbox{...}`), braces balanced; None if none."""
    span = last_box_span(text)
    return None if span is None else text[text.index("{", span[0]) + 1 : span[1]].strip()


def extract_answer(response: str) -> str:
    """The answer part of a response (step 1 of the module docstring)."""
    for marker in _AFTER_MARKERS:
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker) :].strip()
    for marker in _BEFORE_MARKERS:
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[:at].strip()
    response = last_boxed_content(response) or response
    at = response.lower().rfind(". ") if ". " in response else -1
    if at != -1:
        response = response[:at].strip()
    for marker in _LAST_MARKERS:
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker) :].strip()
    return response


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}  # fmt: skip
_MAX_EXPONENT = 100_000
_MAX_REPEAT = 10_000


def arithmetic(text: str) -> Any:
    """The value of `text` as Python evaluates numbers, arithmetic, comparisons, tuples and lists;
    ValueError (or the error Python raises) for anything else."""
    with warnings.catch_warnings():  # "invalid decimal literal" and the like, from model text
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex, bool):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        items = [_evaluate(e) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(node.op, left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        values = [_evaluate(node.left), *(_evaluate(c) for c in node.comparators)]
        return all(_COMPARE[type(op)](a, b) for op, a, b in zip(node.ops, values, values[1:], strict=False))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def _check_size(op: ast.operator, left: Any, right: Any) -> None:
    if isinstance(op, ast.Pow | ast.LShift) and isinstance(right, int) and right > _MAX_EXPONENT:
        raise OverflowError("exponent too large")
    counts = (left, right) if isinstance(op, ast.Mult) else ()
    if any(isinstance(a, tuple | list) for a in counts) and any(
        isinstance(c, int) and c > _MAX_REPEAT for c in counts
    ):
        raise OverflowError("repetition too large")


def _as_number(value: Any) -> float | None:
    """PRIME's `is_digit`: the float of `value` with `{,}` (else every `,`) removed, None if there is none."""
    text = str(value)
    try:
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


def _substitute_pi(text: str, pi: float) -> Any:
    """Each `\\pi` -> `*pi` after a digit, else `1*pi`; then the arithmetic value, or the text if it has none."""
    at = text.find("\\pi")
    while at != -1:
        text = text[:at] + ("*" if at > 0 and text[at - 1].isdigit() else "1*") + f"{pi}" + text[at + 3 :]
        at = text.find("\\pi", at + 1)
    try:
        return arithmetic(text)
    except Exception:
        return text


def _prepare(answer: Any, pi: float) -> Any:
    """PRIME's `normalize`: `$5` -> `5`, `5%` -> `5`, `1010_2` -> 1010 (ValueError for a non-number base),
    then `\\pi` substituted."""
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:
        return int(float(answer.split("_")[0]))
    return _substitute_pi(answer, pi) if "\\pi" in answer else answer


_INTERVALS = (
    (re.compile(r"^Interval\((.*)\)$"), "[{}]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "({})"),
)


def _sympy_interval_to_brackets(text: str) -> str:
    for pattern, brackets in _INTERVALS:
        found = pattern.match(text)
        if found:
            return brackets.format(found.group(1))
    return text


def math_equal(prediction: Any, reference: Any, pi: float = math.pi) -> bool:
    """PRIME's `math_equal` without its dead symbolic fallback (step 3 of the module docstring); raises
    where verl's raises (the caller scores 0)."""
    prediction, reference = _prepare(prediction, pi), _prepare(reference, pi)
    if isinstance(prediction, str):
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    as_numbers = _as_number(prediction), _as_number(reference)
    if None not in as_numbers:
        given, truth = as_numbers
        return any(math.isclose(t, given, rel_tol=TOLERANCE) for t in (truth / 100, truth, truth * 100))
    if not prediction and prediction not in (0, False):
        return False
    return _equal_as_text(_sympy_interval_to_brackets(str(prediction).strip()), str(reference).strip())


def _unbracketed(prediction: str, reference: str) -> tuple[str, str]:
    if (prediction[:1] == "[" and prediction[-1:] == "]" and reference[:1] != "(") or (
        prediction[:1] == "(" and prediction[-1:] == ")" and reference[:1] != "["
    ):
        prediction, reference = prediction.strip("[]()"), reference.strip("[]()")
    drop = str.maketrans("", "", "{}()")
    return prediction.translate(drop), reference.translate(drop)


def _all_equal(predictions: list[Any], references: list[Any]) -> bool:
    """Element by element, every element compared (so an element that raises raises, as in verl)."""
    return all(
        [math_equal(p, r) for p, r in zip(predictions, references, strict=False)]
    )  # a list: all compared


def _equal_as_text(prediction: str, reference: str) -> bool:
    bare_prediction, bare_reference = _unbracketed(prediction, reference)
    if bare_prediction == bare_reference:
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and ((prediction[0], prediction[-1]) == (reference[0], reference[-1]))
    ):
        parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(parts) == len(ref_parts) and _all_equal(parts, ref_parts):
            return True
    if "," in prediction and "," in reference:
        parts, ref_parts = (
            [p.strip() for p in prediction.split(",")],
            [r.strip() for r in reference.split(",")],
        )
        if len(parts) == len(ref_parts):
            return _all_equal(parts, ref_parts)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":  # IndexError on ''
        parts, ref_parts = prediction[prediction.find("(") + 1 : -1].split(","), reference[1:-1].split(",")
        if len(parts) == len(ref_parts) and _all_equal(parts, ref_parts):
            return True
    if "\\begin{pmatrix}" in reference:
        return _equal_matrices(prediction, reference)
    return False


def _equal_matrices(prediction: str, reference: str) -> bool:
    if prediction.startswith("Matrix"):
        try:
            entries, ref_entries = _sympy_matrix(prediction), reference.split()[1:-1:2]
            return len(entries) == len(ref_entries) and _all_equal(list(entries), ref_entries)
        except Exception:
            return False
    if not (prediction.startswith("[") and prediction.endswith("]")):
        return False
    rows = arithmetic(prediction)  # raises where verl's eval() raises (the response then scores 0)
    if not isinstance(rows, list):
        return False
    try:
        body = reference.removeprefix("\\\\begin{pmatrix}").removeprefix("\\begin{pmatrix}")
        body = body.removesuffix("\\\\end{pmatrix}").removesuffix("\\end{pmatrix}")
        ref_rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
        return len(rows) == len(ref_rows) and _all_equal(rows, ref_rows)
    except Exception:
        return False


_SYMPY_NAMES = frozenset({"Matrix", "sqrt", "pi", "oo", "sin", "cos", "tan", "log", "exp", "Rational",
                          "Integer", "Float", "I", "E", "root", "cbrt", "Abs"})  # fmt: skip


def _sympy_matrix(text: str) -> Any:
    """sympy's parse of a `Matrix(...)` answer that names only sympy math (and one- or two-letter symbols)."""
    names = set(re.findall(r"[A-Za-z_]\w*", text))
    if (
        "__" in text
        or any(q in text for q in "'\"`")
        or re.search(r"\.\s*[A-Za-z_]", text)
        or any(len(n) > 2 and n not in _SYMPY_NAMES for n in names)
    ):
        raise ValueError(f"not a plain sympy matrix: {text[:80]!r}")
    from sympy.parsing.sympy_parser import parse_expr

    return parse_expr(text)


def is_correct(answer: str, truth: str) -> bool:
    """Steps 2 and 3 of the module docstring for an extracted answer."""
    if prm800k.grade_answer(answer, truth, prm800k.PRIME):
        return True
    try:
        pis = PIS if "\\pi" in answer or "\\pi" in truth else (math.pi,)
        return any([math_equal(answer, truth, pi) for pi in pis])  # a list: both tried, as in verl
    except Exception:
        return False


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature `numina_*` reward: 1.0 if the extracted answer is correct for the ground truth, else 0.0."""
    return 1.0 if is_correct(extract_answer(str(solution_str)), str(ground_truth)) else 0.0
