"""The real server in a subprocess (`python -m rlcore.tinker`, or under torchrun with gloo) for the tests,
driven by the real `tinker` SDK."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import tinker

ROOT = Path(__file__).resolve().parents[2]
READY = "serving the Tinker API at "


@contextlib.contextmanager
def running(workdir: Path, *flags: str, ranks: int = 1, timeout: float = 120, threads: int = 1) -> Iterator[str]:
    """A server on a free port until the block ends, each rank with `threads` torch threads; yields its base
    URL. Its output goes to workdir/server.log."""
    serve = ["-m", "rlcore.tinker", "--port", "0", "--workdir", str(workdir), *flags]
    if ranks > 1:
        serve = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *serve]
    env = dict(os.environ) | {"OMP_NUM_THREADS": str(threads), "TRANSFORMERS_VERBOSITY": "error"}
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "server.log", "a")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, *serve], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    url = None
    try:
        url = _ready(lines, proc, timeout, workdir)
        yield url
    finally:
        for made in _CLIENTS.pop(url, []):  # finish their sessions: no heartbeats to a stopped server
            with contextlib.suppress(Exception):
                made.close("success").result(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _ready(lines: queue.Queue, proc: subprocess.Popen, timeout: float, workdir: Path) -> str:
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no ready line in {timeout} s: {(workdir / 'server.log').read_text()[-3000:]}") from None
        if READY in line:
            return line.split(READY)[1].split()[0]
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {(workdir / 'server.log').read_text()[-3000:]}")


_CLIENTS: dict[str | None, list] = {}


def client(url: str, api_key: str = "tml-rlcore-tests") -> tinker.ServiceClient:
    """A ServiceClient of the server at `url` sending `api_key`, closed when the server stops."""
    made = tinker.ServiceClient(base_url=url, api_key=api_key)
    _CLIENTS.setdefault(url, []).append(made)
    return made


class Recorded(tinker.ServiceClient):
    """tinker.ServiceClient for code that makes its own (docs/tinker.md's loop): closed with the server."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _CLIENTS.setdefault(kwargs.get("base_url") or os.environ.get("TINKER_BASE_URL"), []).append(self)
