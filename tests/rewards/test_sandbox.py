"""The code sandbox: normal runs, every limit, and each attack contained, reported, and gone afterwards.

Attack tests tag the processes they start with a random token in their argv (`tagged`) and check
the host through /proc afterwards: no process carries the token, and (when the tests run as root)
no process runs as the sandbox's host uid. Tests that need bubblewrap skip only when
`sandbox_available()` is false, and never under CI (`test_available_under_ci`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlcore.rewards import sandbox
from rlcore.rewards.sandbox import SandboxUnavailable, run_python, sandbox_available

needs_sandbox = pytest.mark.skipif(
    not sandbox_available(), reason=f"sandbox unavailable: {sandbox.unavailable_reason()}"
)


def tagged(body: str, token: str) -> str:
    """A program that re-execs itself as `body` with `token` in its argv, so /proc shows its processes."""
    return (
        f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {body!r}, {token!r}])\n"
    )


def pids_with(token: str) -> list[int]:
    """Host pids whose command line contains `token` (the test's own process excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue  # exited while we looked
            if token.encode() in cmdline:
                found.append(int(entry))
    return found


def pids_of_uid(uid: int) -> list[int]:
    """Host pids (zombies excluded: they run nothing) whose real uid is `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = dict(
                    line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines()
                )
            except OSError:
                continue
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                found.append(int(entry))
    return found


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def token():
    """A random token; afterwards no host process may carry it or run as the sandbox's host uid."""
    value = f"rlcore-attack-{secrets.token_hex(6)}"
    yield value
    assert pids_with(value) == [], "a sandboxed process survived its run"
    if os.geteuid() == 0:  # bwrap of a killed caller may take a moment to receive its SIGKILL
        assert wait_until(lambda: not pids_of_uid(sandbox.HOST_UID), 2.0), "a sandbox process survived"


def test_available_under_ci():
    """CI installs bubblewrap; there the sandbox tests must run, never skip."""
    if not os.environ.get("CI"):
        pytest.skip("CI is not set")
    assert sandbox_available(), sandbox.unavailable_reason()


def test_unavailable_raises_with_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox, "_bwrap", lambda: None)
    sandbox._unavailable_reason.cache_clear()
    try:
        assert not sandbox_available()
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            run_python("print('never runs')")
    finally:
        sandbox._unavailable_reason.cache_clear()


def test_failed_self_check_is_unavailable(monkeypatch):
    """A bwrap that cannot isolate (here: a stand-in that always fails) is never trusted."""
    monkeypatch.setattr(sandbox, "_bwrap", lambda: "/bin/false")
    sandbox._unavailable_reason.cache_clear()
    try:
        reason = sandbox.unavailable_reason()
        assert reason is not None and "self-check" in reason
        with pytest.raises(SandboxUnavailable, match="self-check"):
            run_python("print('never runs')")
    finally:
        sandbox._unavailable_reason.cache_clear()


@pytest.mark.parametrize(
    ("option", "value"), [("timeout_s", 0), ("memory_mb", 8), ("max_processes", 1), ("max_output_bytes", 0)]
)
def test_bad_limits_are_rejected(option, value):
    with pytest.raises(ValueError, match=option):
        run_python("pass", **{option: value})


@needs_sandbox
def test_stdin_stdout_and_exit_code():
    result = run_python("import sys\nprint(sys.stdin.read().upper(), end='')\nsys.exit(3)", stdin="abc\nd\n")
    assert (result.stdout, result.exit_code) == ("ABC\nD\n", 3)
    assert (result.timed_out, result.killed_by_limit, result.truncated, result.ok) == (
        False,
        None,
        False,
        False,
    )
    assert run_python("print('é')").ok
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.exit_code = 0  # type: ignore[misc]


@needs_sandbox
def test_exception_and_syntax_error_are_reported():
    raised = run_python("raise ValueError('boom')")
    assert raised.exit_code == 1 and raised.stderr.rstrip().endswith("ValueError: boom")
    broken = run_python("def f(:\n    pass")
    assert broken.exit_code == 1 and "SyntaxError" in broken.stderr and broken.killed_by_limit is None


@needs_sandbox
def test_limits_and_identity_inside():
    program = (
        "import os, resource as r\n"
        "names = ['RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NPROC', 'RLIMIT_NOFILE', 'RLIMIT_CORE']\n"
        "print([r.getrlimit(getattr(r, n)) for n in names])\n"
        "print(os.getuid(), os.getgid(), os.getcwd(), sorted(os.listdir('.')), sorted(os.listdir('/proc/self/fd')))\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    result = run_python(program, timeout_s=2.5, memory_mb=256, max_processes=12, disk_mb=8)
    limits, identity, caps = result.stdout.splitlines()
    mib = 1 << 20
    assert limits == str([(3, 4), (256 * mib, 256 * mib), (8 * mib, 8 * mib), (12, 12), (64, 64), (0, 0)])
    # its own, empty working directory; no open files but stdin, stdout, stderr (3: listdir's own)
    assert identity == "65534 65534 /sandbox ['main.py'] ['0', '1', '2', '3']"
    assert int(caps, 16) == 0  # no capabilities at all


@needs_sandbox
@pytest.mark.parametrize(
    "body",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass",  # no output to wait on
    ],
)
def test_infinite_loop_times_out(body, token):
    start = time.monotonic()
    result = run_python(tagged(body, token), timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 4.0  # the wall-clock kill, with slack for a loaded machine
    assert result.timed_out and result.killed_by_limit == "wall_time"
    assert result.exit_code == 128 + signal.SIGKILL and not result.ok


@needs_sandbox
def test_cpu_limit_is_reported(token):
    """The CPU-time rlimit (here lowered by the program itself to 1 s) ends it with SIGXCPU, reported."""
    body = "import resource as r\nr.setrlimit(r.RLIMIT_CPU, (1, 2))\nwhile True:\n    pass"
    result = run_python(tagged(body, token), timeout_s=20.0)
    assert result.wall_s < 10.0
    assert result.killed_by_limit == "cpu_time" and result.timed_out
    assert result.exit_code == 128 + signal.SIGXCPU


@needs_sandbox
def test_fork_bomb_is_held_by_the_process_limit(token):
    max_processes = 16
    seen = [0]
    done = threading.Event()

    def watch():  # the most bomb processes alive on the host at any moment
        while not done.is_set():
            seen[0] = max(seen[0], len(pids_with(token)))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
        result = run_python(tagged(bomb, token), timeout_s=1.5, max_processes=max_processes)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out and result.wall_s < 1.5 + 1.0
    assert 2 <= seen[0] <= max_processes


@needs_sandbox
def test_process_limit_counts_exactly_one_sandbox(token):
    """Children that sleep until fork fails: fewer than max_processes, then all die with the program."""
    body = (
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
        "    except OSError as e:\n        print(n, e.errno)\n        break\n"
        "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n"
    )
    result = run_python(tagged(body, token), timeout_s=10.0, max_processes=12)
    forked, errno = map(int, result.stdout.split())
    assert errno == 11 and 6 <= forked < 12  # EAGAIN; the program itself and bwrap's init count too
    assert result.exit_code == 0 and result.wall_s < 5.0  # the sleeping children did not hold it open


@needs_sandbox
def test_memory_bomb_is_stopped_at_the_limit(token):
    grab = (
        "blocks = []\ntry:\n    while True:\n        blocks.append(bytearray(8 << 20))\n"
        "except MemoryError:\n    print(len(blocks) * 8)\n"
    )
    held = run_python(tagged(grab, token), memory_mb=128)
    assert held.exit_code == 0 and 0 < int(held.stdout) < 128  # MiB it got before the limit
    bomb = run_python(tagged("x = b'x' * (64 << 30)", token), memory_mb=128)
    assert bomb.killed_by_limit == "memory" and bomb.exit_code == 1 and not bomb.timed_out
    assert bomb.stderr.rstrip().endswith("MemoryError")


@needs_sandbox
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_truncated_and_stopped(stream, token):
    body = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)"
    result = run_python(tagged(body, token), timeout_s=10.0, max_output_bytes=100_000)
    assert result.truncated and result.killed_by_limit == "output" and not result.timed_out
    assert getattr(result, stream) == "x" * 100_000
    assert result.wall_s < 5.0  # killed at the cap, not at the timeout


@needs_sandbox
def test_disk_is_bounded(token):
    """Writing without end stops at the working directory's size (a tmpfs: the host disk is untouched)."""
    body = (
        "import os\ndef fill(name, mib):\n    try:\n        with open(name, 'wb') as f:\n"
        "            for _ in range(mib):\n                f.write(b'x' * (1 << 20))\n                f.flush()\n"
        "        print(name, 'ok')\n"
        "    except OSError as e:\n        print(name, e.errno, os.path.getsize(name) >> 20)\n"
        "fill('big', 64)\nos.remove('big')\nfill('small', 2)\n"
    )
    result = run_python(tagged(body, token), disk_mb=4)
    big, small = result.stdout.splitlines()
    assert big in ("big 28 3", "big 28 4")  # ENOSPC at the 4 MiB disk (main.py takes a little)
    assert small == "small ok"  # the space is there again once freed


@needs_sandbox
def test_writing_outside_its_directory_fails(tmp_path, token):
    planted = tmp_path / "planted.txt"
    planted.write_text("original")
    targets = [
        str(tmp_path / "pwned.txt"),
        str(planted),
        f"/tmp/{token}.txt",
        f"/{token}.txt",
        f"/usr/{token}.txt",
        f"/etc/{token}.txt",
        f"/dev/{token}.txt",
        f"/dev/shm/{token}.txt",
        f"{sys.base_prefix}/{token}.txt",
        f"/proc/1/root/{token}.txt",
    ]
    body = (
        f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('pwned')\n"
        "        print('WROTE', path)\n    except OSError as e:\n        print('blocked', e.errno)\n"
    )
    result = run_python(tagged(body, token))
    assert result.exit_code == 0 and "WROTE" not in result.stdout
    assert result.stdout.count("blocked") == len(targets)
    assert planted.read_text() == "original" and not (tmp_path / "pwned.txt").exists()
    assert not any(Path(path).exists() for path in targets[2:-1])  # (/proc/1 is the sandbox's own init)


@needs_sandbox
def test_reading_a_file_planted_outside_fails(tmp_path, token):
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    body = (
        f"import os\nfor path in [{str(secret)!r}, '/proc/1/root' + {str(secret)!r}]:\n"
        "    try:\n        print('READ', open(path).read())\n"
        "    except OSError as e:\n        print('blocked', e.errno)\n"
        f"print(os.path.exists({str(tmp_path)!r}), sorted(os.listdir('/')))\n"
    )
    result = run_python(tagged(body, token))
    assert result.exit_code == 0 and "READ" not in result.stdout
    assert result.stdout.splitlines()[:2] == ["blocked 2", "blocked 2"]  # ENOENT: not even there
    assert result.stdout.splitlines()[2].startswith("False")


@needs_sandbox
def test_network_is_unreachable(token):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        body = (
            "import socket\nprint(sorted(name for _, name in socket.if_nameindex()))\n"
            f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n        socket.create_connection(address, timeout=2).close()\n"
            "        print('CONNECTED')\n    except OSError as e:\n        print('blocked', e.errno)\n"
        )
        result = run_python(tagged(body, token), timeout_s=30.0)  # slack for a loaded machine
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected to the host's listener
    assert result.exit_code == 0 and "CONNECTED" not in result.stdout
    assert result.stdout.splitlines() == ["['lo']", "blocked 111", "blocked 101"]  # refused; unreachable


@needs_sandbox
def test_parent_environment_is_not_visible(monkeypatch, token):
    monkeypatch.setenv("RLCORE_TEST_SECRET", token)
    body = (
        "import os\nprint(sorted(os.environ))\n"
        "for path in ['/proc/self/environ', '/proc/1/environ']:\n"
        "    try:\n        print(open(path, 'rb').read())\n"
        "    except OSError as e:\n        print('blocked', e.errno)\n"
    )
    result = run_python(tagged(body, token))
    assert result.exit_code == 0
    assert token not in result.stdout and "RLCORE_TEST_SECRET" not in result.stdout
    assert result.stdout.splitlines()[0] == str(["HOME", "LANG", "PATH", "PWD", "TMPDIR"])


@needs_sandbox
def test_background_process_does_not_survive(token):
    """A daemon (double fork, setsid) still sleeping when the program exits is killed with it."""
    daemon = "import time\ntime.sleep(60)"
    body = (
        "import os, sys\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.close(r)\n        os.write(w, b'up')\n"
        f"        os.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {daemon!r}, sys.argv[1]])\n"
        "    os._exit(0)\nos.close(w)\nprint(os.read(r, 2).decode())\n"
    )
    result = run_python(tagged(body, token), timeout_s=10.0)
    assert result.exit_code == 0 and result.stdout == "up\n"  # the daemon was running
    assert result.wall_s < 5.0  # run_python did not wait for it (timeout_s is 10)
    assert pids_with(token) == []  # and it is gone the moment run_python returns


@needs_sandbox
def test_killed_caller_leaves_nothing_behind(token):
    """A reward worker killed mid-run (the pool's timeout) takes its sandbox with it."""
    caller = (  # loads sandbox.py alone: importing the rlcore.rewards package would pull in transformers
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('sandbox', sys.argv[1])\n"
        "module = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\nmodule.run_python(sys.stdin.read(), timeout_s=60)\n"
    )
    program = tagged("import time\ntime.sleep(60)", token)  # on stdin: only the sandbox carries the token
    with subprocess.Popen([sys.executable, "-c", caller, sandbox.__file__], stdin=subprocess.PIPE) as proc:
        proc.stdin.write(program.encode())
        proc.stdin.close()
        assert wait_until(lambda: pids_with(token), 20.0), "the sandboxed program never started"
        proc.kill()
    assert wait_until(lambda: not pids_with(token), 5.0)


@needs_sandbox
def test_timeout_during_setup_leaves_nothing(monkeypatch, token):
    """bwrap held in its setup (--block-fd on a pipe never written) and its pid 1 never reported:
    the timeout must still take down bwrap and the sandbox's half-made pid 1."""
    hold, never_written = os.pipe()
    argv, identity = sandbox._bwrap_argv, sandbox._identity

    def held_argv(*args, **kwargs):  # the token in bwrap's own command line makes it findable
        return [*argv(*args, **kwargs), "--setenv", "TOKEN", token, "--block-fd", str(hold)]

    def identity_passing_hold(stack):
        args, popen_kw = identity(stack)
        return args, {**popen_kw, "pass_fds": (*popen_kw["pass_fds"], hold)}

    monkeypatch.setattr(sandbox, "_bwrap_argv", held_argv)
    monkeypatch.setattr(sandbox, "_identity", identity_passing_hold)
    monkeypatch.setattr(sandbox._Killer, "learn", lambda self, chunk: None)
    try:
        result = run_python("print('never runs')", timeout_s=1.0)
    finally:
        os.close(hold)
        os.close(never_written)
    assert result.killed_by_limit == "wall_time" and result.stdout == ""
    assert pids_with(token) == []


@needs_sandbox
def test_no_privilege_escalation(token):
    body = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "try:\n    os.setuid(0)\n    print('ROOT')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    result = run_python(tagged(body, token))
    unshare, setuid, pids = result.stdout.splitlines()
    assert unshare.split()[0] == "-1"  # no nested user namespace
    assert setuid == "blocked 1"  # EPERM
    assert pids == "[1, 2]"  # bwrap's init and the program: no host process is visible


@needs_sandbox
def test_concurrent_runs_are_independent():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python("print(int(input()) ** 2)", stdin=f"{i}\n"), range(8)))
    assert [r.stdout for r in results] == [f"{i**2}\n" for i in range(8)]


SYSTEM_PYTHON = "/usr/bin/python3"
A_USER = 54321  # an unprivileged uid with no account: the caller in the non-root test


@needs_sandbox
@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root (to act as another user) and a system /usr/bin/python3",
)
def test_non_root_caller_gets_the_same_limits(token):
    """The other identity path: a normal user's bwrap maps the sandbox to that user; the limits hold."""
    version = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info >= (3, 10))"], capture_output=True
    )
    if version.stdout.strip() != b"True":
        pytest.skip("the system python is older than 3.10")
    scratch = Path(tempfile.mkdtemp())
    try:
        scratch.chmod(0o755)
        module = scratch / "sandbox.py"
        module.write_bytes(Path(sandbox.__file__).read_bytes())
        module.chmod(0o644)
        fork_until_refused = (
            "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
            "    except OSError as e:\n        print(n, e.errno)\n        break\n"
            "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n"
        )
        caller = (
            "import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('sandbox', sys.argv[1])\n"
            "sb = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(sb)\n"
            "print(sb.unavailable_reason())\n"
            "print(sb.run_python(sys.stdin.read(), max_processes=12).stdout, end='')\n"
            "print(sb.run_python('import os; print(os.getuid(), len(os.environ))').stdout, end='')\n"
        )
        result = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", caller, str(module)],
            input=tagged(fork_until_refused, token).encode(),
            capture_output=True,
            user=A_USER,
            group=A_USER,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin"},
            timeout=60,
        )
    finally:
        shutil.rmtree(scratch)
    reason, forks, identity = result.stdout.decode().splitlines()
    assert reason == "None", result.stderr.decode()
    forked, errno = map(int, forks.split())
    assert errno == 11 and 6 <= forked < 12  # the process limit holds here too
    assert identity == "65534 5"  # nobody inside; PATH, HOME, LANG, TMPDIR, PWD only
    assert wait_until(lambda: not pids_of_uid(A_USER), 2.0)
