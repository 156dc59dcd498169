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
import pytest

from rlcore.dist.checkpoint import latest_checkpoint
from rlcore.trainer.logger import read_metrics
from tests.frames import our_frames
from tests.reliability.helpers import RUN, assert_same_run, ok

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _start(args: list[str], out: Path, *, nproc: int = 1, env: dict | None = None) -> subprocess.Popen:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]  # fmt: skip
    return subprocess.Popen([*launcher, str(ROOT / "train.py"), *args, "--out-dir", str(out)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | ENV | (env or {}),
                            start_new_session=True, preexec_fn=_default_sigint)  # fmt: skip


def _default_sigint() -> None:
    """In the child before it runs: SIGINT's default disposition, so that Python makes it KeyboardInterrupt
    even when the tests run where it is ignored (a shell's background job; children inherit SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
    # the last even step finished before the one interrupted, or, when Ctrl-C came while step `step` was
    # being saved, that checkpoint (the write is finished first, never cut short)
    assert newest == 2 * ((step - 1) // 2) or (step % 2 == 0 and newest == step), (step, newest)
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


def _interrupted_line(err: str) -> tuple[int, int]:
    """(step, newest checkpoint step) of the one `interrupted at step ...` line a stopped rank prints."""
    found = re.search(r"^interrupted at step (\d+); the newest checkpoint is step_(\d+); continue with --resume auto$",
                      err, re.M)  # fmt: skip
    assert found, err[-3000:]
    return int(found.group(1)), int(found.group(2))


def _assert_intact(checkpoints: Path, newest: int, *, critic: bool) -> None:
    """step_<newest> is the newest complete checkpoint (the critic's too), and nothing partial is left."""
    assert latest_checkpoint(checkpoints) == checkpoints / f"step_{newest}"
    if critic:
        assert latest_checkpoint(checkpoints / "critic") == checkpoints / "critic" / f"step_{newest}"
    assert not list(checkpoints.glob("**/*.tmp"))


SAVE_EVERY_STEP = [*RUN[:-4], "--trainer.steps", "4", "--trainer.save-every", "1", "--trainer.val-every", "0"]


@pytest.mark.parametrize("part", ["policy", "critic"])
def test_ctrl_c_inside_a_checkpoint_write_is_an_interrupt_not_a_disk_error(part, launch, tmp_path):
    """SIGINT lands inside DCP's write of step 2's checkpoint (the policy's, or PPO's critic's), on cue:
    the write finishes, then the run stops as at any Ctrl-C (before the fix: the interrupt surfaced as
    DCP's exception, reported as a disk error with exit 2)."""
    args = [*SAVE_EVERY_STEP, *(["--algo.adv-estimator", "gae"] if part == "critic" else [])]
    proc = launch.run(args, out=tmp_path, env={"RLCORE_TEST_SIGNAL_IN_SAVE": f"2:{part}:SIGINT"})
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr[-3000:]
    assert _interrupted_line(proc.stderr) == (2, 2)  # step 2's checkpoint, completed before stopping
    _assert_intact(tmp_path / "checkpoints", 2, critic=part == "critic")
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_sigterm_inside_a_critic_checkpoint_write_preempts(launch, tmp_path):
    """SIGTERM inside the critic's write: the save finishes and the run stops after it with exit 143."""
    args = [*SAVE_EVERY_STEP, "--algo.adv-estimator", "gae"]
    proc = launch.run(args, out=tmp_path, env={"RLCORE_TEST_SIGNAL_IN_SAVE": "2:critic:SIGTERM"})
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints" / "step_2"
    assert f"preempted: wrote checkpoint {checkpoint} (step 2); continue with --resume auto" in proc.stderr
    _assert_intact(tmp_path / "checkpoints", 2, critic=True)


def test_ctrl_c_inside_a_checkpoint_write_stops_both_ranks(tmp_path):
    """Under torchrun every rank is interrupted inside its DCP write (torchrun forwards Ctrl-C to each):
    both finish the save together, then stop with the interrupted line; none is reported as a disk error."""
    proc = _start(SAVE_EVERY_STEP, tmp_path, nproc=2, env={"RLCORE_TEST_SIGNAL_IN_SAVE": "2:policy:SIGINT"})
    err = _finish(proc)
    assert proc.returncode != 0  # torchrun's own exit code and ChildFailedError follow
    assert "error: cannot write checkpoint" not in err, err[-3000:]
    assert len(re.findall(r"interrupted at step 2; the newest checkpoint is step_2;", err)) == 2, err[-3000:]
    assert not our_frames(err), err[-3000:]
    _assert_intact(tmp_path / "checkpoints", 2, critic=False)


def test_sigterm_inside_a_checkpoint_write_under_split_placement(tmp_path):
    """Split placement stops at once on SIGTERM; one landing inside the trainer's DCP write waits for the
    write to finish (before the fix: DCP's exception, reported as a disk error)."""
    args = [*SAVE_EVERY_STEP, "--pipeline.placement", "split", "--pipeline.rollout-ranks", "1"]
    proc = _start(args, tmp_path, nproc=2, env={"RLCORE_TEST_SIGNAL_IN_SAVE": "2:policy:SIGTERM"})
    err = _finish(proc)
    assert proc.returncode != 0
    assert "error: cannot write checkpoint" not in err, err[-3000:]
    assert "SIGTERM at step 2 (split placement stops at once); the newest checkpoint is step_2;" in err, err[
        -3000:
    ]
    assert not our_frames(err), err[-3000:]
    _assert_intact(tmp_path / "checkpoints", 2, critic=False)


def test_deferred_holds_signals_until_the_block_ends():
    """Within `deferred`, Ctrl-C and SIGUSR1 are held; at the end each reaches the handler in place before
    (SIGUSR1's first: it came first); a block that raises keeps its own error; a second Ctrl-C is at once."""
    from rlcore.trainer.signals import deferred

    seen, previous = [], signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever pytest was started with
    try:
        with pytest.raises(KeyboardInterrupt), deferred(second_sigint=lambda: seen.append("second")):
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGINT)
            assert seen == []  # held, not delivered
        assert seen == [signal.SIGUSR1]
        # the block's error stands, the Ctrl-C is dropped; the second one calls `second_sigint`
        with pytest.raises(OSError, match="disk full"), deferred(second_sigint=lambda: seen.append("second")):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError("disk full")
        assert seen == [signal.SIGUSR1, "second"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGINT, interrupt)
