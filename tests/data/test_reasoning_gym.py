"""reasoning-gym as a data source (rlcore.data.reasoning_gym): rows deterministic for a seed, scores equal to
the task's own `score_answer` on the same entries, bad task names and options refused in one line."""

from __future__ import annotations

import pytest

from rlcore.data.reasoning_gym import SYSTEM, compute_score, extract, generate_rows
from rlcore.data.rows import DataError
from rlcore.data.sources import check_sources_exist, read_sources
from rlcore.rewards.dispatch import default_compute_score

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is a test extra (pip install -e '.[test]')")

TASKS = ["chain_sum", "basic_arithmetic", "leg_counting", "word_sorting", "gcd", "spell_backward"]


def test_rows_are_deterministic_for_a_seed_and_differ_across_seeds_and_splits():
    source = "reasoning_gym:chain_sum*2+leg_counting?size=9&chain_sum.max_terms=3"
    a, b = (generate_rows(source, "train", 100, seed=5) for _ in range(2))
    assert a == b and len(a) == 9
    assert [r["data_source"] for r in a].count("reasoning_gym/chain_sum") == 6  # weights 2:1 of 9 rows
    assert generate_rows(source, "train", 100, seed=6) != a
    assert generate_rows(source, "val", 100, seed=5) != a  # the val split's default seed is seed + 1
    explicit = generate_rows(source + "&seed=5", "val", 100, seed=0)  # an explicit seed is used as given
    assert [(r["prompt"], r["reward_model"]) for r in explicit] == [
        (r["prompt"], r["reward_model"]) for r in a
    ]
    assert a[0]["prompt"][0] == {"role": "system", "content": SYSTEM["tag"]}
    assert {r["extra_info"]["config"]["max_terms"] for r in a if r["extra_info"]["task"] == "chain_sum"} == {
        3
    }


@pytest.mark.parametrize("task", TASKS)
def test_scores_equal_reasoning_gym_score_answer_on_the_same_entries(task):
    rows = generate_rows(f"reasoning_gym:{task}?size=6&seed=3", "train", 6, seed=0)
    dataset = rg.create_dataset(task, size=6, seed=3)
    for i, row in enumerate(rows):
        entry = dataset[i]
        assert row["prompt"][1]["content"] == entry["question"]
        assert row["reward_model"]["ground_truth"] == str(entry["answer"])
        for answer in (str(entry["answer"]), "0", "not it"):
            response = f"Let me think.\n<answer>{answer}</answer>"
            ours = default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"],
                                         row["extra_info"])  # fmt: skip
            assert ours == float(dataset.score_answer(answer=answer, entry=entry)), (task, i, answer)
        # no tag: no answer, as reasoning-gym's extract_answer gives None
        assert compute_score(row["data_source"], str(entry["answer"]), None, row["extra_info"]) == float(
            dataset.score_answer(answer=None, entry=entry)
        )


def test_answer_extraction_rules():
    assert extract("a <answer> 1 </answer> b <answer>42</answer>", "tag") == "42"
    assert extract("no tags", "tag") is None
    assert extract("so \\boxed{7} and \\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    assert extract("  12 \n", "raw") == "12"
    # last: the last number as written; a minus after a digit is an operator; thousands commas dropped
    for response, answer in [("1 + 5 = 6", "6"), ("5-3", "3"), ("so x = -7.", "-7"), ("about 1,234.5 m", "1234.5"),
                             ("1,2", "2"), ("3.14 then 2", "2"), ("none", None)]:  # fmt: skip
        assert extract(response, "last") == answer, response
    row = generate_rows("reasoning_gym:chain_sum?size=1&seed=0&answer=last", "train", 1, seed=0)[0]
    assert row["prompt"][0]["content"] == SYSTEM["last"]
    truth = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], f"The sum is {truth}.", truth, row["extra_info"]) == 1.0
    assert (
        compute_score(row["data_source"], f"{truth} plus 1 is {int(truth) + 1}", truth, row["extra_info"])
        == 0.0
    )
    row = generate_rows("reasoning_gym:chain_sum?size=1&seed=0&answer=boxed", "train", 1, seed=0)[0]
    assert row["prompt"][0]["content"] == SYSTEM["boxed"]
    truth = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], f"\\boxed{{{truth}}}", truth, row["extra_info"]) == 1.0


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("reasoning_gym:chain_sums", "reasoning-gym has no task 'chain_sums' (did you mean chain_sum"),
        ("reasoning_gym:chain_sum?bogus=1", "chain_sum has no option 'bogus'; its options are ["),
        ("reasoning_gym:chain_sum?max_terms=x", "chain_sum refuses {'max_terms': 'x'}"),
        ("reasoning_gym:chain_sum+gcd?max_terms=2", "in a mixture write <task>.<field>=value"),
        ("reasoning_gym:chain_sum*0", "weight of chain_sum must be > 0"),
        ("reasoning_gym:chain_sum?answer=xml", "answer='xml'; choose one of ['boxed', 'last', 'raw', 'tag']"),
        ("reasoning_gym:chain_sum?size=0", "size=0 must be an integer >= 1"),
    ],
)
def test_bad_tasks_and_options_are_one_line(source, says):
    problem = check_sources_exist([source], "--data.train-files")
    assert problem is not None and problem.startswith(f"--data.train-files {source}: ") and says in problem
    assert "\n" not in problem
    with pytest.raises(DataError, match="reasoning"):
        read_sources(["reasoning_gym:nope"], split="train", builtin_size=4, seed=0)


def test_the_answer_format_flag_applies_where_the_source_names_none():
    """--data.answer-format reaches the rows through read_sources; a source's own answer= wins."""
    plain, own = "reasoning_gym:chain_sum?size=2", "reasoning_gym:chain_sum?size=2&answer=raw"
    rows = read_sources([plain, own], split="train", builtin_size=2, seed=0, answer_format="boxed")
    assert [r.extra_info["answer_format"] for r in rows] == ["boxed", "boxed", "raw", "raw"]
    assert rows[0].prompt[0]["content"] == SYSTEM["boxed"] and rows[2].prompt[0]["content"] == SYSTEM["raw"]
