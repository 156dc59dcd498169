"""A model's positions against the prompts actually kept (issue 40): a model with fewer positions than
--data.max-prompt-length + --rollout.max-tokens trains when every kept prompt fits beside the response
budget; a prompt that passes the length filter but not the model is refused before any weights load,
with its length and both fixes, on every rank alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlcore.models.policy import load_policy, load_tokenizer
from rlcore.trainer.logger import read_metrics
from tests.frames import our_frames
from tests.smoke.test_torchrun import torchrun
from tests.smoke.test_train import train

POSITIONS = 128
STEPS = ["--trainer.steps", "2", "--trainer.val-every", "0", "--data.batch-size", "4", "--rollout.n", "4",
         "--rollout.max-tokens", "12", "--log.no-progress"]  # fmt: skip
"""A directory is a pretrained model, whose default response budget is 512 (rlcore.config.defaults): these
tests keep the built-in models' 12."""


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """The built-in reverse model saved as a Hugging Face directory that declares 128 positions."""
    path = tmp_path_factory.mktemp("short-model")
    model, tokenizer = load_policy("builtin:tiny-reverse")
    model.config.max_position_embeddings = POSITIONS
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _rows(path: Path, contents: list[str]) -> tuple[Path, int]:
    """A jsonl file of reverse-task rows with these user messages; (its path, the longest prompt's tokens
    with the chat template, counted here by the tokenizer itself)."""
    rows = [{"data_source": "builtin/reverse", "prompt": [{"role": "user", "content": c}],
             "reward_model": {"ground_truth": c[::-1]}} for c in contents]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = load_tokenizer("builtin:tiny-reverse")
    lengths = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False))
               for r in rows]  # fmt: skip
    return path, max(lengths)


def test_a_128_position_model_with_short_prompts_trains_at_the_default_prompt_length(short_model, tmp_path):
    """--data.max-prompt-length 512 (the default) and --rollout.max-tokens 12 sum past 128: no matter,
    the longest built-in prompt (18 tokens) plus 12 fits (before the fix: refused at start)."""
    proc = train("grpo", *STEPS, "--model.path", str(short_model), out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_prompt_that_passes_the_filter_but_not_the_model_is_refused_naming_its_length(
    short_model, tmp_path
):
    files, longest = _rows(tmp_path / "rows.jsonl", ["abc", "abcd", "x" * 120, "y" * 115])
    assert 128 - 12 < longest <= 512  # kept by the filter, too long for the model beside the budget
    args = ["grpo", *STEPS, "--model.path", str(short_model), "--data.train-files", str(files)]
    proc = train(*args, out=tmp_path / "run")
    assert proc.returncode == 2 and not our_frames(proc.stderr), proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"error: --model.path {short_model} has 128 positions (max_position_embeddings), too few for 2 prompts "
        f"(2 of --data.train-files) beside --rollout.max-tokens 12: the longest is {longest} tokens, "
        f"{longest} + 12 = {longest + 12}; use --data.max-prompt-length 116 (drops them, counted in the data: "
        f"line) or --rollout.max-tokens {128 - longest}"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before any weights loaded
    # either fix trains: the lower filter drops the two (counted), fewer tokens leave room for them
    proc = train(*args, "--data.max-prompt-length", "116", out=tmp_path / "dropped")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 dropped as too long (max prompt length 116)" in proc.stdout
    assert read_metrics(tmp_path / "dropped" / "metrics.jsonl")[0]["data/train_dropped"] == 2
    proc = train(*args, "--rollout.max-tokens", str(128 - longest), out=tmp_path / "fewer")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_rank_refuses_alike(short_model, tmp_path):
    files, longest = _rows(tmp_path / "rows.jsonl", ["abc", "abcd", "x" * 120])
    proc = torchrun(*STEPS, "--model.path", str(short_model), "--data.train-files", str(files),
                    "--out-dir", str(tmp_path / "run"), timeout=120)  # fmt: skip
    assert proc.returncode != 0
    said = re.findall(
        r"too few for 1 prompt \(1 of --data.train-files\) beside --rollout.max-tokens 12: the "
        r"longest is (\d+) tokens",
        proc.stderr,
    )  # fmt: skip  (two ranks' lines may interleave)
    assert said == [str(longest)] * 2, proc.stderr[-3000:]
    assert not our_frames(proc.stderr), proc.stderr[-3000:]
