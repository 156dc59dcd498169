"""train.py with `--rollout.agent`: agents written against the real openai client, served by the real gateway
(FastAPI on uvicorn) in front of the native engine, trained from the token ids the engine sampled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlcore.batch import Batch
from rlcore.gateway.agents import GatewayAgentEngine, outcome_of
from rlcore.models import load_policy
from rlcore.rewards.pool import RewardScorer
from rlcore.rewards.step import score_step
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import SMALL, ok, train

AGENTS = Path(__file__).with_name("agents.py")
RUN = ["grpo", *SMALL, "--trainer.steps", "2", "--rollout.max-tokens", "24"]


def agent(name: str) -> list[str]:
    return ["--rollout.agent", f"{AGENTS}:{name}"]


def test_a_two_turn_openai_agent_trains_through_the_gateway(tmp_path):
    ok(train(*RUN, *agent("two_turns"), out=tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["agent/turns_mean"] == 2.0 and r["agent/splits"] == 0.0 and r["agent/failures"] == 0.0
        assert r["agent/observation_tokens_mean"] > 0  # turn 2's user message: attended, not trained
        assert r["reward/agent_given_frac"] == 0.0  # the agent returned None: the reward function scored
        assert r["rollout/logprob_diff_max"] < 1e-4  # trained on what the engine sampled
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows and all("Just the answer." in row["response"] for row in rows)  # the 2nd turn's context


def test_the_exact_mode_gap_is_zero_at_every_step_through_the_endpoint(tmp_path):
    ok(train(*RUN, *agent("two_turns"), "--rollout.exact", out=tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert len(records) == 2 and all(r["agent/turns_mean"] == 2.0 for r in records)
    assert [r["rollout/logprob_diff_max"] for r in records] == [0.0, 0.0]


def test_an_edited_history_is_split_into_samples_and_counted(tmp_path):
    ok(train(*RUN, *agent("edits_history"), out=tmp_path))
    for r in read_metrics(tmp_path / "metrics.jsonl")[1:]:
        assert r["agent/splits"] == 16.0  # 4 prompts x 4 episodes, each split once
        assert r["agent/turns_mean"] == 1.0  # every sample is one call
        assert r["reward/agent_mean"] == 1.0 and r["reward/agent_given_frac"] == 1.0
        assert r["train/reward_mean"] == pytest.approx(1.0)  # both halves of an episode get its reward
        assert r["agent/edits"] == 1.0  # a returned dict's other numbers are logged
        assert r["rollout/logprob_diff_max"] < 1e-4


def test_an_agent_that_raises_is_a_failed_episode_and_the_run_goes_on(tmp_path):
    ok(train(*RUN, *agent("fails_sometimes"), "--reward.failure-score", "-1", out=tmp_path))
    for r in read_metrics(tmp_path / "metrics.jsonl")[1:]:
        assert 0 < r["agent/failures"] < 16
        expected = (r["agent/failures"] * -1.0 + (16 - r["agent/failures"]) * 0.5) / 16
        assert r["train/reward_mean"] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"{AGENTS}:not_async", "is a function; write it as `async def run(client, row)`"),
        (f"{AGENTS}:wrong_arguments", "cannot be called as wrong_arguments(client, row)"),
        (f"{AGENTS}:missing", "'missing' in agents.py is nothing"),
        ("no_such_file.py:run", "not found"),
        ("agent.py", "expected 'path/to/file.py:function'"),
    ],
)
def test_a_bad_agent_exits_2_in_one_line(spec, message, tmp_path):
    proc = train(*RUN, "--rollout.agent", spec, out=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert message in lines[-1] and "--rollout.agent" in lines[-1] and "Traceback" not in proc.stderr


def test_an_agent_with_the_agent_loop_flags_is_refused(tmp_path):
    proc = train(*RUN, *agent("two_turns"), "--rollout.max-turns", "3", out=tmp_path)
    assert proc.returncode == 2 and "an openai-client agent is its own multi-turn loop" in proc.stderr


def test_a_given_reward_replaces_the_reward_function_on_its_row():
    tokenizer = load_policy("builtin:tiny")[1]
    ids = tokenizer("cba", add_special_tokens=False)["input_ids"]
    batch = Batch.from_dict({
        "responses": torch.tensor([ids] * 3), "response_mask": torch.ones(3, len(ids)),
        "response_attention": torch.ones(3, len(ids)), "data_source": ["builtin/reverse"] * 3,
        "ground_truth": ["cba"] * 3, "extra_info": [{}] * 3,
    })  # fmt: skip
    scorer = RewardScorer(data_sources=["builtin/reverse"])
    ruled, _ = score_step(scorer, batch, tokenizer=tokenizer)
    out, metrics = score_step(scorer, batch, tokenizer=tokenizer, given=torch.tensor([0.25, math.nan, -1.0]))
    rule = float(ruled["token_scores"][1].sum())
    assert rule == 1.0  # "cba" reversed is right
    assert out["token_scores"].sum(-1).tolist() == [0.25, rule, -1.0]
    assert float(metrics["reward/agent_given_frac"]) == pytest.approx(2 / 3)


def test_what_an_agent_returns():
    assert outcome_of(None).reward is None and outcome_of(2).reward == 2.0
    assert outcome_of({"reward": 0.5, "steps": 3, "note": "x"}).extras == {"steps": 3.0}
    assert outcome_of({"reward": None}).reward is None
    for bad in ("1.0", True, {"score": 1.0}, {"reward": "high"}):
        with pytest.raises(ValueError):
            outcome_of(bad)


def test_the_engines_rows_are_the_recorded_calls_and_the_run_sets_the_sampling():
    """The rows an GatewayAgentEngine returns are its sessions' token ids; the agent's temperature is overridden."""
    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import Row
    from rlcore.pure.logprobs import token_logprobs

    model, tokenizer = load_policy("builtin:tiny")
    seen: list[float] = []

    async def hot(client, row):
        reply = await client.chat.completions.create(model="x", messages=row["prompt"], temperature=0.0,
                                                     max_tokens=50, logprobs=True)  # fmt: skip
        seen.append(len(reply.choices[0].logprobs.content))
        return None

    prompts = make_prompt_batch([Row(data_source="builtin/reverse", prompt=[{"role": "user", "content": t}])
                                 for t in ("abc", "hello")], tokenizer, uids=["a", "b"])  # fmt: skip
    inner, shapes = NativeEngine(model, tokenizer), []
    generate = inner.generate
    inner.generate = lambda p, s: shapes.append((len(p), s.n)) or generate(p, s)
    engine = GatewayAgentEngine(inner, tokenizer, hot, concurrency=6)
    try:
        out = engine.generate(prompts, SamplingParams(n=3, max_tokens=7, temperature=1.0))
    finally:
        engine.close()
    assert shapes == [(2, 3)]  # 6 episodes, one engine call, each prompt prefilled once for its 3 samples
    assert len(out) == 6 and out["uid"] == ["a"] * 3 + ["b"] * 3
    assert max(seen) <= 7  # max_tokens at most the run's
    mask = out["response_mask"]
    assert torch.equal(mask, out["response_attention"])  # one call each: no observation
    assert len({tuple(r[m != 0].tolist()) for r, m in zip(out["responses"][:3], mask[:3], strict=True)}) > 1  # sampled at T=1, not the agent's greedy
    ids = torch.cat([out["input_ids"], out["responses"]], dim=1)
    attention = torch.cat([out["attention_mask"], out["response_attention"]], dim=1)
    with torch.no_grad():
        logits = model(ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
    p = out["input_ids"].shape[1]
    rescored = token_logprobs(logits[:, p - 1 : -1].float(), out["responses"])
    assert ((rescored - out["rollout_logprobs"]).abs() * mask).max() < 1e-5


def test_the_two_tool_example_agent_learns_calc_through_the_endpoint(tmp_path):
    """examples/openai_agent.py (the README's agent) on builtin:tiny-calc: tool use and reward rise in 3 steps
    (measured: reward 0.25-0.32 at step 1, 0.81-0.83 at step 3; greedy validation 0.0 -> 1.0)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"
    args = ["grpo", *SMALL, "--data.train-files", "builtin:calc", "--data.val-files", "builtin:calc",
            "--rollout.max-tokens", "64", "--trainer.steps", "3", "--data.batch-size", "8",
            "--model.path", "builtin:tiny-calc", "--rollout.agent", f"{example}:run"]  # fmt: skip
    ok(train(*args, out=tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    first, last = records[1], records[3]
    assert last["train/reward_mean"] >= first["train/reward_mean"] + 0.2  # the calculator is learned
    assert last["agent/turns_mean"] > first["agent/turns_mean"]  # by calling it more
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records[1:])
    assert records[3]["val/reward_mean"] > records[0]["val/reward_mean"]
