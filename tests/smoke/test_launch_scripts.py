"""The launch scripts in examples/ train the user's data: each refuses to start without TRAIN, naming it,
passes TRAIN and VAL (several files each, space-separated) on to train.py, and leaves validation to the
trainer when VAL is unset. multinode.sh and torchrun_8gpu.sh run for real here: 2 gloo ranks on CPU, one
step of the built-in model; slurm_2x8.sh runs with `scontrol` and `srun` standing in for Slurm's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_multinode import ENV, _free_port
from tests.smoke.test_train import ROOT, reverse_rows

SCRIPTS = ["multinode.sh", "torchrun_8gpu.sh", "slurm_2x8.sh"]
SHORT = ["--model.path", "builtin:tiny-reverse", "--trainer.steps", "1", "--data.batch-size", "4", "--rollout.n", "2",
         "--rollout.max-tokens", "8", "--data.builtin-train-size", "16", "--data.builtin-val-size", "4",
         "--trainer.val-every", "1", "--log.no-progress"]  # fmt: skip


def launch(script: str, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    full = os.environ | ENV | {"TORCHRUN": str(ROOT / ".venv" / "bin" / "torchrun")} | env
    return subprocess.run(["bash", str(ROOT / "examples" / script), *args], env=full, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_launch_script_refuses_to_start_without_train_naming_it(script, tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "0", "TORCHRUN": "echo", "OUT": str(tmp_path)}
    proc = launch(script, {k: v for k, v in env.items()} | {"TRAIN": ""})
    assert proc.returncode != 0 and "TRAIN" in proc.stderr and "training rows" in proc.stderr, proc.stderr
    assert not proc.stdout and not (tmp_path / "config.json").exists()  # nothing was launched


@pytest.mark.parametrize("script", ["multinode.sh", "torchrun_8gpu.sh"])
def test_a_launch_script_trains_the_users_rows_on_two_gloo_ranks(script, tmp_path):
    a, b, held = reverse_rows(tmp_path / "a.jsonl", 8), reverse_rows(tmp_path / "b.jsonl", 8), reverse_rows(tmp_path / "val.jsonl", 4)
    env = {"TRAIN": f"{a} {b}", "VAL": str(held), "GPUS": "2", "NNODES": "1", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OUT": str(tmp_path / "run")}  # fmt: skip
    proc = launch(script, env, *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["train_files"] == [str(a), str(b)] and config["data"]["val_files"] == [str(held)]
    assert "val/reward_mean" in read_metrics(tmp_path / "run" / "metrics.jsonl")[0]


def _stand_ins(bin_dir: Path) -> dict[str, str]:
    """`scontrol show hostnames` prints this host; `srun` drops its options and runs the task once."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "2",
            "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT)}  # fmt: skip


def test_the_slurm_script_passes_train_and_val_to_every_node(tmp_path):
    env = _stand_ins(tmp_path / "bin") | {"TRAIN": "a.parquet b.parquet", "VAL": "c.parquet", "TORCHRUN": "echo",
                                          "OUT": str(tmp_path / "run")}  # fmt: skip
    proc = launch("slurm_2x8.sh", env, "--trainer.steps", "5")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.split()
    assert "--rdzv-backend" in line and line[line.index("--rdzv-id") + 1] == "7"
    at = line.index("--data.train-files")
    assert line[at + 1 : at + 5] == ["a.parquet", "b.parquet", "--data.val-files", "c.parquet"]
    assert line[-2:] == ["--trainer.steps", "5"]
    no_val = launch("slurm_2x8.sh", env | {"VAL": ""})
    assert no_val.returncode == 0 and "--data.val-files" not in no_val.stdout.split()
