"""Ctrl-C and preemption signals sent to a real `python train.py` (issue 23): SIGINT stops with one line
and exit 130; SIGTERM finishes the step, checkpoints it, exits 143, and `--resume auto` then equals the
uninterrupted run; a SIGTERM reaching one of 2 gloo ranks stops both after the same step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlcore.dist.checkpoint import latest_checkpoint
from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import RUN, assert_same_run, ok

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _start(args: list[str], out: Path, *, nproc: int = 1, env: dict | None = None) -> subprocess.Popen:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]  # fmt: skip
    return subprocess.Popen([*launcher, str(ROOT / "train.py"), *args, "--out-dir", str(out)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | ENV | (env or {}),
                            start_new_session=True)  # fmt: skip


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> None:
    """Until metrics.jsonl holds step `step` (the run keeps going)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and any(r["step"] >= step for r in read_metrics(metrics)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not logged within {timeout} s")


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_ctrl_c_stops_the_run_with_one_line(tmp_path):
    args = [*RUN[:-4], "--trainer.steps", "40", "--trainer.save-every", "2", "--trainer.val-every", "0"]
    proc = _start([*args, "--reward.num-workers", "2"], tmp_path)
    _wait_for_step(proc, tmp_path, 3)
    workers = psutil.Process(proc.pid).children(recursive=True)  # the reward workers (and their fork server)
    assert workers
    proc.send_signal(signal.SIGINT)
    err = _finish(proc)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]  # closed
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, err[-3000:]
    found = re.fullmatch(r"interrupted at step (\d+); the newest checkpoint is step_(\d+); continue with --resume auto",
                         lines[0])  # fmt: skip
    assert found, lines
    step, newest = map(int, found.groups())
    assert newest == 2 * ((step - 1) // 2)  # the last even step finished before the one interrupted
    checkpoints = tmp_path / "checkpoints"
    assert latest_checkpoint(checkpoints) == checkpoints / f"step_{newest}"
    assert not list(checkpoints.glob("*.tmp"))  # no partial checkpoint


def test_sigterm_checkpoints_the_finished_step_and_resumes_exactly(launch, reference, tmp_path):
    """The reference run checkpoints every step; this one only at 3 and at the end, so the preemption
    checkpoint is its own. Resumed, the run equals the reference: metrics and bit-identical weights."""
    args = [*RUN, "--trainer.save-every", "3"]
    proc = _start(args, tmp_path)
    _wait_for_step(proc, tmp_path, 1)
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    logged = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    step = logged[-1]  # the step in progress when the signal came, finished
    assert logged == list(range(1, step + 1)) and step < 4
    checkpoint = tmp_path / "checkpoints" / f"step_{step}"
    assert (
        f"preempted: wrote checkpoint {checkpoint} (step {step}); continue with --resume auto"
        in err.splitlines()
    )
    assert latest_checkpoint(tmp_path / "checkpoints") == checkpoint
    ok(launch.run([*args, "--resume", "auto"], out=tmp_path))
    assert_same_run(reference, tmp_path)


def test_sigterm_to_one_of_two_ranks_stops_both_after_the_same_step(tmp_path):
    args = [*RUN[:-4], "--trainer.steps", "40", "--trainer.val-every", "0"]
    proc = _start(args, tmp_path, nproc=2)
    _wait_for_step(proc, tmp_path, 2)
    ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
             if "train.py" in " ".join(p.cmdline())}  # fmt: skip
    ranks[1].send_signal(signal.SIGTERM)  # rank 1 only; rank 0 never hears of it but through the reduction
    err = _finish(proc)
    said = re.findall(
        r"preempted: wrote checkpoint (\S+) \(step (\d+)\)", err
    )  # two ranks' writes may interleave
    assert len(said) == 2 and said[0] == said[1], err[-3000:]  # both ranks, the same step
    step = int(said[0][1])
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / f"step_{step}"
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] == step


def test_a_step_running_past_the_grace_period_is_abandoned(tmp_path):
    """Each rollout sleeps 8 s (injected): the step in progress cannot finish within a 2 s grace."""
    args = [*RUN[:-4], "--trainer.steps", "3", "--trainer.save-every", "1", "--trainer.val-every", "0",
            "--trainer.preempt-grace-s", "2"]  # fmt: skip
    proc = _start(args, tmp_path, env={"RLCORE_TEST_SLOW_ROLLOUT_S": "8"})
    _wait_for_step(proc, tmp_path, 1, timeout=240)
    while latest_checkpoint(tmp_path / "checkpoints") is None:  # step 1 saved: step 2's rollout is asleep
        time.sleep(0.05)
    time.sleep(1.0)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 143 and time.monotonic() - started < 6, err[
        -3000:
    ]  # 2 s, not step 2's 7 s left
    assert err.splitlines()[-1] == (
        "preempted: the step in progress ran past --trainer.preempt-grace-s 2; abandoned it, the newest "
        "checkpoint is step_1; continue with --resume auto"
    ), err[-3000:]
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_1"
