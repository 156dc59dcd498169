"""verl's reward rules, data source by data source (issue 22): hand-written responses whose verl 0.9.1
scores were derived by reading verl's `math_reward.py`, `math_dapo.py`, `search_r1_like_qa_em.py`,
`prime_math/` and `geo3k.py` (with mathruler's grader) rule by rule (the derivation is in each case's comment); `test_verl_own_functions.py` runs verl's
own functions on them too."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from rlcore.rewards import geo3k, math_dapo, math_reward, prime_math, prm800k, qa_em
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


NUMINA = "numina_olympiads"
# (response, ground truth, verl's score) for numina_*: the extracted answer, then PRM800K, then math_equal
NUMINA_CASES = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # Hendrycks: 0.5 -> \frac{1}{2} on both sides
    ("so x = 5", "5", 1.0),  # unboxed counts: after the last "="
    ("Answer: 12 cm", "12", 1.0),  # after "answer:"; the unit "cm" is dropped, 12.0 -> 12
    ("Answer: 3. Later, answer: 4", "4", 1.0),  # the last "answer:"
    ("\\boxed{- 3}", "-3", 1.0),  # spaces dropped
    ("\\boxed{3}", "-3", 0.0),  # 3 is not within 1e-4 of -3, -0.03 or -300
    ("\\boxed{2} and then \\boxed{3}", "2", 0.0),  # the last box
    ("The answer is \\boxed{\\frac{1}{", "1/2", 0.0),  # a box that never closes: the raw text is graded
    ("The answer is 50%.", "0.5", 0.0),  # "50%." is no percentage (the dot), 50 is no 0.5
    ("The answer is 50%", "0.5", 1.0),  # 50% -> 50, and 50 = 0.5 * 100
    ("\\boxed{2\\pi}", "6.28", 1.0),  # \pi -> 3.14: 2*3.14
    ("\\boxed{2\\pi}", "6.2832", 1.0),  # \pi -> math.pi: 6.28319 within 1e-4
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),  # dfrac -> frac, \frac34 -> \frac{3}{4}
    ("\\boxed{2/4}", "1/2", 0.0),  # two fractions must be written alike (unreduced is wrong)
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # sympy: (x+1)^2 - (x^2+2x+1) simplifies to 0
    ("\\boxed{10\\text{ cm}}", "10", 1.0),  # Hendrycks cuts the \text{ } unit
    ("\\boxed{3.0001}", "3", 1.0),  # not an integer for PRM800K, but within 1e-4 for math_equal
    ("\\boxed{a_5}", "5", 0.0),  # "a_5" is a base-a number: float('a') raises, the score is 0
    ("\\boxed{1010_2}", "1010", 1.0),  # a base subscript is dropped: 1010
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{[1, 2]}", "(1,2)", 0.0),  # an interval's brackets must agree
    ("\\boxed{Interval(0, 1)}", "[0,1]", 1.0),  # sympy's interval -> [0, 1]
    ("answer: Matrix([[1, 2]])", "\\begin{pmatrix} 1 & 2 \\end{pmatrix}", 1.0),  # entries 1, 2
    ("\\boxed{1,000}", "1000", 1.0),  # a formatted comma
    ("\\boxed{\\$5}", "5", 1.0),  # \$ dropped
    ("no answer here", "5", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), NUMINA_CASES)
def test_numina_sources_score_as_verl_prime_math(response, truth, expected):
    for source in prime_math.DATA_SOURCES:
        assert default_compute_score(source, response, truth) == expected, source


def test_prime_answer_extraction_and_grader_steps():
    assert prime_math.extract_answer("We get 7. So the answer is \\boxed{x = 7}. Done") == "7"
    assert (
        prime_math.extract_answer("Thus x = 12 is the answer. Good") == "12"
    )  # before "is the answer", after "="
    assert prime_math.extract_answer("Thus 12 is the answer") == "Thus 12"  # no marker before 12: kept
    assert prm800k.normalize("\\text{5 million}", prm800k.PRIME) == "5 *10^6"  # spaces stay (prime)
    assert prm800k.normalize("\\text{5 million}", prm800k.MATHRULER) == "5*10^6"
    assert prm800k.normalize("7 3/4", prm800k.PRIME) == "7+3/4"  # a mixed number
    assert (
        prm800k.normalize("3 liters", prm800k.PRIME) == "3"
        and prm800k.normalize("3 liters", prm800k.MATHRULER) == "3liters"
    )
    assert prm800k.split_tuple("(1,000, 2]") == ["1000", "2"]


def test_arithmetic_evaluates_numbers_only():
    assert prime_math.arithmetic("(1*3.14, 2**3)") == (3.14, 8) and prime_math.arithmetic(" [1/2]") == [0.5]
    assert prime_math.arithmetic("1 < 2 < 3") is True
    rng = random.Random(0)
    pieces = [
        "1",
        "2",
        "3.14",
        "0",
        "*",
        "/",
        "+",
        "-",
        "(",
        ")",
        "[",
        "]",
        ",",
        " ",
        "**",
        "//",
        "%",
        "^",
        "<",
        "==",
        ".5",
    ]
    for _ in range(3000):  # these texts hold no names: eval() is safe on them, and is the reference
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 9)))
        try:
            want = ("ok", repr(eval(text)))
        except Exception:
            want = ("error",)
        try:
            got = ("ok", repr(prime_math.arithmetic(text)))
        except Exception:
            got = ("error",)
        assert got == want, text
    for text in ("__import__('os')", "x*3.14", "(1).real", "abs(-1)", "'a'", "9**9**9", "[1]*10**9"):
        with pytest.raises((ValueError, OverflowError)):
            prime_math.arithmetic(text)


def test_a_sympy_check_past_its_limit_is_unequal(monkeypatch):
    import sympy

    monkeypatch.setattr(prm800k, "SYMPY_LIMIT_S", 0.2)
    monkeypatch.setattr(sympy, "simplify", lambda expr: time.sleep(5))
    start = time.monotonic()
    assert prm800k.equal_under_sympy("x+1", "1+x") is False
    assert time.monotonic() - start < 2
    monkeypatch.undo()
    assert prm800k.equal_under_sympy("x+1", "1+x") is True
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(prm800k.equal_under_sympy("2x", "x+x")))
    thread.start()
    thread.join()  # no SIGALRM off the main thread: the check runs unbounded there (the pool bounds it)
    assert outcome == [True]


GEO = "hiyouga/geometry3k"
# (response, ground truth, verl's score): 0.9 * (last box graded by mathruler) + 0.1 * <think> format
GEO_CASES = [
    ("<think>angles</think> so \\boxed{30}", "30", 1.0),
    ("so \\boxed{30}", "30", 0.9),  # no think block
    ("<think>a</think> \\boxed{40}", "30", 0.1),  # well formed, wrong
    ("<think>a</think> the answer is 30", "30", 0.0),  # unboxed: the text "None" is graded
    ("\\boxed{30^\\circ}", "30", 0.9),  # degrees dropped
    ("\\boxed{\\frac{1}{2}}", "0.5", 0.9),
    ("\\boxed{2\\sqrt{3}}", "2 \\sqrt 3", 0.9),  # sqrt braced, spaces dropped
    ("\\boxed{45%}", "45", 0.9),  # mathruler's Hendrycks copy drops a bare %
    ("<think>a</think>\\boxed{3} \\boxed{4}", "3", 0.1),  # the last box
    ("\\boxed{4\\sqrt{2}}", "\\sqrt{32}", 0.9),  # sympy: 4*sqrt(2) - sqrt(32) = 0
]


@pytest.mark.parametrize(("response", "truth", "expected"), GEO_CASES)
def test_geometry3k_scores_as_verl_geo3k(response, truth, expected):
    assert default_compute_score(GEO, response, truth) == expected
    assert geo3k.boxed_content("\\boxed{a{b}c} x") == "a{b}c" and geo3k.boxed_content("\\boxed{a") == "None"


def test_numina_and_geometry3k_score_in_reward_workers():
    """Scored in a worker process (sympy and its time limit there), and refused at start-up without pylatexenc."""
    from rlcore.rewards import RewardScorer

    sources = [NUMINA, GEO, "numina_cn_k12"]
    responses = ["the answer is x^2+2x+1", "<think>a</think>\\boxed{30}", "so x = 7.5"]
    with RewardScorer(data_sources=sources, num_workers=1) as scorer:
        result = scorer.score(sources, responses, ["(x+1)^2", "30", "\\frac{15}{2}"], [None] * 3)
    assert result.scores == (1.0, 1.0, 1.0)


def test_latex_graders_need_pylatexenc(monkeypatch):
    import importlib.util

    from rlcore.rewards.custom import RewardSpecError
    from rlcore.rewards.dispatch import resolve_reward_fn

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pylatexenc" else real(name, *a)
    )
    with pytest.raises(
        RewardSpecError, match=r"\['numina_amc_aime'\] grades LaTeX answers with pylatexenc: pip install"
    ):
        resolve_reward_fn(["numina_amc_aime", "openai/gsm8k"])
    resolve_reward_fn(["numina_amc_aime"], math_verifier="math-verify")  # math-verify needs no pylatexenc


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
