"""Hub ids for --model.path (issue 18, item 3): resolved through a prepared offline Hugging Face cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.models.hub import model_directory
from rlcore.models.policy import load_policy
from rlcore.trainer.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
STEP = ["--trainer.steps", "1", "--trainer.val-every", "0", "--data.batch-size", "2", "--rollout.n", "2",
        "--rollout.max-tokens", "4", "--data.builtin-train-size", "8", "--log.no-progress"]  # fmt: skip


def populate_cache(hf_home: Path, repo_id: str) -> Path:
    """The Hugging Face cache layout `hf download` leaves: refs/main naming a snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    model, tokenizer = load_policy("builtin:tiny-reverse")
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def train(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, str(ROOT / "train.py"), "grpo", *STEP, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_a_hub_id_trains_from_the_offline_cache(tmp_path) -> None:
    snapshot = populate_cache(tmp_path / "hf", "acme/tiny-rl")
    proc = train(tmp_path / "hf", "--model.path", "acme/tiny-rl", "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]
    code = "from rlcore.models.hub import model_directory; print(model_directory('acme/tiny-rl'))"
    env = os.environ | {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert Path(out.stdout.strip()) == snapshot, out.stderr[-2000:]


def test_an_uncached_hub_id_is_one_error_line_naming_it(tmp_path) -> None:
    populate_cache(tmp_path / "hf", "acme/tiny-rl")
    proc = train(tmp_path / "hf", "--model.path", "acme/not-here", "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(
        "error: --model.path: model path 'acme/not-here' is not a local directory, and as a"
    )
    assert "hf download acme/not-here" in line


@pytest.mark.parametrize("path", ["./no/such/dir", "/abs/missing", "two//slashes"])
def test_a_missing_path_that_is_not_a_hub_id_says_so(path) -> None:
    with pytest.raises(ValueError, match="is not a directory; expected a local Hugging Face model directory"):
        model_directory(path)


def test_a_directory_is_itself(tmp_path) -> None:
    assert model_directory(str(tmp_path)) == tmp_path
