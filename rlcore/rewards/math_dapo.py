"""DAPO / AIME answers, verl's `math_dapo` rules: the last `Answer: ...` line, Minerva-normalised, 1 / -1.

verl scores `math_dapo`, `math`, `math_dapo_reasoning` and every data_source starting with `aime`
with `verl/utils/reward_score/math_dapo.py`: only the response's last 300 characters are read; the
answer is the last match of `Answer\\s*:\\s*(...)` (case-insensitive, to the end of the line), or
`[INVALID]` when there is none; it and the ground truth are normalised (`normalize_final_answer`, the
Minerva rules: the part after the last `=`, words and units removed, `\\text{}` / `\\boxed{}` unwrapped,
`\\fracab` -> `\\frac{a}{b}`, thousands commas dropped from integers) and compared as strings. The result
is a dict: `score` 1.0 or -1.0, `acc` (logged as `reward/acc`) and `pred` (the normalised answer, text:
not logged). Without an `Answer:` line, verl 0.9 falls back to the last `\\boxed{...}` of the last 100
characters, compared with the ground truth as written (no normalisation: `\\boxed{42}` is right for
"42", `\\boxed{42.0}` is not). verl's optional strict-box mode is not the default and is not built.
"""

from __future__ import annotations

import re
from typing import Any

from rlcore.data.answers import closing_brace

TAIL_CHARS = 300
"""verl reads the last 300 characters (the longest MATH-500 answer has 159)."""
BOX_TAIL_CHARS = 100
"""Without an `Answer:` line, verl 0.9 looks for a box in the last 100 of those characters."""
ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))  # fmt: skip
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots")  # fmt: skip
"""The Minerva normalisation's substitutions and removed words, in verl's order (the order matters:
`"an "` goes before `"a "`, `" "` before the word list)."""
_UNWRAP = tuple(re.compile(p) for p in (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})", r"(\\overline\{)(.*?)(\})",
                                        r"(\\boxed\{)(.*)(\})"))  # fmt: skip


def normalize_final_answer(answer: str) -> str:
    """The Minerva normalisation of a final answer, as verl's `math_dapo.normalize_final_answer`."""
    answer = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for word in _REMOVED:
        answer = answer.replace(word, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)  # keep the first $...$ only
    for wrapper in _UNWRAP:
        answer = wrapper.sub("\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _last_box_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced) of `text`, None if there is none."""
    start = text.rfind("\\boxed{")
    end = closing_brace(text, start) if start >= 0 else None
    return None if end is None else text[start + len("\\boxed{") : end]


def judge(solution_str: str, ground_truth: str) -> tuple[bool, str]:
    """(correct, prediction) by verl 0.9's rule: the Minerva `Answer:` when there is one, else the last
    box of the last 100 characters compared as written."""
    tail = solution_str[-TAIL_CHARS:]
    found = ANSWER.findall(tail)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    if pred != "[INVALID]":
        return pred == normalize_final_answer(ground_truth), pred
    boxed = _last_box_content(tail[-BOX_TAIL_CHARS:])
    if boxed is not None:
        return boxed == ground_truth, boxed
    return False, pred


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, Any]:
    """verl-signature DAPO reward: {"score": 1.0 | -1.0, "acc": bool, "pred": str}."""
    correct, pred = judge(solution_str, str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
