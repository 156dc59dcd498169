"""verl's reward rules, data source by data source (issue 22): hand-written responses whose verl 0.9.1
scores were derived by reading verl's `math_reward.py`, `math_dapo.py` and `search_r1_like_qa_em.py`
rule by rule (the derivation is in each case's comment); `test_verl_own_functions.py` runs verl's
own functions on them too."""

from __future__ import annotations

import numpy as np
import pytest

from rlcore.rewards import math_dapo, math_reward, qa_em
from rlcore.rewards.dispatch import default_compute_score, find_reward

MATH = "HuggingFaceH4/MATH-500"

# (response, ground truth, verl's score) for the MATH sets: last \boxed{}, Hendrycks normalisation, 1 / 0
MATH_CASES = [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # "0.5" is rewritten to \frac{1}{2}
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),  # dfrac -> frac, \frac12 -> \frac{1}{2}
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),  # a/b of integers -> \frac{a}{b}
    ("\\boxed{0.75}", "\\frac{3}{4}", 0.0),  # only 0.5 is rewritten: no arithmetic
    ("The answer is 5.", "5", 0.0),  # unboxed: 0 (math-verify would give 1)
    ("\\boxed{3} then, correcting myself, \\boxed{5}", "5", 1.0),  # the last box counts
    ("\\boxed{5} then \\boxed{3}", "5", 0.0),
    ("\\boxed{x = 5}", "5", 1.0),  # one "=", at most 2 characters before it: the right side
    ("\\boxed{xyz = 5}", "5", 0.0),  # 4 characters before "=": kept
    ("\\boxed{10\\text{ cm}}", "10", 1.0),  # one "\text{ " unit cut
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),  # \left, \right and spaces dropped
    ("\\boxed 7$ and more", "7", 1.0),  # "\boxed x" up to the next $
    ("\\fbox{5}", "5", 0.0),  # found, then not unboxable: verl scores 0
    ("\\boxed{\\sqrt}", "\\sqrt", 1.0),  # an empty \sqrt breaks the rules: compared as written
    ("\\boxed{.5}", "0.5", 1.0),  # a leading "." gets its 0, then both are \frac{1}{2}
    ("\\boxed{5", "5", 0.0),  # an unclosed box
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_CASES)
def test_math_sets_score_as_verl_math_reward(response, truth, expected):
    assert default_compute_score(MATH, response, truth) == expected


def test_math_normalisation_steps():
    assert math_reward.normalize("k = \\tfrac{1}{4}") == "\\frac{1}{4}"
    assert math_reward.normalize("\\sqrt2 + \\frac 1 3") == "\\sqrt{2}+\\frac{1}{3}"
    assert math_reward.normalize(" .5") == "\\frac{1}{2}"  # " ." -> " 0.", spaces dropped, then 0.5
    assert math_reward.last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\boxed{\\frac{1}{2}}"


# (response, ground truth, verl's score) for math_dapo / math / aime*: last "Answer:" in the last 300
# characters, Minerva normalisation, 1 / -1
DAPO_CASES = [
    ("Let me think.\nAnswer: 42", "42", 1.0),
    ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}", 1.0),  # the $...$ is unwrapped
    ("Answer: \\frac34", "\\frac{3}{4}", 1.0),  # shorthand \frac34 -> \frac{3}{4}
    ("Answer: 1,000", "1000", 1.0),  # thousands commas of an integer dropped
    ("Answer: -5", "-5", 1.0),
    ("Answer: -5", "5", -1.0),
    ("answer:7", "7", 1.0),  # case-insensitive, no space needed
    ("Answer: x = 12 degrees", "12", 1.0),  # after the last "=", spaces and "degrees" removed
    ("Answer: 5 units", "5", 1.0),
    ("Answer: 3\nno wait\nAnswer: 4", "4", 1.0),  # the last one
    ("Answer: 3\nno wait\nAnswer: 4", "3", -1.0),
    ("so the result is \\boxed{42}", "42", 1.0),  # no "Answer:": the last box, compared as written
    ("so the result is \\boxed{42.0}", "42", -1.0),  # ... without normalisation
    ("\\boxed{42} and then " + "more words " * 10, "42", -1.0),  # the box is not in the last 100 characters
    ("Answer: 42\n" + "checking " * 40, "42", -1.0),  # the answer is outside the last 300 characters
    ("Answer: 42\n" + "checking " * 30, "42", 1.0),  # 281 characters: inside
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # no numeric equivalence in this rule
    ("Answer: \\boxed{17}", "17", 1.0),  # a box on the Answer line is unwrapped
]


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025_i"])
@pytest.mark.parametrize(("response", "truth", "expected"), DAPO_CASES)
def test_dapo_sources_score_as_verl_math_dapo(source, response, truth, expected):
    got = default_compute_score(source, response, truth)
    assert got["score"] == expected and got["acc"] is (expected == 1.0)
    assert isinstance(got["pred"], str)  # text: dropped from the metrics, acc is logged as reward/acc


def test_dapo_prediction_is_the_normalised_answer():
    assert math_dapo.compute_score("s", "Answer: $1{,}000$ dollars", "1000")["pred"] == "1000"
    assert math_dapo.normalize_final_answer("an 7 dollars") == "7"  # "an " before the spaces, then the word
    assert (
        math_dapo.normalize_final_answer("an integer 7") == "integer7"
    )  # "integers" is removed, not "integer"


def test_prefixes_are_matched_as_verl_matches_them():
    assert (
        find_reward("aime") is math_dapo.compute_score and find_reward("aime_hard") is math_dapo.compute_score
    )
    assert find_reward("AIME2024") is None  # verl's startswith("aime") is case-sensitive
    assert find_reward("searchR1_nq") is qa_em.compute_score and find_reward("searchR1_new") is None  # a list


SEARCH_CASES = [
    ("<answer>Paris</answer>", ["Paris"], 1.0),
    ("<answer> The Eiffel Tower. </answer>", "eiffel tower", 1.0),  # lower, no punctuation or articles
    ("I think <answer>Rome</answer>", ["Paris", "Rome"], 1.0),  # any target
    ("<answer>Rome</answer> no: <answer>Paris</answer>", ["Paris"], 1.0),  # the last answer
    ("<answer>Paris</answer> no: <answer>Rome</answer>", ["Paris"], 0.0),
    ("Paris", ["Paris"], 0.0),  # no answer tags
    ("<answer>Paris, France</answer>", ["Paris"], 0.0),  # exact match, not substring
    ("<answer>x</answer>" * 10 + "<answer>Paris</answer>", ["Paris"], 0.25),  # 11 tags: a quarter
    ("<answer>x</answer>" * 9 + "<answer>Paris</answer>", ["Paris"], 1.0),  # 10 tags: full
    ("<answer>new\nyork</answer>", np.array(["New York"]), 1.0),  # across lines; a parquet array
]


@pytest.mark.parametrize(("response", "targets", "expected"), SEARCH_CASES)
def test_search_r1_sources_score_as_verl_exact_match(response, targets, expected):
    assert default_compute_score("searchR1_nq", response, {"target": targets}) == expected


@pytest.mark.parametrize("workers", [0, 1])
def test_the_math_verifier_reaches_the_reward_workers(workers):
    """The flag's choice scores in the trainer's process and in reward worker processes alike; DAPO's
    dict result gives `acc` as an extra (its text `pred` is dropped)."""
    from rlcore.rewards import RewardScorer

    sources = [MATH, "aime2024"]
    responses = ["the answer is 0.5", "so\nAnswer: 12"]
    truths = ["\\frac{1}{2}", "12"]
    expected = {"verl": (0.0, 1.0), "math-verify": (1.0, 1.0)}  # unboxed: 0 under verl's MATH rule
    for verifier, scores in expected.items():
        with RewardScorer(data_sources=sources, num_workers=workers, math_verifier=verifier) as scorer:
            result = scorer.score(sources, responses, truths, [None, None])
        assert result.scores == scores, verifier
    with RewardScorer(data_sources=sources, num_workers=workers) as scorer:
        assert scorer.score(sources, responses, truths, [None, None]).extras == ({}, {"acc": 1.0})
