"""Built-in rule rewards: each on right / wrong / ill-formatted answers, and the data_source table."""

from __future__ import annotations

import numpy as np
import pytest

from rlcore.data.tasks import TASKS, generate_rows
from rlcore.rewards import countdown, gsm8k, math_answer, prime_math
from rlcore.rewards.dispatch import (
    CODE_SOURCES,
    DAPO_SOURCES,
    MATH_SOURCES,
    REWARD_FNS,
    SEARCH_R1_SOURCES,
    UnknownDataSourceError,
    default_compute_score,
    resolve_reward_fn,
)
from rlcore.rewards.format import THINK_ANSWER, format_score, with_format_reward
from rlcore.rewards.sandbox import sandbox_available

# -- GSM8K (verl gsm8k.py: strict '#### n', flexible last number, 300-char tail) ------------------


def test_gsm8k_strict_right_wrong_and_unformatted():
    assert gsm8k.score("3 + 4 = 7, so 70 + 2 = 72.\n#### 72", "72") == 1.0
    assert gsm8k.score("#### 1,000", "1000") == 1.0  # commas are dropped
    assert gsm8k.score("#### -3", "-3") == 1.0
    assert gsm8k.score("#### 71", "72") == 0.0  # extracted but wrong: format_score
    assert gsm8k.score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.score("The answer is 72", "72") == 0.0  # no '#### ': nothing extracted -> 0
    assert gsm8k.score("The answer is 72", "72", format_score=0.1) == 0.0  # not even the format score
    assert gsm8k.score("#### 5 then I changed my mind #### 72", "72") == 1.0  # the last one counts


def test_gsm8k_flexible_takes_the_last_number():
    assert gsm8k.score("The answer is 72", "72", method="flexible") == 1.0
    assert gsm8k.score("12 apples and 60 pears: 72 fruits", "72", method="flexible") == 1.0
    assert gsm8k.score("no digits at all", "72", method="flexible") == 0.0
    # verl keeps the match as written: a trailing dot makes "72." != "72" (format score, not correct)
    assert gsm8k.extract_answer("It is 72.", method="flexible") == "72."
    assert gsm8k.score("It is 72.", "72", method="flexible", format_score=0.1) == 0.1
    assert gsm8k.extract_answer("1,234 in all", method="flexible") == "1,234"  # commas kept in flexible


def test_gsm8k_reads_only_the_last_300_characters():
    answer = "#### 72"
    assert gsm8k.score(answer + " " + "x" * (300 - len(answer) - 1), "72") == 1.0  # exactly 300 chars
    assert gsm8k.score(answer + " " + "x" * 300, "72") == 0.0  # the answer fell out of the tail


def test_gsm8k_unknown_method():
    with pytest.raises(ValueError, match="method='loose'"):
        gsm8k.extract_answer("#### 1", method="loose")  # type: ignore[arg-type]


# -- MATH through math-verify ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        ("The answer is 0.5", "\\frac{1}{2}"),
        ("So we get $\\boxed{\\frac{1}{2}}$.", "0.5"),
        ("Thus \\boxed{2}", "2"),
        ("The final answer is $\\frac{2}{4}$", "\\frac12"),
        ("We find $x = \\boxed{\\sqrt{4}}$", "2"),
    ],
)
def test_math_symbolic_equivalence(response, truth):
    assert math_answer.score(response, truth) == 1.0


@pytest.mark.parametrize(
    "response",
    ["Thus \\boxed{3}", "The answer is 0.25", "I could not solve it.", ""],
    ids=["wrong-boxed", "wrong-number", "no-answer", "empty"],
)
def test_math_wrong_or_missing_answer_scores_zero(response):
    assert math_answer.score(response, "\\frac{1}{2}") == 0.0


def test_math_unparseable_ground_truth_raises():
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        math_answer.score("\\boxed{1}", "")


@pytest.mark.parametrize("source", [*MATH_SOURCES, *DAPO_SOURCES, "aime2025"])
def test_math_verifier_math_verify_checks_every_math_source_symbolically(source):
    fn = resolve_reward_fn([source], math_verifier="math-verify")
    assert fn(source, "so \\boxed{2/4}", "\\frac{1}{2}") == 1.0  # verl's rules: 0 (MATH), -1 (DAPO)
    assert fn(source, "so the answer is 0.5", "\\frac{1}{2}") == 1.0  # unboxed
    assert fn(source, "so \\boxed{0.6}", "\\frac{1}{2}") == 0.0
    assert default_compute_score(source, "so \\boxed{2/4}", "\\frac{1}{2}") in (
        0.0,
        {"score": -1.0, "acc": False, "pred": "2/4"},
    )


# -- Countdown (TinyZero) ----------------------------------------------------------------------------

TRUTH = {"target": 24, "numbers": [3, 8, 1]}


def test_countdown_right_wrong_and_unformatted():
    assert countdown.score("<think>3*8=24, times 1</think>\n<answer>3 * 8 * 1</answer>", TRUTH) == 1.0
    assert countdown.score("<answer>(8 * 3) / 1</answer>", TRUTH) == 1.0
    assert countdown.score("<answer>3 + 8 + 1</answer>", TRUTH) == 0.1  # right numbers, wrong value
    assert countdown.score("<answer>3 * 8</answer>", TRUTH) == 0.1  # a number unused
    assert countdown.score("<answer>3 * 8 * 1 * 1</answer>", TRUTH) == 0.1  # a number used twice
    assert countdown.score("3 * 8 * 1", TRUTH) == 0.0  # no <answer> tags
    assert countdown.score("<answer>3 * 8 * 1", TRUTH) == 0.0  # unclosed


def test_countdown_last_answer_counts_and_division_is_exact():
    assert countdown.score("<answer>3+8+1</answer> no wait <answer>8*3*1</answer>", TRUTH) == 1.0
    # 8 / (3 - 1) = 4 exactly; 1 / 3 * 3 would be 0.999... in floats but is exactly 1 here
    assert countdown.score("<answer>8 / (3 - 1)</answer>", {"target": 4, "numbers": [1, 3, 8]}) == 1.0
    assert countdown.score("<answer>1 / 3 * 3</answer>", {"target": 1, "numbers": [1, 3, 3]}) == 1.0


def test_countdown_never_evaluates_code():
    assert countdown.score("<answer>__import__('os').getcwd()</answer>", TRUTH) == 0.1  # format score only
    assert countdown.score("<answer>2 ** 3</answer>", {"target": 8, "numbers": [2, 3]}) == 0.1  # no power
    assert countdown.score("<answer>8 / (3 - 3) * 1</answer>", {"target": 1, "numbers": [8, 3, 3, 1]}) == 0.1
    assert countdown.score("<answer>" + "9" * 5000 + "</answer>", TRUTH) == 0.1  # huge literal: no crash


def test_countdown_accepts_parquet_arrays():
    truth = {"target": np.int64(24), "numbers": np.array([3, 8, 1])}
    assert countdown.score("<answer>3*8*1</answer>", truth) == 1.0


# -- format reward ------------------------------------------------------------------------------------


def test_format_score():
    assert format_score("<think>2 + 2 = 4</think>\n<answer>4</answer>") == 1.0
    assert format_score("  <think>multi\nline</think><answer>4</answer>\n") == 1.0
    assert format_score("<answer>4</answer>") == 0.0  # no reasoning block
    assert format_score("<think>x</think><answer>4</answer> trailing text") == 0.0
    assert format_score("#### 4", pattern=r"#### -?\d+") == 1.0
    assert THINK_ANSWER.startswith("<think>")


def test_with_format_reward_adds_weighted_format_score():
    fn = with_format_reward(gsm8k.compute_score, weight=0.25, pattern=r".*#### \d+")
    got = fn(data_source="openai/gsm8k", solution_str="so #### 72", ground_truth="72", extra_info=None)
    assert got == {"score": 1.0 + 0.25 * 1.0, "acc": 1.0, "format": 1.0}
    got = fn(data_source="openai/gsm8k", solution_str="so #### 71", ground_truth="72", extra_info=None)
    assert got == {"score": 0.0 + 0.25 * 1.0, "acc": 0.0, "format": 1.0}


# -- the table ---------------------------------------------------------------------------------------


def _examples() -> dict[str, tuple[str, str, object]]:
    """(right response, wrong response, ground truth) for every data_source of REWARD_FNS."""
    out: dict[str, tuple[str, str, object]] = {"openai/gsm8k": ("#### 72", "#### 7", "72")}
    out.update(dict.fromkeys(MATH_SOURCES, ("\\boxed{0.5}", "\\boxed{5}", "\\frac{1}{2}")))
    out.update(dict.fromkeys(DAPO_SOURCES, ("so\nAnswer: 0.5", "Answer: 5", "0.5")))
    out.update(
        dict.fromkeys(
            SEARCH_R1_SOURCES, ("<answer>Paris</answer>", "<answer>Rome</answer>", {"target": ["Paris"]})
        )
    )
    out.update(dict.fromkeys(prime_math.DATA_SOURCES, ("the answer is 1/2", "the answer is 2", "0.5")))
    out["hiyouga/geometry3k"] = ("<think>x</think>\\boxed{30}", "\\boxed{40}", "30")
    out["countdown"] = ("<answer>3*8*1</answer>", "<answer>3+8+1</answer>", TRUTH)
    code_truth = {"inputs": ["3\n"], "outputs": ["6\n"]}  # double the input
    out.update(dict.fromkeys(CODE_SOURCES, ("print(2 * int(input()))", "print(int(input()))", code_truth)))
    for name in TASKS:
        truth = generate_rows(name, "val", 1, seed=0)[0]["reward_model"]["ground_truth"]
        right = truth.split("|", 1)[1] if name == "countdown" else truth
        out[f"builtin/{name}"] = (right, "", truth)
    out["builtin/calc"] = (
        "<tool>calculator: 12*3</tool><result>36</result>36",
        "<tool>calculator: 12*3</tool>",
        "36",
    )
    out["builtin/shapes"] = (" 2\n", "3", "2")  # the count, stripped
    return out


@pytest.mark.parametrize("source", sorted(REWARD_FNS))
def test_every_entry_takes_verl_keywords_and_scores_right_above_wrong(source):
    right, wrong, truth = _examples()[source]
    fn = REWARD_FNS[source]
    if source in CODE_SOURCES and not sandbox_available():
        pytest.skip("the code sandbox needs bubblewrap")
    kwargs = {"data_source": source, "ground_truth": truth, "extra_info": {"index": 0}}
    score = lambda out: out["score"] if isinstance(out, dict) else out  # noqa: E731  (code returns a dict)
    assert score(fn(solution_str=right, **kwargs)) == 1.0
    assert score(fn(solution_str=wrong, **kwargs)) < 1.0
    assert score(default_compute_score(source, right, truth)) == 1.0


def test_table_covers_verl_names_and_every_builtin_task():
    from rlcore.data.sources import GENERATORS

    expected = {
        "openai/gsm8k",
        "countdown",
        *MATH_SOURCES,
        *DAPO_SOURCES,
        *SEARCH_R1_SOURCES,
        *prime_math.DATA_SOURCES,
        "hiyouga/geometry3k",
        *CODE_SOURCES,
        *(f"builtin/{t}" for t in GENERATORS),
    }
    assert set(REWARD_FNS) == expected


def test_unknown_data_source_fails_at_start_up_with_the_fix():
    with pytest.raises(
        UnknownDataSourceError, match=r"'my/data'.*--reward\.custom path/to/file\.py:compute_score"
    ):
        resolve_reward_fn(["openai/gsm8k", "my/data"])
    with pytest.raises(UnknownDataSourceError, match="'my/data'"):
        default_compute_score("my/data", "x", "y")
    assert resolve_reward_fn(["openai/gsm8k", "builtin/add", "math", "aime2024"]) is default_compute_score
    assert issubclass(UnknownDataSourceError, ValueError)
