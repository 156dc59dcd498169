"""Run untrusted Python (model-written code) in a bubblewrap sandbox with resource limits.

    from rlcore.rewards.sandbox import run_python
    result = run_python("print(sum(map(int, input().split())))", stdin="1 2\\n", timeout_s=5.0)
    result.stdout, result.exit_code, result.timed_out      # "3\\n", 0, False

Isolation comes from bubblewrap (`bwrap`, Debian/Ubuntu package `bubblewrap`) run unprivileged:
- new user, pid, net, ipc, uts and cgroup namespaces; no capabilities (`--cap-drop ALL`); a new
  session (no terminal injection); uid/gid 65534 inside; no nested user namespaces;
- a fresh tmpfs root, remounted read-only, holding read-only binds of only what the interpreter
  needs: `/usr`, the `/bin`, `/lib*` links, `/etc/ld.so.*`, the interpreter's prefix
  (`sys.base_prefix`), a new `/proc` (this pid namespace only) and a minimal read-only `/dev`;
- the working directory `/sandbox`: a new, empty tmpfs of `disk_mb` (the only writable place;
  nothing of the host's disk can be filled, and it vanishes with the run);
- `--clearenv`: PATH, HOME, LANG, TMPDIR only; the interpreter runs with `-I -S` (the standard
  library only: no site-packages, no user dirs, no PYTHON* variables);
- a new network namespace with only a loopback interface of its own (no network at all);
- a pid namespace: when the program exits, or is killed at a limit (the parent SIGKILLs the
  namespace's pid 1, found through `--info-fd`), every process it started (daemons included) dies
  before bwrap exits, so nothing survives `run_python`; `--die-with-parent` does the same when the
  caller itself dies (e.g. a reward worker killed by the pool).
Inside, a tiny launcher sets hard rlimits before exec'ing the program: RLIMIT_CPU (timeout rounded
up, then SIGXCPU; +1 s SIGKILL), RLIMIT_AS (`memory_mb`), RLIMIT_FSIZE (`disk_mb`), RLIMIT_NPROC
(`max_processes`), RLIMIT_NOFILE (64), RLIMIT_CORE (0). Rlimits are set in the sandbox, not with
`preexec_fn`, which is unsafe in a threaded parent. The parent enforces the wall clock
(`timeout_s`) and caps captured output at `max_output_bytes` per stream, killing the sandbox when
either is exceeded.

The kernel counts RLIMIT_NPROC per user namespace and uid, and ignores it for host root. A normal
user's run is therefore simple: bwrap's own new user namespace maps the sandbox to that user. When
the caller is root, bwrap instead runs as the unused host uid `HOST_UID` inside a user namespace
prepared here (`_root_mode_userns`): it maps uid 65534 to `HOST_UID` and keeps root mapped to root,
so that bwrap can bind an interpreter only root can reach (pyenv under /root); the program runs as
65534 with no capabilities, and no process outside the sandbox runs as `HOST_UID` except bwrap.

Where bubblewrap is missing or cannot create its namespaces, `run_python` raises
`SandboxUnavailable` naming the fix; it never runs code unconfined. sandbox_pipe.py runs the same
sandbox with its stdin and stdout kept open for a line-oriented exchange (`_spawn`, `_Killer`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

INSTALL_HINT = "apt-get install -y bubblewrap"
WORKDIR = "/sandbox"
MAX_OPEN_FILES = 64
SANDBOX_UID = 65534
"""The program's uid and gid inside the sandbox ("nobody")."""
HOST_UID = 1_999_999_999
"""When the caller is root: the otherwise unused host uid/gid that bwrap and the program run as."""
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_KILL_GRACE_S = 5.0  # after a kill, how long to wait for the pipes to close

Limit = Literal["wall_time", "cpu_time", "memory", "output"]

# Runs inside the sandbox: hard rlimits, no stray fds, then exec the program. argv: cpu_s as_bytes fsize nproc nofile.
_LAUNCHER = """\
import os, resource as r, sys
cpu, mem, fsize, nproc, nofile = map(int, sys.argv[1:6])
for k, v in ((r.RLIMIT_CPU, (cpu, cpu + 1)), (r.RLIMIT_AS, (mem, mem)), (r.RLIMIT_FSIZE, (fsize, fsize)),
             (r.RLIMIT_NPROC, (nproc, nproc)), (r.RLIMIT_NOFILE, (nofile, nofile)), (r.RLIMIT_CORE, (0, 0))):
    r.setrlimit(k, v)
os.closerange(3, 1 << 20)  # nothing but stdin/stdout/stderr (e.g. not the user-namespace fd)
os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", "main.py"])
"""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot isolate on this machine; untrusted code is not run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxResult:
    """What a sandboxed program did."""

    exit_code: int
    """The program's exit status; 128 + n when it was killed by signal n (shell convention)."""
    stdout: str
    """Captured standard output (UTF-8, undecodable bytes replaced), at most `max_output_bytes`."""
    stderr: str
    """Captured standard error, at most `max_output_bytes`."""
    timed_out: bool
    """True when the wall-clock timeout or the CPU-time limit ended the program."""
    killed_by_limit: Limit | None
    """Which limit ended the program: 'wall_time', 'cpu_time', 'output' (killed when a stream
    passed `max_output_bytes`), 'memory' (best effort: the program died of a MemoryError), or None."""
    truncated: bool
    """True when stdout or stderr was cut at `max_output_bytes`."""
    wall_s: float
    """Seconds from start to the end of the sandbox."""

    @property
    def ok(self) -> bool:
        """Exited with status 0 within every limit."""
        return self.exit_code == 0 and self.killed_by_limit is None


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 32,
    disk_mb: int = 32,
    max_output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox (see the module docstring) and capture what it did.

    `timeout_s` is wall-clock time (also the CPU-time limit, rounded up); `memory_mb` is the address
    space of each process; `max_processes` counts threads too; `disk_mb` is the size of the
    writable working directory and the largest file; each output stream keeps `max_output_bytes`.
    Raises `SandboxUnavailable` when isolation is not available here.
    """
    _check_limits(timeout_s, memory_mb, max_processes, disk_mb, max_output_bytes)
    reason = _unavailable_reason()
    if reason is not None:
        raise SandboxUnavailable(reason)
    limits = (math.ceil(timeout_s), memory_mb << 20, disk_mb << 20, max_processes, MAX_OPEN_FILES)
    return _run(code, stdin, timeout_s=timeout_s, limits=limits, disk_mb=disk_mb, cap=max_output_bytes)


def sandbox_available() -> bool:
    """True when `run_python` can isolate code here (bwrap found and its self-check passed; cached)."""
    return _unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the sandbox cannot run here (with the fix), or None when it can."""
    return _unavailable_reason()


@functools.cache
def _unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the code sandbox needs Linux (bubblewrap namespaces); this is {sys.platform}"
    if _bwrap() is None:
        return f"bubblewrap (bwrap) is not installed; install it: {INSTALL_HINT}"
    try:
        probe = _run(
            "print('sandbox-ok')",
            "",
            timeout_s=20.0,
            limits=(20, 256 << 20, 1 << 20, 16, 16),
            disk_mb=1,
            cap=4096,
        )
    except (OSError, subprocess.SubprocessError) as e:
        detail = f"{type(e).__name__}: {e}"
    else:
        if probe.exit_code == 0 and probe.stdout == "sandbox-ok\n":
            return None
        detail = f"exit {probe.exit_code}: {probe.stderr.strip()[-300:]!r}"
    return (
        f"bubblewrap failed its self-check ({detail}); it needs user namespaces (sysctl "
        "kernel.unprivileged_userns_clone=1, or on Ubuntu >= 23.10 kernel.apparmor_restrict_unprivileged_userns=0; "
        f"in a container: one that allows them); bubblewrap itself: {INSTALL_HINT}"
    )


def _bwrap() -> str | None:
    return shutil.which("bwrap") or shutil.which("bwrap", path=_SYS_PATH)


def _check_limits(timeout_s: float, memory_mb: int, max_processes: int, disk_mb: int, cap: int) -> None:
    checks = {
        "timeout_s": (timeout_s, timeout_s > 0),
        "memory_mb": (memory_mb, memory_mb >= 64),
        "max_processes": (max_processes, max_processes >= 4),
        "disk_mb": (disk_mb, disk_mb >= 1),
        "max_output_bytes": (cap, cap >= 1),
    }
    minimum = {"timeout_s": "> 0", "memory_mb": ">= 64", "max_processes": ">= 4"}
    for name, (value, ok) in checks.items():
        if not ok:
            raise ValueError(f"run_python {name}={value!r}: must be {minimum.get(name, '>= 1')}")


def _interpreter_dirs(python: str) -> list[str]:
    """Directories to bind read-only so `python -I -S` starts: its prefixes, unless under /usr."""
    dirs = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(python))}
    keep = sorted(os.path.realpath(d) for d in dirs if d)
    keep = [d for d in keep if d != "/" and not (d == "/usr" or d.startswith("/usr/"))]
    return [d for i, d in enumerate(keep) if not any(d.startswith(p + "/") or d == p for p in keep[:i])]


def _bwrap_argv(bwrap: str, python: str, code_fd: int, identity: list[str], *, disk_mb: int) -> list[str]:
    argv = [bwrap, *identity, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            argv += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            argv += ["--ro-bind", name, name]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        argv += ["--ro-bind-try", path, path]
    for path in _interpreter_dirs(python):
        argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--perms", "0700", "--size", str(disk_mb << 20), "--tmpfs", WORKDIR]
    argv += ["--file", str(code_fd), f"{WORKDIR}/main.py", "--remount-ro", "/", "--chdir", WORKDIR]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "TMPDIR": WORKDIR}
    argv += ["--clearenv"] + [a for k, v in env.items() for a in ("--setenv", k, v)]
    return argv


def _identity(stack: contextlib.ExitStack) -> tuple[list[str], dict]:
    """bwrap's user-namespace arguments and Popen keywords: the program must not run as host root.

    As a normal user, bwrap's own new user namespace maps SANDBOX_UID to that user. As root it would
    map it to root, for whom the kernel ignores RLIMIT_NPROC; so bwrap runs as HOST_UID instead, in a
    user namespace prepared by `_root_mode_userns` (root must stay mapped there so that bwrap can
    bind an interpreter that only root can reach, e.g. under /root).
    """
    uid = str(SANDBOX_UID)
    if os.geteuid() != 0:
        return ["--unshare-user", "--disable-userns", "--uid", uid, "--gid", uid], {"pass_fds": ()}
    fd = _root_mode_userns()
    stack.callback(os.close, fd)
    # --gid equal to bwrap's own gid: bwrap 0.8 calls setuid before setgid under --userns, so it must
    # not try to change the gid (the map shows HOST_UID's group as SANDBOX_UID inside anyway).
    args = ["--userns", str(fd), "--uid", uid, "--gid", str(HOST_UID)]
    return args, {"user": HOST_UID, "group": HOST_UID, "extra_groups": [], "pass_fds": (fd,)}


def _root_mode_userns() -> int:
    """An fd to a new user namespace owned by HOST_UID, mapping 0 -> 0 and SANDBOX_UID -> HOST_UID,
    in which no further user namespace can be created (as bwrap's --disable-userns)."""
    unshare, nsenter = shutil.which("unshare", path=_SYS_PATH), shutil.which("nsenter", path=_SYS_PATH)
    if unshare is None or nsenter is None:
        raise OSError("unshare/nsenter (util-linux) not found; install util-linux")
    mine = os.readlink("/proc/self/ns/user")
    holder = subprocess.Popen(
        [unshare, "--user", "--", "sleep", "30"],
        user=HOST_UID,
        group=HOST_UID,
        extra_groups=[],
        env={"PATH": _SYS_PATH},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ns = f"/proc/{holder.pid}/ns/user"
        deadline = time.monotonic() + 5.0
        while os.readlink(ns) == mine:
            if holder.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"'unshare --user' as uid {HOST_UID} failed (exit {holder.poll()})")
            time.sleep(0.0005)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{SANDBOX_UID} {HOST_UID} 1\n")
        no_more = "echo 0 > /proc/sys/user/max_user_namespaces"
        done = subprocess.run(
            [nsenter, f"--user={ns}", "--", "/bin/sh", "-c", no_more], capture_output=True, env={}, timeout=10
        )
        if done.returncode != 0:
            raise OSError(f"could not forbid nested user namespaces: {done.stderr.decode(errors='replace')}")
        return os.open(ns, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()


def _run(
    code: str, stdin: str, *, timeout_s: float, limits: tuple[int, ...], disk_mb: int, cap: int
) -> SandboxResult:
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        stdin_file = stack.enter_context(tempfile.TemporaryFile())
        stdin_file.write(stdin.encode("utf-8", errors="surrogatepass"))
        stdin_file.seek(0)
        proc, info_read = _spawn(stack, code, stdin_file, limits=limits, disk_mb=disk_mb)
        out, err, limit = _communicate(proc, info_read, deadline=start + timeout_s, cap=cap)
    stderr = err[:cap].decode("utf-8", errors="replace")
    exit_code, limit = _classify(proc.returncode, stderr, limit)
    return SandboxResult(
        exit_code=exit_code,
        stdout=out[:cap].decode("utf-8", errors="replace"),
        stderr=stderr,
        timed_out=limit in ("wall_time", "cpu_time"),
        killed_by_limit=limit,
        truncated=len(out) > cap or len(err) > cap,
        wall_s=time.monotonic() - start,
    )


def _spawn(
    stack: contextlib.ExitStack, code: str, stdin: Any, *, limits: tuple[int, ...], disk_mb: int
) -> tuple[subprocess.Popen, int]:
    """Start bwrap running `code` as main.py under the launcher's `limits`, stdout and stderr piped;
    `stdin` is a file or subprocess.PIPE. Returns bwrap and the read end of its --info-fd (both
    stay usable until `stack` closes)."""
    bwrap = _bwrap()
    assert bwrap is not None
    python = os.path.realpath(sys.executable)
    code_file = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 - closed with `stack`
    code_file.write(code.encode("utf-8", errors="surrogatepass"))
    code_file.seek(0)
    info_read, info_write = os.pipe()  # bwrap reports the sandbox's pid 1 here
    stack.callback(os.close, info_read)
    identity, popen_kw = _identity(stack)
    argv = _bwrap_argv(bwrap, python, code_file.fileno(), identity, disk_mb=disk_mb)
    argv += ["--info-fd", str(info_write), "--", python, "-I", "-S", "-B", "-c", _LAUNCHER, *map(str, limits)]
    popen_kw["pass_fds"] = (code_file.fileno(), info_write, *popen_kw["pass_fds"])
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": _SYS_PATH, "LANG": "C.UTF-8"},
            **popen_kw,
        )
    finally:
        os.close(info_write)
    return proc, info_read


def _classify(status: int, stderr: str, limit: Limit | None) -> tuple[int, Limit | None]:
    """bwrap's exit status as the program's exit code, and the limit that ended it (cpu_time and
    memory are read from the status and the stderr tail)."""
    exit_code = 128 - status if status < 0 else status  # bwrap itself killed: 128 + signal
    if limit is None and exit_code == 128 + signal.SIGXCPU:
        limit = "cpu_time"
    if limit is None and exit_code != 0 and stderr.rstrip().rpartition("\n")[2].startswith("MemoryError"):
        limit = "memory"
    return exit_code, limit


class _Killer:
    """Kills a sandbox so that nothing of it survives.

    Normally: SIGKILL to its pid 1, learnt from bwrap's --info-fd and pinned by a pidfd (the kernel
    kills every process of the pid namespace before that pid 1 is reaped, and bwrap exits only after
    reaping it). Before bwrap has reported it (still setting up, e.g. on a loaded machine): stop
    bwrap, kill its children, then bwrap. Killing bwrap alone there can strand its child, which
    waits forever for a setup signal that never comes.
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.pidfd, self.info = proc, None, bytearray()

    def learn(self, chunk: bytes) -> None:
        """Read bwrap's --info-fd JSON; pin its child-pid with a pidfd (immune to pid reuse)."""
        self.info += chunk
        if self.pidfd is not None:
            return
        with contextlib.suppress(ValueError, KeyError, OSError):
            self.pidfd = os.pidfd_open(json.loads(self.info)["child-pid"])

    def kill(self) -> None:
        if self.pidfd is None:
            self.kill_tree()
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def kill_tree(self) -> None:
        """Stop bwrap, kill its children (pinned by pidfds), then bwrap."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)  # a stopped bwrap starts no new child
        _wait_stopped(self.proc.pid)  # SIGSTOP is asynchronous: a clone() under way ends first
        children = []
        for pid in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                children.append(os.pidfd_open(pid))
        self.proc.kill()
        for pidfd in children:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)

    def reap(self) -> None:
        """Wait for bwrap; if it still runs (after an error, or a sandbox that ignored its pid 1's
        death), kill the tree first. Then release the pidfd."""
        if self.proc.poll() is None:
            self.kill_tree()
            self.proc.wait()
        if self.pidfd is not None:
            os.close(self.pidfd)


def _wait_stopped(pid: int, timeout_s: float = 1.0) -> None:
    """Wait until `pid` is stopped or dead (at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return  # gone
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.0005)


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc/*/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if int(stat.rpartition(")")[2].split()[1]) == pid:  # fields after "(comm)": state, ppid
                found.append(int(entry))
    return found


def _communicate(
    proc: subprocess.Popen, info_fd: int, *, deadline: float, cap: int
) -> tuple[bytes, bytes, Limit | None]:
    """Read stdout and stderr to EOF (keeping at most cap + 1 bytes each) and bwrap's info; kill the
    sandbox at the deadline or when a stream passes cap. Returns once bwrap has exited."""
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    killer, limit = _Killer(proc), None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in (out_fd, err_fd, info_fd):
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map().keys() - {info_fd}:
                now = time.monotonic()
                if limit is None and now >= deadline:
                    limit, deadline = "wall_time", now + _KILL_GRACE_S
                    killer.kill()
                elif limit is not None and now >= deadline:
                    break  # killed, yet the pipes stay open: give up on them rather than hang
                for key, _ in selector.select(timeout=deadline - now):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                    elif key.fd == info_fd:
                        killer.learn(chunk)
                    else:
                        buffer = buffers[key.fd]
                        buffer += chunk[: cap + 1 - len(buffer)]
                        if limit is None and len(buffer) > cap:
                            limit, deadline = "output", time.monotonic() + _KILL_GRACE_S
                            killer.kill()
        try:  # the pipes are closed; bwrap exits once every process of the sandbox is gone
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            limit = limit or "wall_time"
            killer.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_KILL_GRACE_S)
    finally:
        killer.reap()
        proc.stdout.close()
        proc.stderr.close()
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), limit
