"""MATH (Hendrycks et al.) answers, verl's rules: the last `\\boxed{}` compared after string normalisation.

verl scores `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval` and `HuggingFaceH4/MATH-500` with
`verl/utils/reward_score/math_reward.py`: 1 if the content of the response's last `\\boxed{...}` (or
`\\boxed x`, up to the next `$`) equals the ground truth after both are normalised, else 0. An
unboxed final answer scores 0, as does a `\\fbox{}` one (verl finds it, then fails to unbox it).

Normalisation (`strip_string`, in this order): drop newlines and `\\!`; `\\\\` -> `\\`; tfrac / dfrac
-> frac; drop `\\left`, `\\right`, degree marks `^{\\circ}` / `^\\circ`, `\\$`; cut a unit written as
`\\text{ ...}` (only when it appears once); drop `\\%`; `" ."` -> `" 0."`, `"{."` -> `"{0."`, a leading
`.` gets a 0; `k = 3` -> `3` (one `=`, at most 2 characters before it); `\\sqrt3` -> `\\sqrt{3}`;
drop spaces; `\\frac12` -> `\\frac{1}{2}`; `0.5` -> `\\frac{1}{2}`; `a/b` of two integers ->
`\\frac{a}{b}`. Where a rule meets malformed LaTeX (an empty `\\sqrt`, two `\\text{ }` units), verl
falls back to comparing the two strings as they are; so does this.
"""

from __future__ import annotations

from typing import Any

from rlcore.data.answers import last_boxed, unbox


def _one_unit_cut(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("more than one \\text{ } unit")
    return parts[0]


def _braced_sqrt(s: str) -> str:
    head, *rest = s.split("\\sqrt")
    for part in rest:
        head += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])  # IndexError: empty
    return head


def _braced_fracs(s: str) -> str:
    head, *rest = s.split("\\frac")
    for part in rest:
        head += "\\frac"
        if part[0] == "{":  # IndexError on a trailing \frac, as verl
            head += part
            continue
        if len(part) < 2:
            return s
        a, b, tail = part[0], part[1], part[2:]
        head += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return head


def _slash_fraction(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


VERL_PERCENT = ("\\\\%", "\\%")
"""The percent marks `strip_string` drops: `\\\\%` then `\\%` (a bare `%` stays)."""


def normalize(s: str, percent: tuple[str, ...] = VERL_PERCENT) -> str:
    """verl's `strip_string` (see the module docstring); raises on the malformed cases it raises on.
    `percent`: the marks dropped at the percent step (mathruler's copy drops `\\%` and then `%`)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        s = s.replace(old, new)
    s = _one_unit_cut(s)
    for mark in percent:
        s = s.replace(mark, "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _braced_fracs(_braced_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_fraction(s)


def is_equiv(answer: str, truth: str) -> bool:
    """Equal after `normalize`, or, where normalising raises, equal as written."""
    try:
        return normalize(answer) == normalize(truth)
    except (ValueError, IndexError, AssertionError):
        return answer == truth


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature MATH reward: 1.0 if the last boxed answer is equivalent to the ground truth, else 0.0."""
    boxed = last_boxed(solution_str)
    if boxed is None:
        return 0.0
    try:
        return 1.0 if is_equiv(unbox(boxed), str(ground_truth)) else 0.0
    except ValueError:  # found an \fbox{}: verl cannot unbox it and scores 0
        return 0.0
