"""train.py with `--rollout.agent verifiers:<module>`: `verifiers` environments (tests/gateway/vf_envs/)
rolled out through the gateway in front of the native engine, rewarded by their rubrics."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlcore.trainer.logger import read_metrics
from tests.gateway.test_agent_train import RUN
from tests.gateway.test_agent_train import test_a_bad_agent_exits_2_in_one_line as exits_2_in_one_line
from tests.smoke.test_train import ok, train

pytest.importorskip("verifiers")

ENVS = Path(__file__).with_name("vf_envs")


def rubric_scored(out: Path) -> None:
    """Every sample's score is the rubric's (1.0 for the exact answer, else 0.0), not the built-in task's
    partial credit nor a constant."""
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        answer = s["response"].removesuffix("<|eos|>").strip()
        assert s["score"] == float(answer == s["ground_truth"]), s


def test_a_single_turn_environment_trains_on_its_rubrics_rewards(tmp_path):
    ok(train(*RUN, "--data.train-files", "builtin:reverse", "--rollout.agent",
             "verifiers:tests.gateway.vf_envs.reverse_env", out=tmp_path))  # fmt: skip
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["reward/agent_given_frac"] == 1.0 and r["agent/failures"] == 0.0  # the rubric scored all
        assert r["agent/exact"] == pytest.approx(r["reward/agent_mean"])  # its reward function, logged
        assert r["agent/digits_in_place"] >= r["agent/exact"] and r["agent/num_turns"] == 1.0  # its metrics
        assert r["rollout/logprob_diff_max"] < 1e-4  # trained on what the engine sampled
    rubric_scored(tmp_path)


def test_a_multi_turn_tool_environment_trains(tmp_path):
    ok(train(*RUN, "--data.train-files", "builtin:add", "--rollout.agent",
             f"verifiers:{ENVS / 'add_tool_env.py'}", out=tmp_path))  # fmt: skip
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["reward/agent_given_frac"] == 1.0 and r["agent/failures"] == 0.0
        assert r["agent/turns_mean"] >= 1 and r["agent/num_turns"] >= 1
        assert "agent/add_calls" in r and "agent/total_tool_calls" in r  # the ToolEnv's own rubric
        assert r["rollout/logprob_diff_max"] < 1e-4
    rubric_scored(tmp_path)


def test_a_tool_call_runs_the_environments_tool_and_its_rubric_scores_the_answer():
    """A scripted policy calls `add` (hermes), reads the tool's answer and says 5: a two-turn ToolEnv
    rollout through the gateway, rewarded 1.0 by the env's rubric."""
    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import Row
    from rlcore.gateway.agents import GIVEN, GatewayAgentEngine
    from rlcore.gateway.verifiers_env import verifiers_agent
    from rlcore.rollout import NativeEngine, SamplingParams
    from tests.rollout.chatml import build_chatml_tokenizer
    from tests.rollout.fakes import ScriptedLMCache
    from tests.rollout.test_env_agent import chat_script

    tok = build_chatml_tokenizer()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    model = ScriptedLMCache(chat_script(tok, [call, "5"]), len(tok))
    prompts = make_prompt_batch([Row(data_source="builtin/add", prompt=[{"role": "user", "content": "2+3"}],
                                     ground_truth="5")], tok, uids=["a"])  # fmt: skip
    engine = GatewayAgentEngine(NativeEngine(model, tok), tok, verifiers_agent(str(ENVS / "add_tool_env.py")))
    try:
        out = engine.generate(prompts, SamplingParams(n=2, max_tokens=64))
    finally:
        engine.close()
    # this template drops an assistant turn's tool_calls when it re-renders the history: each episode
    # splits into its two calls (agent_split), both with the episode's reward
    assert out["agent_split"].tolist() == [False, True] * 2 and not out["agent_failed"].any()
    assert out[GIVEN].tolist() == [1.0] * 4
    metrics = {"correct": 1.0, "num_turns": 2.0, "total_tool_calls": 1.0, "add_calls": 1.0}
    assert out["agent_metrics"] == [metrics] * 4  # the rubric's reward function and the ToolEnv's metrics
    second = tok.decode(out["input_ids"][1][out["attention_mask"][1] != 0])
    assert "Use the add tool." in second and "<tool_response>\n5\n</tool_response>" in second  # add(2, 3) ran


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("verifiers:no_such_module", "no module 'no_such_module'; install the environment"),
        (f"verifiers:{ENVS / '__init__.py'}", "the module has no load_environment()"),
        ("verifiers:no_such_env.py", "not found"),
    ],
)
def test_a_bad_verifiers_spec_exits_2_in_one_line(spec, message, tmp_path):
    exits_2_in_one_line(spec, message, tmp_path)


def test_without_verifiers_installed_the_spec_names_the_extra(monkeypatch):
    from rlcore.gateway.agents import load_agent
    from rlcore.rollout.agent.env import EnvSpecError

    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "verifiers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(EnvSpecError, match=r"--rollout.agent 'verifiers:my_env': verifiers is not installed; "
                                           r"pip install -e '.\[verifiers\]'"):  # fmt: skip
        load_agent("verifiers:my_env")
