"""rlcore.rewards.judge: the parsers and templates by hand, and a real (built-in) judge model behind a real
native engine: its verdicts are read, the unreadable ones counted and scored with the failure score, its
sampling seeded by the requests, and score_step mixing it with rule rewards per data source."""

from __future__ import annotations

import pytest
import torch

from rlcore.batch import Batch
from rlcore.models.policy import load_policy
from rlcore.rewards.judge import (
    DEFAULT_TEMPLATE,
    PARSERS,
    Judge,
    _seed,
    check_template,
    parse_boxed,
    parse_score,
    parse_yes_no,
    prompt_text,
)
from rlcore.rewards.pool import RewardScorer
from rlcore.rewards.step import score_step
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.engine import NativeEngine


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("score: 7", 7.0),
        ("Score = 0.5 then SCORE: -2", -2.0),
        ("scores 3", None),
        ("score: x", None),
        ("", None),
    ],
)
def test_score_parser_takes_the_last_score_line(text, expected):
    assert parse_score(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("so \\boxed{3} or \\boxed{ 4.5 }", 4.5), ("\\boxed{x}", None), ("boxed{1}", None)],
)
def test_boxed_parser_takes_the_last_box(text, expected):
    assert parse_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("Yes.", 1.0), ("no, yes", 0.0), ("Answer: NO", 0.0), ("nope, yesterday", None), ("maybe", None)],
)
def test_yes_no_parser_takes_the_first_yes_or_no_word(text, expected):
    assert parse_yes_no(text) == expected


def test_the_parser_table_names_the_three():
    assert sorted(PARSERS) == ["boxed", "score", "yes_no"]


def test_templates_need_prompt_and_response_and_only_known_fields():
    assert check_template(DEFAULT_TEMPLATE, "t") == DEFAULT_TEMPLATE
    assert check_template("{prompt} -> {response}; literal {{braces}}", "t")
    with pytest.raises(ValueError, match=r"^t: no \{response\} field"):
        check_template("grade {prompt}", "t")
    with pytest.raises(ValueError, match=r"^t: no \{prompt\} field"):
        check_template("grade {response} against {ground_truth}", "t")
    with pytest.raises(ValueError, match=r"^t: unknown field \{answer\}"):
        check_template("{prompt} {response} {answer}", "t")
    with pytest.raises(ValueError, match=r"^t: not a template"):
        check_template("{prompt} {response} {", "t")


def test_prompt_text_joins_the_messages():
    assert prompt_text("plain") == "plain"
    assert prompt_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]) == (
        "be brief\n\n2+2?"
    )


def test_the_call_seed_depends_on_the_run_seed_and_every_request():
    assert _seed(0, ["a", "b"]) == _seed(0, ["a", "b"])
    assert len({_seed(0, ["a", "b"]), _seed(1, ["a", "b"]), _seed(0, ["a", "c"]), _seed(0, ["ab"])}) == 4


@pytest.fixture(scope="module")
def tiny_judge():
    """builtin:tiny-reverse as the judge: given "reverse 12" + "3" it writes digits ("123", greedy), which
    no parser of the table reads."""
    model, tokenizer = load_policy("builtin:tiny-reverse")
    return NativeEngine(model, tokenizer), tokenizer


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_unreadable_verdicts_are_counted_and_score_the_failure_score(tiny_judge):
    engine, tokenizer = tiny_judge
    judge = Judge(engine=engine, tokenizer=tokenizer, template="reverse {prompt}{response}", failure_score=-1.0,
                  sampling=greedy())  # fmt: skip
    v = judge.judge(["12", "34", "5"], ["3", "", "99"], [None, None, None])
    assert all(text[:3].isdigit() for text in v.texts), v.texts  # it wrote, digits: no "score: N"
    assert v.failures == 3 and v.scores == [-1.0, -1.0, -1.0] and v.seconds > 0


def first_digit(text: str) -> float | None:
    """A user's parser hook: the verdict's first digit; it raises on a verdict starting with 8."""
    if text.startswith("8"):
        raise RuntimeError("a hook that fails")
    return float(text[0]) if text[:1].isdigit() else None


def test_a_hook_reads_verdicts_and_its_errors_count_as_unreadable(tiny_judge):
    engine, tokenizer = tiny_judge
    judge = Judge(engine=engine, tokenizer=tokenizer, template="reverse {prompt}{response}", parse=first_digit,
                  failure_score=-1.0, sampling=greedy())  # fmt: skip
    v = judge.judge(["12", "8", "5"], ["3", "9", "99"], [None] * 3)
    assert [t[0] for t in v.texts] == ["1", "8", "5"], v.texts
    assert v.scores == [1.0, -1.0, 5.0] and v.failures == 1  # "8...": the hook raised, counted


def test_sampled_verdicts_repeat_for_the_same_requests_and_seed(tiny_judge):
    engine, tokenizer = tiny_judge

    def judge(seed: int) -> list[str]:
        j = Judge(engine=engine, tokenizer=tokenizer, template="reverse {prompt}{response}", seed=seed,
                  sampling=SamplingParams(max_tokens=8, temperature=1.5))  # fmt: skip
        return j.judge(["1234"] * 6, ["5678"] * 6, [None] * 6).texts

    first = judge(0)
    assert len(set(first)) > 1  # sampled: the six verdicts differ
    assert judge(0) == first  # the engine's own generator has moved on: the call's seed decides
    assert judge(1) != first


def test_score_step_judges_its_sources_and_rules_the_others(tiny_judge):
    """Rows of `my/judged` go to the judge (no reward function exists for them); `builtin/reverse` rows
    keep their rule reward; the metrics and the verdicts (None on rule rows) say which was which."""
    engine, tokenizer = tiny_judge
    judge = Judge(engine=engine, tokenizer=tokenizer, template="reverse {prompt}{response}", parse=first_digit,
                  sampling=greedy(4), sources=frozenset({"my/judged"}))  # fmt: skip
    responses = [tokenizer.encode(t, add_special_tokens=False) for t in ("21", "99", "21")]
    batch = Batch.from_dict({
        "responses": torch.tensor(responses), "response_mask": torch.ones(3, 2), "response_attention": torch.ones(3, 2),
        "data_source": ["builtin/reverse", "my/judged", "my/judged"], "ground_truth": ["21", None, None],
        "extra_info": [{}, {}, {}], "raw_prompt": ["reverse 12", "5", "7"],
    })  # fmt: skip
    scorer = RewardScorer(data_sources=["builtin/reverse"])
    out, metrics = score_step(scorer, batch, tokenizer=tokenizer, judge=judge)
    verdicts = out["judge_verdicts"]
    assert verdicts[0] is None and verdicts[1].startswith("599") and verdicts[2].startswith("721")
    # rule: "21" is the reverse of 12 -> 1; the judge's first digits: 5 and 7
    assert out["token_scores"].sum(-1).tolist() == [1.0, 5.0, 7.0]
    assert metrics["reward/judge_mean"].item() == 6.0 and metrics["reward/judge_failures"].item() == 0
    assert metrics["reward/errors"].item() == 0
