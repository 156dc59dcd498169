"""score_step: decoding, last-token placement, DAPO's overlong penalty, metrics and extras."""

from __future__ import annotations

import pytest
import torch

from rlcore.batch import Batch
from rlcore.models import build_char_tokenizer
from rlcore.rewards import OverlongPenalty, RewardScorer, last_token_scores, overlong_penalty, score_step

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_batch(tokenizer, responses: list[str], *, sources, truths, width: int = 12, extra=None) -> Batch:
    """Right-padded responses, each followed by EOS (generated, so in the mask) when it has any token."""
    rows, mask = (
        torch.full((len(responses), width), PAD),
        torch.zeros(len(responses), width, dtype=torch.long),
    )
    for i, text in enumerate(responses):
        tokens = ids(tokenizer, text) + ([EOS] if text else [])
        rows[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = 1
    return Batch.from_dict(
        {
            "responses": rows,
            "response_mask": mask,
            "response_attention": mask,
            "data_source": list(sources),
            "ground_truth": list(truths),
            "extra_info": extra or [{} for _ in responses],
        }
    )


# -- last-token placement --------------------------------------------------------------------------


def test_last_token_scores_by_hand():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    scores = torch.tensor([0.5, -1.0, 7.0, 2.0], dtype=torch.float64)
    expected = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.0],  # last response token at 1
            [0.0, 0.0, 0.0, -1.0],  # a full row: the last column
            [0.0, 0.0, 0.0, 0.0],  # no response token: the score goes nowhere
            [0.0, 0.0, 2.0, 0.0],  # a hole in the mask (multi-turn): the last 1, not sum - 1
        ]
    )
    got = last_token_scores(scores, mask)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(last_token_scores(scores, mask.bool()), expected)


def test_last_token_scores_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        b, t = torch.randint(1, 6, (2,), generator=gen).tolist()
        mask = torch.rand(b, t, generator=gen) < 0.5
        scores = torch.randn(b, generator=gen)
        expected = torch.zeros(b, t)
        for i in range(b):  # per row: put the score on the largest index whose mask is 1
            ones = [j for j in range(t) if mask[i, j]]
            if ones:
                expected[i, ones[-1]] = scores[i]
        assert torch.equal(last_token_scores(scores, mask), expected)


# -- overlong penalty (DAPO eq. 13; verl DAPORewardManager) -----------------------------------------


def test_overlong_penalty_by_hand_at_each_branch():
    l_max, buffer, factor = 10, 4, 2.0  # the buffer is (6, 10]
    lengths = torch.tensor([0, 5, 6, 7, 8, 10, 12])
    expected = torch.tensor(
        [
            0.0,  # far below L_max - buffer
            0.0,  # below
            0.0,  # exactly L_max - buffer: still no penalty
            -(7 - 6) / 4 * 2.0,  # inside the buffer: linear
            -(8 - 6) / 4 * 2.0,
            -2.0,  # L = L_max: -factor
            -(12 - 6) / 4 * 2.0,  # past L_max verl keeps the line (no clamp at -factor)
        ],
        dtype=torch.float64,
    )
    got = overlong_penalty(lengths, max_length=l_max, buffer_length=buffer, penalty_factor=factor)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_overlong_penalty_matches_verl_per_sample():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        l_max = int(torch.randint(8, 64, (1,), generator=gen))
        buffer = int(torch.randint(1, l_max + 1, (1,), generator=gen))
        factor = float(torch.rand(1, generator=gen)) * 3
        lengths = torch.randint(0, l_max + 1, (16,), generator=gen)
        expected = []
        for length in lengths.tolist():  # verl: min(-(L - (L_max - buffer)) / buffer * factor, 0)
            exceed = length - (l_max - buffer)
            expected.append(min(-exceed / buffer * factor, 0))
        got = overlong_penalty(lengths, max_length=l_max, buffer_length=buffer, penalty_factor=factor)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_overlong_config_is_checked():
    with pytest.raises(ValueError, match="overlong-buffer-length=0"):
        OverlongPenalty(max_length=8, buffer_length=0)
    with pytest.raises(ValueError, match="overlong-buffer-length=9"):
        OverlongPenalty(max_length=8, buffer_length=9)


# -- score_step ------------------------------------------------------------------------------------


def test_score_step_places_rule_scores_and_reports_metrics(tokenizer):
    batch = make_batch(
        tokenizer,
        ["#### 72", "#### 7", "", "82"],
        sources=["openai/gsm8k", "openai/gsm8k", "openai/gsm8k", "builtin/add"],
        truths=["72", "72", "72", "82"],
    )
    with RewardScorer(data_sources=set(batch["data_source"])) as scorer:
        out, metrics = score_step(scorer, batch, tokenizer=tokenizer)
    expected = torch.zeros(4, 12)
    expected[0, 7] = 1.0  # "#### 72" is 7 tokens + EOS: the EOS at index 7 is the last response token
    expected[1, 6] = 0.0  # wrong answer: 0 (format score 0)
    expected[3, 2] = 1.0  # "82" + EOS
    assert torch.equal(out["token_scores"], expected)
    assert out["reward_extras"] == [{}, {}, {}, {}]
    assert set(metrics) == {"reward/score_mean", "reward/errors", "reward/timeouts"}
    assert metrics["reward/score_mean"] == pytest.approx((1 + 0 + 0 + 1) / 4, abs=1e-7)
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0
    assert all(v.dim() == 0 for v in metrics.values())
    assert "token_scores" not in batch  # the input batch is unchanged


def test_score_step_decodes_without_special_tokens_and_logs_extras(tokenizer, tmp_path):
    path = tmp_path / "echo.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert '<|' not in solution_str, solution_str\n"
        "    return {'score': float(solution_str == ground_truth), 'chars': len(solution_str), 'row': extra_info['row']}\n"
    )
    batch = make_batch(
        tokenizer, ["abc", "hello"], sources=["a", "b"], truths=["abc", "x"], extra=[{"row": 0}, {"row": 1}]
    )
    with RewardScorer(f"{path}:compute_score") as scorer:
        out, metrics = score_step(scorer, batch, tokenizer=tokenizer)
    assert out["reward_extras"] == [{"chars": 3.0, "row": 0.0}, {"chars": 5.0, "row": 1.0}]
    assert metrics["reward/chars"] == pytest.approx((3 + 5) / 2) and metrics["reward/row"] == pytest.approx(
        0.5
    )
    assert out["token_scores"][0, 3] == 1.0 and out["token_scores"].sum() == 1.0  # EOS after "abc"
    assert metrics["reward/errors"] == 0  # the assert on special tokens held


def test_score_step_adds_the_overlong_penalty(tokenizer):
    batch = make_batch(
        tokenizer, ["1", "2345", "678901234"], sources=["builtin/add"] * 3, truths=["1", "2345", "0"]
    )
    overlong = OverlongPenalty(max_length=12, buffer_length=6, penalty_factor=1.0)  # buffer (6, 12]
    with RewardScorer(data_sources={"builtin/add"}) as scorer:
        out, metrics = score_step(scorer, batch, tokenizer=tokenizer, overlong=overlong)
    # lengths with EOS: 2, 5, 10; penalties 0, 0, -(10 - 6) / 6; rule scores 1, 1, 0
    p = -(10 - 6) / 6
    assert out["token_scores"][0, 1] == 1.0 and out["token_scores"][1, 4] == 1.0
    assert out["token_scores"][2, 9].item() == pytest.approx(0.0 + p, abs=1e-7)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(p / 3, abs=1e-7)
    assert metrics["reward/overlong_frac"] == pytest.approx(1 / 3, abs=1e-7)
    assert metrics["reward/score_mean"] == pytest.approx((1 + 1 + p) / 3, abs=1e-7)


def test_score_step_failures_show_in_metrics(tokenizer, tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'bad':\n"
        "        raise KeyError(ground_truth)\n"
        "    return 1.0\n"
    )
    batch = make_batch(tokenizer, ["bad", "ok", "ok", "ok"], sources=["s"] * 4, truths=["t"] * 4)
    with RewardScorer(f"{path}:compute_score", failure_score=-0.5) as scorer:
        out, metrics = score_step(scorer, batch, tokenizer=tokenizer)
    assert metrics["reward/errors"] == 1 and metrics["reward/timeouts"] == 0
    assert out["token_scores"][0, 3] == -0.5  # "bad" + EOS: failure_score on the last token
    assert metrics["reward/score_mean"] == pytest.approx((-0.5 + 1 + 1 + 1) / 4)


def test_score_step_needs_something_to_score(tokenizer):
    batch = make_batch(tokenizer, ["1"], sources=["builtin/add"], truths=["1"])
    with pytest.raises(ValueError, match="needs a rule scorer, a reward model, a judge, or some of them"):
        score_step(None, batch, tokenizer=tokenizer)


def test_multi_turn_responses_are_scored_with_their_tool_results(tokenizer):
    """The calc answer is right only with the `<result>` observation in the text (attended, mask 0);
    the score lands on the last model token."""
    call, obs, answer = "<tool>calculator: 12*3</tool>", "<result>36</result>", "36"
    tokens = ids(tokenizer, call) + ids(tokenizer, obs) + ids(tokenizer, answer) + [EOS]
    width = len(tokens) + 2
    responses = torch.full((1, width), PAD)
    responses[0, : len(tokens)] = torch.tensor(tokens)
    attention = torch.zeros(1, width)
    attention[0, : len(tokens)] = 1
    mask = attention.clone()
    first_obs = len(ids(tokenizer, call))
    mask[0, first_obs : first_obs + len(ids(tokenizer, obs))] = 0  # the tool result is not trained on
    batch = Batch.from_dict({"responses": responses, "response_mask": mask, "response_attention": attention,
                             "data_source": ["builtin/calc"], "ground_truth": ["36"], "extra_info": [{}]})  # fmt: skip
    with RewardScorer(data_sources={"builtin/calc"}) as scorer:
        out, _ = score_step(scorer, batch, tokenizer=tokenizer)
    assert out["token_scores"][0, len(tokens) - 1] == 1.0 and out["token_scores"].sum() == 1.0
