"""How the ranks of a torchrun world meet, and how their launchers part.

    store = world_store(rank, world, timeout_s=300)   # the job's store, under a prefix only this world uses
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

torchrun keeps one key-value store for a whole job (static rendezvous: node 0's launcher hosts it at
MASTER_ADDR:MASTER_PORT; c10d: the rank-0 launcher's, beside the rendezvous store at --rdzv-endpoint) and
hands it to every world it starts. A world restarted after a lost rank must not read what the dead world
left there, and must not wait forever for a rank that never comes: `meet` gives each world a fresh name
agreed by all its ranks, within a timeout. At a clean finish the launcher that hosts the rendezvous store
must leave last (`launcher_hosts_store`, used by `rlcore.dist.mesh.leave_in_order`).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


class WorldNotFormed(RuntimeError):
    """The ranks of a world did not all meet within the rendezvous timeout (the message names the rank, the
    store and the likely cause)."""


def job_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT, without any attempt prefix: under torchrun a client of the
    launcher's store (it lives as long as the job), else rank 0 hosts it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    return dist.TCPStore(host, port, world, is_master=rank == 0 and not agent,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip


def meet(store: dist.Store, rank: int, world: int, timeout_s: float) -> str:
    """A name that every rank of this world agrees on and no earlier world used: rank 0 draws it, and gives
    it to each other rank in answer to that rank's own fresh greeting, until every rank has acknowledged it.

    torchrun keeps one store for a whole job, and a restarted world finds the keys its dead predecessor left.
    The launchers' attempt counters cannot name the world: under the c10d rendezvous a launcher whose
    ranks were still alive when the world broke restarts them without counting an attempt, so two nodes
    would count differently and wait on different keys forever. Greetings and answers are fresh random
    tokens, so a key left by a dead rank is never taken for a live one's."""
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        token = secrets.token_hex(8)
        store.set(f"rlcore/hello/{rank}", token)
        answer = f"rlcore/answer/{rank}/{token}"
        store.wait([answer], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        name = store.get(answer).decode()
        store.set(f"rlcore/ack/{name}/{rank}", "1")
        return name
    name, answered, waiting = secrets.token_hex(8), set(), set(range(1, world))
    while waiting:
        if time.monotonic() > deadline:
            raise WorldNotFormed(f"rank(s) {', '.join(map(str, sorted(waiting)))} did not arrive")
        for r in sorted(waiting):
            if store.check([f"rlcore/ack/{name}/{r}"]):
                waiting.discard(r)
            elif store.check([f"rlcore/hello/{r}"]):
                token = store.get(f"rlcore/hello/{r}").decode()
                if (r, token) not in answered:
                    store.set(f"rlcore/answer/{r}/{token}", name)
                    answered.add((r, token))
        time.sleep(0.01)
    return name


def world_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The job's store with this world's keys under a prefix only this world uses (`meet`), so a world
    restarted after a lost rank meets only its own ranks (gloo would otherwise read the addresses the
    dead world's ranks published: `connectFullMesh ... Connection refused`, or wait forever). Raises
    `WorldNotFormed` when the world does not meet within `timeout_s`; a store that never answers (a
    foreign process holding the port) is given up on after that time too, on a thread left behind."""
    done: list = []

    def connect() -> None:
        try:
            store = job_store(rank, world, timeout_s)
            done.append(dist.PrefixStore(f"rlcore/world_{meet(store, rank, world, timeout_s)}/", store))
        except (RuntimeError, dist.DistError) as e:
            done.append(e)

    thread = threading.Thread(target=connect, name="rlcore-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s + _GRACE_S)
    if done and not isinstance(done[0], Exception):
        return done[0]
    raise WorldNotFormed(_not_formed(rank, world, timeout_s, done[0] if done else None))


_GRACE_S = 5.0
"""How much longer than the rendezvous timeout a store that never answers is waited for."""


def _not_formed(rank: int, world: int, timeout_s: float, error: Exception | None) -> str:
    where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    why = "the store never answered" if error is None else str(error).strip().splitlines()[0][:160]
    return (f"rank {rank} of {world} ({rendezvous_backend()}): the world did not form within {timeout_s:g} s "
            f"through the store at {where} ({why}). Likely: another rank or node did not start or died before "
            "joining, MASTER_ADDR/MASTER_PORT (torchrun's --master-addr/--master-port or --rdzv-endpoint) is not "
            "reachable from this node, or another process holds that port; raise --trainer.rendezvous-timeout-s "
            "if nodes start slowly")  # fmt: skip


def rendezvous_backend() -> str:
    """How this world was launched, for messages: torchrun's `--rdzv-backend` (static when it names none),
    or "no torchrun" (RANK and WORLD_SIZE set in the environment)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return "no torchrun: env:// rendezvous"
    try:
        backend = _launcher_flag(os.getppid(), "--rdzv-backend")
    except OSError:
        return "torchrun"
    return f"torchrun, {backend or 'static'} rendezvous"


def launcher_hosts_store() -> bool:
    """Whether this rank's launcher (its parent, torchrun's agent) hosts the rendezvous store, which the
    launchers meet on at exit: it listens on the port of its `--rdzv-endpoint` (c10d: whichever launcher
    bound it first, not always the one of GROUP_RANK 0), or without one on MASTER_PORT (the static
    rendezvous: node 0's launcher). Read from /proc; where /proc cannot tell, GROUP_RANK 0."""
    parent = os.getppid()
    try:
        port = _endpoint_port(parent) or int(os.environ.get("MASTER_PORT", "0"))
        return port in _listening_ports(parent)
    except OSError:
        return os.environ.get("GROUP_RANK", "0") == "0"


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes matched in /proc/net/tcp and tcp6)."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = {os.readlink(fd)[8:-1] for fd in fds.iterdir() if _is_socket(fd)}
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def _is_socket(fd: Path) -> bool:
    try:
        return os.readlink(fd).startswith("socket:[")
    except OSError:  # closed while listed
        return False


def _endpoint_port(pid: int) -> int | None:
    """The port of `--rdzv-endpoint HOST:PORT` on process `pid`'s command line."""
    endpoint = _launcher_flag(pid, "--rdzv-endpoint")
    if endpoint is None:
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else 29400  # torchrun's default c10d port


def _launcher_flag(pid: int, flag: str) -> str | None:
    """The value of `flag` (`--a-b VALUE`, `--a_b VALUE` or `--a-b=VALUE`) on process `pid`'s command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    spellings = (flag, flag[:2] + flag[2:].replace("-", "_"))
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in spellings:
            return value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return None
