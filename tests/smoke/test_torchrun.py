"""train.py under torchrun: 2 gloo ranks on CPU, FSDP2-sharded policy, each rank sampling its own prompts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rlcore.trainer.logger import read_metrics
from tests.frames import our_frames

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--trainer.steps", "3",
    "--trainer.val-every", "0", "--log.no-progress", "--optim.lr", "1e-2",
]  # fmt: skip


def torchrun(
    *args: str, timeout: float = 300, env: dict | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "train.py"), *args]  # fmt: skip
    env = (env or dict(os.environ)) | {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, not only the launcher
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_a_save_failing_on_one_rank_stops_every_rank(tmp_path):
    """Step 2's checkpoint fails on rank 1 only (disk full, injected): both ranks stop with the one
    error line instead of rank 0 waiting for rank 1 forever; step 1's checkpoint stays the newest."""
    env = dict(os.environ) | {"RLCORE_TEST_SAVE_ERROR": "2:1"}
    proc = torchrun(*ARGS, "--trainer.save-every", "1", "--out-dir", str(tmp_path), env=env, timeout=240)
    assert proc.returncode != 0  # torchrun's own exit code and traceback (ChildFailedError) follow
    assert not our_frames(proc.stderr), proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: cannot write checkpoint")]
    assert any("No space left on device;" in line for line in errors), proc.stderr[-3000:]  # rank 1's
    # rank 0 names the rank that failed (before the fix it sat in a barrier until torchrun killed it)
    assert any("No space left on device (on rank 1)" in line for line in errors), proc.stderr[-3000:]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1"]  # no step_2, no .tmp
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_two_ranks_sample_from_the_synced_copy(tmp_path):
    """The native engine of each rank runs an unsharded copy refreshed after every update: the rollout
    log-probs equal the sharded trainer's on every step (a stale copy is off by ~0.1 from step 2 on);
    --trainer.profile-steps writes a Chrome trace per rank. (Two launchers as two nodes:
    tests/smoke/test_multinode.py.)"""
    args = [*ARGS, "--trainer.profile-steps", "3:3"]
    one = tmp_path / "one"
    proc = torchrun(*args, "--out-dir", str(one))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    records = read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records), records
    assert records[-1]["actor/grad_norm"] > 0
    assert (one / "final" / "model.safetensors").is_file()
    for rank in (0, 1):  # --trainer.profile-steps: a Chrome trace per rank, the step's phases as ranges
        trace = json.loads((one / "profile" / f"rank{rank}-steps3-3.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"rollout", "scoring", "advantages", "update", "sync"} <= names, rank
