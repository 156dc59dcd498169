"""`python -m rlcore.tinker`'s own bad input: one `error:` line, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tinker.server import ROOT


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prot", "80"], "Unrecognized options: --prot, 80; did you mean --port? (see python -m rlcore.tinker --help)"),
        (["--port", "abc"], "Error parsing --port: invalid literal for int()"),
        (["--rollout-ranks", "1"], "--rollout-ranks 1: split placement needs 1 <= rollout ranks (1) < world size (1)"),
        (["--micro-batch-tokens", "-5"], "--micro-batch-tokens must be 0 (automatic) or a number of tokens"),
        (["--api-key", "secret"], "--api-key: the tinker SDK sends only keys starting with tml-"),
        (["--host", "0.0.0.0"], "--host 0.0.0.0 serves other machines: pass --api-key (or --api-key-file)"),
        (["--max-samples", "0"], "--max-samples 0: give a positive bound"),
        (["--model-roots", "/no/such/dir"], "--model-roots /no/such/dir: not a directory"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_code_2(flags, message):
    proc = subprocess.run([sys.executable, "-m", "rlcore.tinker", "--port", "0", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def test_a_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "rlcore.tinker", "--port", str(port), "--workdir", str(tmp_path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: --host 127.0.0.1 --port {port}: cannot listen (Address already in use); "
                                   "pick another port, or 0 for a free one")  # fmt: skip
