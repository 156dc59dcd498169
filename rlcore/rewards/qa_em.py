"""Search-R1 style question answering, verl's exact match: the last `<answer>...</answer>` against the targets.

verl scores `searchR1_nq`, `searchR1_triviaqa`, `searchR1_popqa`, `searchR1_hotpotqa`,
`searchR1_2wikimultihopqa`, `searchR1_musique` and `searchR1_bamboogle` with
`verl/utils/reward_score/search_r1_like_qa_em.py`: the answer is the content of the last
`<answer>...</answer>` (across lines), stripped; it and each of `ground_truth["target"]` (a string or
a list of them) are normalised SQuAD-style (lower case, punctuation and the articles a / an / the
removed, whitespace collapsed); a match scores 1, or 0.25 when the response holds more than 10
opening or closing answer tags (a guard against spamming tags); no answer or no match scores 0.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TAG_LIMIT = 10
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def extract_answer(solution_str: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>`, or None."""
    found = ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def exact_match(answer: str, targets: str | Iterable[str]) -> bool:
    """Whether `answer` equals one of `targets` after `normalize_answer`."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    mine = normalize_answer(answer)
    return any(normalize_answer(str(t)) == mine for t in targets)


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl-signature exact-match reward: 1.0 (0.25 past 10 answer tags) if the answer matches, else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None or not exact_match(answer, ground_truth["target"]):
        return 0.0
    spammed = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > TAG_LIMIT
    return 0.25 if spammed else 1.0
