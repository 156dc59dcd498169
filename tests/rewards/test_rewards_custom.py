"""Custom reward files: a verl reward file works unchanged, and every mistake is one clear line."""

from __future__ import annotations

import textwrap

import pytest

from rlcore.rewards import RewardScorer, RewardSpecError, load_custom, resolve_reward_fn

VERL_STYLE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward file as verl users write them: module-level imports, helpers, keyword call."""
    found = re.findall(r"answer: (\\w+)", solution_str)
    return 1.0 if found and found[-1] == ground_truth else 0.0

def with_extras(data_source, solution_str, ground_truth, extra_info=None):
    hit = solution_str.strip() == ground_truth
    return {"score": float(hit), "acc": hit, "length": len(solution_str), "pred": solution_str}

def _helper():
    pass

NOT_A_FUNCTION = 3

def wrong_signature(response, answer):
    return 0.0
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    return path


def test_verl_style_file_loads_and_scores(reward_file):
    fn = load_custom(f"{reward_file}:compute_score")
    kwargs = {"data_source": "anything", "ground_truth": "cat", "extra_info": None}
    assert fn(solution_str="the answer: cat", **kwargs) == 1.0
    assert fn(solution_str="the answer: dog", **kwargs) == 0.0
    assert load_custom(f"{reward_file}:compute_score") is fn  # the module is imported once
    assert resolve_reward_fn(["unknown/source"], custom=f"{reward_file}:compute_score") is fn


def test_relative_path_resolves_from_the_working_directory(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    assert (
        load_custom("my_reward.py:compute_score")(
            data_source="d", solution_str="answer: x", ground_truth="x", extra_info=None
        )
        == 1.0
    )


def test_dict_reward_extras_are_numeric_only(reward_file):
    with RewardScorer(f"{reward_file}:with_extras", num_workers=0) as scorer:
        got = scorer.score(["d", "d"], ["cat", "a dog"], ["cat", "cat"], [None, None])
    assert got.scores == (1.0, 0.0)
    assert got.extras == ({"acc": 1.0, "length": 3.0}, {"acc": 0.0, "length": 5.0})  # 'pred' (a str) dropped
    assert got.extra_means() == {"acc": (1.0 + 0.0) / 2, "length": (3 + 5) / 2}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{file}", r"expected 'path/to/file\.py:function_name'"),
        ("{file}:", r"expected 'path/to/file\.py:function_name'"),
        (":compute_score", r"expected 'path/to/file\.py:function_name'"),
        ("{dir}/missing.py:compute_score", r"file .*missing\.py not found"),
        (
            "{file}:nope",
            r"has no function 'nope' \(functions defined there: compute_score, with_extras, wrong_signature\)",
        ),
        ("{file}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' in my_reward\.py is a int, not a function"),
        (
            "{file}:wrong_signature",
            r"cannot be called as fn\(data_source=, solution_str=, ground_truth=, extra_info=\)",
        ),
    ],
    ids=[
        "no-colon",
        "no-function",
        "no-path",
        "missing-file",
        "missing-function",
        "not-callable",
        "signature",
    ],
)
def test_bad_specs_are_one_line_value_errors(reward_file, spec, message):
    spec = spec.format(file=reward_file, dir=reward_file.parent)
    with pytest.raises(RewardSpecError, match=message) as info:
        load_custom(spec)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and "--reward.custom" in str(info.value)


def test_file_that_fails_to_import_is_one_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(RewardSpecError, match=r"importing .*broken\.py failed: SyntaxError") as info:
        load_custom(f"{broken}:compute_score")
    assert "\n" not in str(info.value)
    raising = tmp_path / "raising.py"
    raising.write_text(
        textwrap.dedent("""
        raise RuntimeError("needs an API key")
    """)
    )
    with pytest.raises(RewardSpecError, match="RuntimeError: needs an API key"):
        load_custom(f"{raising}:compute_score")
