"""MATH-style answers checked by symbolic equivalence with Hugging Face's `math-verify`.

As verl's `verl/utils/reward_score/math_verify.py`: the ground truth is wrapped as `\\boxed{...}` and
parsed as LaTeX; the response is parsed with both the expression and the LaTeX extractors (a
`\\boxed{}` answer, `$...$`, or a final bare expression); the score is 1 if any extracted answer is
equivalent to the ground truth (sympy; `\\frac{1}{2}` == `0.5` == `\\frac{2}{4}`), else 0. A
math-verify timeout gives `timeout_score`, and a response the parser chokes on scores 0 as in verl.

Departure from verl: a ground truth that math-verify cannot parse raises `ValueError` (counted in
`reward/errors`) instead of silently scoring every response 0, so a broken data set is noticed.

math-verify times out with `signal.alarm`, which only works in a process's main thread; off the
main thread its timeouts are switched off (the scorer's per-sample timeout still applies when it
runs in worker processes).
"""

from __future__ import annotations

import threading
from typing import Any

try:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
except ImportError:  # reported by `require_math_verify` when a MATH data_source is configured
    parse = verify = None
    TimeoutException = TimeoutError

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own per-call timeout (its default), used in a main thread."""


def require_math_verify() -> None:
    """Raise ImportError with the install command if math-verify is missing."""
    if parse is None:
        raise ImportError("MATH rewards need the math-verify package: pip install 'math-verify>=0.9'")


def score(solution_str: str, ground_truth: Any, *, timeout_score: float = 0.0) -> float:
    """1.0 if the response's answer is symbolically equal to the ground truth, else 0.0."""
    require_math_verify()
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", [LatexExtractionConfig()], parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    try:
        pred = parse(solution_str, [ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=timeout)
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except TimeoutException:
        return timeout_score
    except Exception:  # the model's text broke the parser: verl scores it 0
        return 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature MATH reward through math-verify."""
    return score(solution_str, ground_truth)
