"""train.py end to end with a user environment (`--rollout.env`) on the tiny model: the demonstration env
of examples/, and one that fails on some rows."""

from __future__ import annotations

import json
from pathlib import Path

from rlcore.data.tasks import generate_rows
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_run_report import read_jsonl
from tests.smoke.test_train import SMALL, ok, train

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "envs" / "reverse_retry.py") + ":ReverseRetry"
FLAKY = """
import sys
sys.path.insert(0, {root!r})
from examples.envs.reverse_retry import ReverseRetry


class Flaky(ReverseRetry):
    def step(self, action):
        if self.truth.startswith("9"):
            raise RuntimeError("level 9 is broken")
        return super().step(action)
"""


def rows(path: Path, split: str, n: int, source: str = "reverse_retry") -> str:
    path.write_text(
        "".join(json.dumps(r | {"data_source": source}) + "\n" for r in generate_rows("reverse", split, n))
    )
    return str(path)


def test_grpo_on_the_demo_env_scores_episodes_with_their_step_rewards(tmp_path):
    train_file, val_file = rows(tmp_path / "train.jsonl", "train", 64), rows(tmp_path / "val.jsonl", "val", 8)
    out = tmp_path / "run"
    ok(train("grpo", *SMALL, "--rollout.env", DEMO, "--rollout.max-turns", "2", "--rollout.max-tokens", "24",
             "--data.train-files", train_file, "--data.val-files", val_file, "--trainer.steps", "2",
             "--trainer.val-every", "2", "--log.samples", "16", out=out))  # fmt: skip
    records = read_metrics(out / "metrics.jsonl")
    step = records[1]
    assert 1.0 <= step["agent/turns_mean"] <= 2.0 and step["agent/env_errors"] == 0
    # no reward function for "reverse_retry": the score is the episode's summed step rewards
    assert step["reward/score_mean"] == step["agent/env_reward_mean"] == step["train/reward_mean"]
    samples = read_jsonl(out / "samples.jsonl")
    # the built-in template is prefix-stable: re-rendering an episode differs only where the policy sampled
    # a special token inside a turn (decoded as text, it is dropped from the assistant message)
    episodes = [r for r in samples if r["step"] == 1]
    assert len(episodes) == 16  # every episode of the step (4 prompts x 4)
    special = sum(any(_inner_special(t["text"]) for t in _model_turns(r)) for r in episodes)
    assert step["agent/retokenize_mismatch"] == special / len(episodes)
    assert "val/reward_mean" in records[-1]
    retried = [r for r in samples if "turns" in r]
    assert retried, "no episode needed the retry"
    for r in retried:
        observations = [t["text"] for t in r["turns"] if t["role"] == "observation"]
        assert observations == ["<|user|>wrong, again<|eos|><|assistant|>"], r["turns"]


def _model_turns(sample: dict) -> list[dict]:
    return (
        [t for t in sample["turns"] if t["role"] == "model"]
        if "turns" in sample
        else [{"text": sample["response"]}]
    )


def _inner_special(text: str) -> bool:
    """A special token (`<|...|>`) sampled inside a turn: anything but the turn's closing `<|eos|>`."""
    return "<|" in text.removesuffix("<|eos|>")


def test_a_failing_env_ends_its_episodes_and_the_run_goes_on(tmp_path):
    env_file = tmp_path / "flaky.py"
    env_file.write_text(FLAKY.format(root=str(ROOT)))
    train_file = rows(tmp_path / "train.jsonl", "train", 64)
    out = tmp_path / "run"
    ok(train("grpo", *SMALL, "--rollout.env", f"{env_file}:Flaky", "--data.train-files", train_file,
             "--data.val-files", train_file, "--reward.failure-score", "-1", "--trainer.steps", "2",
             "--trainer.val-every", "0", "--data.batch-size", "8", out=out))  # fmt: skip
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["agent/env_errors"] for r in records) > 0
    assert min(r["reward/score_mean"] for r in records) < 1.0
