"""Disk trouble: a checkpoint or a metrics record that cannot be written ends the run with exit code 2 and
one line naming the path and the fix; the previous checkpoints stay intact, nothing half-written is left
that `--resume auto` would take, and once the disk is fixed the run resumes to the uninterrupted result.

A full disk is simulated with RLIMIT_FSIZE (writes past the limit fail with EFBIG, for root too); a
read-only directory with chmod 0o555 (as root, the run drops CAP_DAC_OVERRIDE with setpriv first).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from rlcore.dist.checkpoint import COMPLETE, latest_checkpoint
from tests.reliability.helpers import RUN, assert_same_run, ok, run_args
from tests.reliability.launcher import Launcher

FIRST = run_args(steps=2)  # the same run, stopped after two checkpoints


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _assert_checkpoints_1_and_2_only(checkpoints) -> None:
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]  # no step_3.tmp
    assert latest_checkpoint(checkpoints) == checkpoints / "step_2"
    assert (checkpoints / "step_2" / COMPLETE).is_file()


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(launch, reference, tmp_path):
    ok(launch.run(FIRST, out=tmp_path))
    full = launch.run([*RUN, "--resume", "auto"], out=tmp_path, file_size_limit=1 << 20)  # shards are ~5 MB
    line = _one_error_line(full)
    checkpoints = tmp_path / "checkpoints"
    assert line.startswith(f"error: cannot write checkpoint {checkpoints / 'step_3'} ("), line
    assert "The previous checkpoint (step_2) is intact: free disk space" in line
    assert line.endswith("then rerun with --resume auto"), line
    _assert_checkpoints_1_and_2_only(checkpoints)
    ok(launch.run([*RUN, "--resume", "auto"], out=tmp_path))
    assert_same_run(reference, tmp_path)


def test_a_full_disk_while_logging_fails_cleanly_and_the_torn_record_is_dropped(launch, reference, tmp_path):
    ok(launch.run(FIRST, out=tmp_path))
    metrics = tmp_path / "metrics.jsonl"
    limit = max(metrics.stat().st_size, (tmp_path / "config.json").stat().st_size) + 100
    full = launch.run([*RUN, "--resume", "auto"], out=tmp_path, file_size_limit=limit)
    line = _one_error_line(full)
    assert line == (
        f"error: cannot append step 3 to {metrics} (File too large); free disk space or make {tmp_path} "
        "writable, then rerun with --resume auto"
    )
    assert not metrics.read_bytes().endswith(b"\n")  # a torn record, as a crash mid-append leaves
    _assert_checkpoints_1_and_2_only(tmp_path / "checkpoints")
    ok(launch.run([*RUN, "--resume", "auto"], out=tmp_path))
    assert_same_run(reference, tmp_path)


NO_DAC = (
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
)
"""Root without the capabilities that bypass file permissions, so a read-only directory binds it too."""


@pytest.fixture(scope="module")
def bound_by_permissions(launch):
    """A launcher whose runs cannot write to a read-only directory, even as root."""
    if os.geteuid() != 0:
        yield launch
        return
    if shutil.which("setpriv") is None or subprocess.run([*NO_DAC, "true"]).returncode != 0:
        pytest.skip("root here writes through permissions and cannot drop CAP_DAC_OVERRIDE (setpriv)")
    with Launcher(prefix=NO_DAC) as launcher:
        yield launcher


def test_a_read_only_checkpoint_directory_keeps_the_previous_checkpoint(
    bound_by_permissions, reference, tmp_path
):
    launch = bound_by_permissions  # fmt: skip
    ok(launch.run(FIRST, out=tmp_path))
    checkpoints = tmp_path / "checkpoints"
    checkpoints.chmod(0o555)
    try:
        line = _one_error_line(launch.run([*RUN, "--resume", "auto"], out=tmp_path))
    finally:
        checkpoints.chmod(0o755)
    step_3 = checkpoints / "step_3"
    assert line.startswith(f"error: cannot write checkpoint {step_3} (Permission denied"), line
    _assert_checkpoints_1_and_2_only(checkpoints)
    ok(launch.run([*RUN, "--resume", "auto"], out=tmp_path))
    assert_same_run(reference, tmp_path)


def test_a_full_disk_while_writing_the_final_model_is_one_line(launch, tmp_path):
    args = run_args(steps=1)
    args[args.index("--trainer.save-every") + 1] = "0"  # no checkpoint: final/ is the first big write
    full = launch.run(args, out=tmp_path, file_size_limit=1 << 20)  # model.safetensors is ~1.6 MB
    line = _one_error_line(full)
    assert line.startswith(f"error: cannot write the final model or curves under {tmp_path} ("), line
    assert line.endswith("rerun with --resume auto (training is done; checkpoints, if any, are intact)")
    ok(launch.run([*args, "--resume", "auto"], out=tmp_path))
    assert (tmp_path / "final" / "model.safetensors").stat().st_size > 1 << 20
