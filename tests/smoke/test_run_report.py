"""What a user sees during a run (issue 18): the data report, samples.jsonl, the progress line."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.rewards.dispatch import default_compute_score
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ROOT, SMALL, ok, train


def gsm8k_rows(n_short: int, n_long: int) -> list[dict]:
    """verl's GSM8K row format; a long question is ~400 characters (tokens, with the char tokenizer)."""

    def row(i: int, question: str) -> dict:
        return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
                "extra_info": {"index": i}}  # fmt: skip

    short = [row(i, f"What is {i} + {i}?") for i in range(n_short)]
    return short + [row(100 + i, "A farmer counts sheep. " * 18) for i in range(n_long)]


def test_the_data_report_counts_the_prompts_dropped_for_length(tmp_path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(9, 3)), path)
    proc = train("grpo", *SMALL, "--trainer.steps", "1", "--trainer.val-every", "0", "--data.train-files",
                 str(path), "--data.val-files", str(path), "--data.max-prompt-length", "200", out=tmp_path / "run")  # fmt: skip
    ok(proc)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("data:")]
    assert len(lines) == 2 and all(
        f"{path}: 12 rows, 3 dropped as too long (max prompt length 200), longest kept" in x for x in lines
    ), lines
    assert lines[0].startswith("data: --data.train-files ") and lines[1].startswith("data: --data.val-files ")
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["data/train_dropped"] == 3.0 and first["data/val_dropped"] == 3.0


def test_samples_jsonl_holds_each_steps_first_k_samples_and_validations(tmp_path) -> None:
    """--log.samples 3: three decoded samples per step whose text scores to the logged score; the greedy
    validation's in val_samples.jsonl; with W&B (offline) the same as tables."""
    proc = train("grpo", *SMALL, "--trainer.steps", "2", "--trainer.val-every", "2", "--log.samples", "3",
                 "--log.wandb", "offline", out=tmp_path)  # fmt: skip
    ok(proc)
    train_rows = read_jsonl(tmp_path / "samples.jsonl")
    assert [r["step"] for r in train_rows] == [1, 1, 1, 2, 2, 2]
    for r in train_rows:
        assert set(r) == {"step", "prompt", "response", "score", "advantage", "data_source", "finish_reason",
                          "ground_truth"}  # fmt: skip
        assert r["prompt"].startswith("<|bos|><|user|>reverse ") and r["prompt"].endswith("<|assistant|>")
        text = r["response"].removesuffix("<|eos|>") if r["finish_reason"] == "stop" else r["response"]
        assert r["score"] == pytest.approx(default_compute_score(r["data_source"], text, r["ground_truth"]))
    val_rows = read_jsonl(tmp_path / "val_samples.jsonl")
    assert [r["step"] for r in val_rows] == [0, 0, 0, 2, 2, 2] and all("advantage" not in r for r in val_rows)
    tables = sorted(
        p.name.split("_")[0] for p in tmp_path.glob("wandb/offline-run-*/files/media/table/*.json")
    )
    assert tables.count("samples") == 2 and tables.count("val") == 2, tables


def read_jsonl(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_step_when_piped(tmp_path) -> None:
    args = ["grpo", *[a for a in SMALL if a != "--log.no-progress"], "--trainer.steps", "2", "--trainer.val-every",
            "0", "--algo.kl-coef", "0.01"]  # fmt: skip
    master, replica = pty.openpty()  # a pseudo-terminal as stderr, as an interactive shell gives
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(tmp_path / "tty")]
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "COLUMNS": "200"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=replica,
                            env=env)  # fmt: skip
    os.close(replica)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=240) == 0
    tty = b"".join(chunks).decode(errors="replace")
    assert "| 2/2 [" in tty and "step/s, reward " in tty and "kl_ref " in tty, tty[-2000:]
    assert "step 1/2 |" not in tty
    piped = train(*args, out=tmp_path / "piped")
    ok(piped)
    lines = [x for x in piped.stderr.splitlines() if x.startswith("step ")]
    assert [x.split(" |")[0] for x in lines] == ["step 1/2", "step 2/2"] and "step/s" not in piped.stderr
    assert all("ppo_kl " in x and "kl_ref " in x and "ETA " in x for x in lines), lines


def test_multi_turn_samples_show_the_observations_apart(tmp_path) -> None:
    """The calculator task's tool results are observations inside the response: `turns` sets them apart."""
    ok(train("grpo", "--model.path", "builtin:tiny-calc", "--data.train-files", "builtin:calc", "--data.val-files",
             "builtin:calc", "--rollout.max-turns", "2", "--rollout.max-tokens", "64", "--data.batch-size", "4",
             "--rollout.n", "4", "--trainer.steps", "1", "--trainer.val-every", "0", "--log.no-progress",
             "--log.samples", "16", out=tmp_path))  # fmt: skip
    rows = read_jsonl(tmp_path / "samples.jsonl")
    multi = [r for r in rows if "turns" in r]
    assert len(rows) == 16 and multi, rows
    for r in multi:
        assert "".join(t["text"] for t in r["turns"]) == r["response"]
        observations = [t["text"] for t in r["turns"] if t["role"] == "observation"]
        assert observations and all(o.startswith("<result>") for o in observations), r["turns"]


def test_a_profile_trace_of_the_chosen_steps_loads_as_json_with_the_phases(tmp_path) -> None:
    ok(train("grpo", *SMALL, "--trainer.steps", "3", "--trainer.val-every", "3", "--trainer.profile-steps", "2:3",
             "--algo.rollout-is", "token", "--algo.kl-coef", "0.01", out=tmp_path))  # fmt: skip
    (path,) = (tmp_path / "profile").iterdir()
    assert path.name == "rank0-steps2-3.json"
    events = json.loads(path.read_text())["traceEvents"]
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    counts = {name: sum(e["name"] == name for e in ranges) for name in
              ("rollout", "scoring", "logprobs", "ref_logprobs", "advantages", "update", "sync", "validation")}  # fmt: skip
    assert counts == {"rollout": 2, "scoring": 2, "logprobs": 2, "ref_logprobs": 2, "advantages": 2, "update": 2,
                      "sync": 2, "validation": 1}, counts  # fmt: skip


def test_health_warnings_fire_once_when_a_condition_starts(tmp_path) -> None:
    """A reward that is always 0 (no learning signal from step 3) and 2-token responses (every one cut at
    --rollout.max-tokens): one warning line each, when it starts; the health metrics at every step."""
    reward = tmp_path / "constant.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    proc = train("grpo", *SMALL, "--trainer.steps", "4", "--trainer.val-every", "0", "--rollout.max-tokens", "2",
                 "--reward.custom", f"{reward}:compute_score", out=tmp_path / "run")  # fmt: skip
    ok(proc)
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2, proc.stderr[-3000:]
    assert warnings[0].startswith("warning: step 1: 100% of the responses were cut at --rollout.max-tokens 2")
    assert warnings[1].startswith(
        "warning: step 3: every prompt group's samples have scored the same for 3 steps"
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["health/no_signal_streak"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    assert all(
        r["health/length_pinned"] == 1.0 and r["train/equal_reward_group_frac"] == 1.0 for r in records
    )
