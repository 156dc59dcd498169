"""Built-in tasks: determinism, disjoint splits, and each reward on right / wrong / ill-formed answers."""

from __future__ import annotations

import pytest

from rlcore.data.tasks import TASKS, compute_score, generate_rows, split_of


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_are_deterministic_and_splits_disjoint(task):
    train = generate_rows(task, "train", 200, seed=3)
    assert train == generate_rows(task, "train", 200, seed=3)
    assert train != generate_rows(task, "train", 200, seed=4)
    val = generate_rows(task, "val", 50, seed=3)
    train_prompts = {r["prompt"][0]["content"] for r in train}
    val_prompts = {r["prompt"][0]["content"] for r in val}
    assert not train_prompts & val_prompts
    assert all(split_of(p) == "val" for p in val_prompts)
    row = train[0]
    assert row["data_source"] == f"builtin/{task}"
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_ground_truth_scores_one(task):
    for row in generate_rows(task, "val", 30, seed=0):
        truth = row["reward_model"]["ground_truth"]
        answer = truth.split("|", 1)[1] if task == "countdown" else truth
        assert compute_score(row["data_source"], f" {answer}\n", truth) == 1.0


def test_reverse_and_sort_give_positional_partial_credit():
    assert compute_score("builtin/reverse", "31204", "31204") == 1.0
    assert compute_score("builtin/reverse", "31299", "31204") == 3 / 5  # 3 of 5 positions right
    assert compute_score("builtin/reverse", "312", "31204") == 3 / 5  # short answers lose the rest
    assert compute_score("builtin/sort", "0123456", "01234") == 5 / 7  # over the longer string
    assert compute_score("builtin/sort", "", "01234") == 0.0


def test_add_is_exact():
    assert compute_score("builtin/add", "82", "82") == 1.0
    assert compute_score("builtin/add", "83", "82") == 0.0
    assert compute_score("builtin/add", "eighty-two", "82") == 0.0


def test_countdown_checks_numbers_and_target():
    truth = "29|(3*7)+8"
    assert compute_score("builtin/countdown", "8+7*3", truth) == 1.0  # any order, same numbers
    assert compute_score("builtin/countdown", "(3+7)+8", truth) == 0.1  # well formed, wrong value
    assert compute_score("builtin/countdown", "3*7+8+0", truth) == 0.1  # an extra number
    assert compute_score("builtin/countdown", "3*7+8*1", truth) == 0.1
    assert compute_score("builtin/countdown", "__import__('os')", truth) == 0.0  # never evaluated
    assert compute_score("builtin/countdown", "8/(3-3)+7", truth) == 0.0  # division by zero
    assert compute_score("builtin/countdown", "((((", truth) == 0.0


def test_unknown_task_and_source_are_clear_errors():
    with pytest.raises(ValueError, match="unknown built-in task 'nope'"):
        generate_rows("nope", "train", 1)
    with pytest.raises(ValueError, match="no built-in reward for data_source 'gsm8k'"):
        compute_score("gsm8k", "1", "1")


def test_the_shipped_warm_start_is_wrong_greedily_and_right_sometimes():
    """The default starting policy (builtin:tiny-reverse) scores <= 0.3 greedily on the default task,
    while sampling finds the right answer often enough for GRPO to learn from (see warmstart.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from warmstart import evaluate

    from rlcore.data.tasks import DEFAULT_TASK
    from rlcore.models import load_policy

    model, tokenizer = load_policy("builtin:tiny-reverse")
    val = generate_rows(DEFAULT_TASK, "val", 64, seed=0)
    assert evaluate(model, tokenizer, val, greedy=True) <= 0.3
    assert evaluate(model, tokenizer, val, greedy=False, seed=0) >= 0.3  # partial credit + ~25% right


def test_shapes_rows_draw_what_they_ask_about_and_split_disjointly():
    import io

    from PIL import Image

    from rlcore.data import shapes

    # a red circle in cell 0 and a blue square in cell 4 (the centre): colours at the cell centres
    image = Image.open(io.BytesIO(shapes.draw([(0, "red", "circle", 10, 0, 0), (4, "blue", "square", 10, 0, 0)])))
    assert image.size == (48, 48)
    assert image.getpixel((8, 8)) == shapes.COLORS["red"] and image.getpixel((24, 24)) == shapes.COLORS["blue"]
    assert image.getpixel((40, 40)) == (255, 255, 255) and image.getpixel((0, 0)) == (255, 255, 255)  # circle
    train, val = shapes.generate_rows("train", 300), shapes.generate_rows("val", 40)
    assert train == shapes.generate_rows("train", 300)  # deterministic
    problem = lambda r: (r["images"][0]["bytes"], r["prompt"][0]["content"])  # noqa: E731
    assert not {problem(r) for r in train} & {problem(r) for r in val}
    for row in train[:50]:  # the truth is the count of the asked colour and kind in the drawn cells
        question = row["prompt"][0]["content"].removeprefix("<image>how many ").removesuffix("s?")
        color, kind = question.split()
        assert color in shapes.COLORS and kind in shapes.KINDS
        assert 0 <= int(row["reward_model"]["ground_truth"]) <= row["extra_info"]["shapes"] <= 5
    assert shapes.compute_score("builtin/shapes", " 2\n", "2") == 1.0
    assert shapes.compute_score("builtin/shapes", "12", "2") == 0.0
