"""A warm launcher for train.py runs: it imports the trainer once, then forks one child process per run.

Every run is still its own process — killed by a real SIGKILL, resumed by a fresh process that reads only
what the killed one left on disk — but it starts in about a second instead of paying the ~8 s import of
torch, transformers and matplotlib again (the reliability suite starts some 40 runs on 2 cores).

    with Launcher() as launch:
        proc = launch.run(["grpo", "--trainer.steps", "2"], out=tmp / "run", env={"RLCORE_TEST_KILL_AT": "1:update"})
        proc.returncode, proc.stdout, proc.stderr        # -9 when the run SIGKILLed itself

The child runs `train.main(argv)` the way `python train.py ARGV` does: an uncaught exception prints
its traceback and exits 1, `SystemExit(code)` exits with `code`, atexit handlers run. The launcher
itself (this file run as a script) forks from a process that has run no torch op, so no thread pool
is copied half-alive into the children.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    "PYTHONUNBUFFERED": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "OMP_WAIT_POLICY": "PASSIVE",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}  # no "Loading weights" bar: stderr holds only what rlcore prints


class Launcher:
    """Test side: starts the launcher process, runs one train.py child at a time through it."""

    def __init__(self, prefix: tuple[str, ...] = ()) -> None:
        """`prefix`: a command that runs the launcher, e.g. setpriv with fewer capabilities."""
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, __file__],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=os.environ | ENV,
        )
        self._pending = b""
        self._logs = Path(tempfile.mkdtemp(prefix="rlcore-launcher-"))
        self._count = 0

    def run(
        self,
        argv: list[str],
        *,
        out: Path | None = None,
        env: dict[str, str] | None = None,
        file_size_limit: int | None = None,
        timeout: float = 240,
        whole_env: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run `train.py ARGV [--out-dir OUT]` in a fresh child; its exit code, stdout and stderr.

        `env` is added to the launcher's environment (the test process's when the launcher started), or
        with `whole_env` is the child's whole environment (what the test process has now, say).

        `file_size_limit` (bytes) sets RLIMIT_FSIZE with SIGXFSZ ignored: a larger write fails with
        EFBIG, the way a full disk fails one (and unlike a read-only directory, it binds root too).
        """
        argv = [*argv, "--out-dir", str(out)] if out is not None else list(argv)
        self._count += 1
        stdout, stderr = self._logs / f"{self._count}.out", self._logs / f"{self._count}.err"
        request = {"argv": argv, "env": env or {}, "whole_env": whole_env, "stdout": str(stdout),
                   "stderr": str(stderr), "file_size_limit": file_size_limit}  # fmt: skip
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        pid = json.loads(self._readline(180))["pid"]  # the first request waits for the imports
        try:
            returncode = json.loads(self._readline(timeout))["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._readline(30)
            raise
        return subprocess.CompletedProcess(
            ["train.py", *argv], returncode, stdout.read_text(), stderr.read_text()
        )

    def _readline(self, timeout: float) -> str:
        """One line from the launcher (read unbuffered: select() must not miss a line already buffered)."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            if not select.select([fd], [], [], timeout)[0]:
                raise TimeoutError(f"no answer from the launcher within {timeout} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the launcher exited (code {self._proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
        for path in self._logs.iterdir():
            path.unlink()
        self._logs.rmdir()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ the launcher process


def _preload() -> None:
    """Import what a run imports, without running any torch op."""
    sys.path.insert(0, str(ROOT))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    import tyro  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import train  # noqa: F401
    from rlcore.trainer.cli import parse

    parse(["grpo"])  # tyro's parser caches (pure Python)


_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _child(request: dict) -> None:
    """In the forked child: become `python train.py ARGV` with the request's files and environment."""
    import atexit
    import resource
    import traceback

    code = 1
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], _WRITE),
                                (2, request["stderr"], _WRITE)):  # fmt: skip
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        if request.get("whole_env"):
            os.environ.clear()
        os.environ.update(request["env"])
        # Ctrl-C is a KeyboardInterrupt, as in `python train.py` from a terminal, even when the tests were
        # started where SIGINT is ignored (a shell's background job), a disposition children inherit
        signal.signal(signal.SIGINT, signal.default_int_handler)
        limit = request["file_size_limit"]
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        import train

        try:
            code = train.main(request["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    _preload()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
