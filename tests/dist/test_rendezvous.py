"""`rlcore.dist.rendezvous.meet` on a real TCPStore, its ranks as threads: a world agrees on one fresh name,
a world restarted on the same store (the keys of the dead one still there, its ranks arriving in any order)
agrees on another, and a rank that never comes ends the wait with `WorldNotFormed` naming it."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from rlcore.dist.rendezvous import WorldNotFormed, meet


def _store() -> tuple[dist.TCPStore, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False), port


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _world(port: int, world: int, *, delays: dict[int, float] | None = None) -> list[str]:
    """Each rank's name from `meet`, every rank a thread with its own client (rank r starts after delays[r])."""
    names: list = [None] * world

    def rank(r: int) -> None:
        time.sleep((delays or {}).get(r, 0.0))
        names[r] = meet(_client(port), r, world, timeout_s=20)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return names


def test_a_world_agrees_on_one_name_and_a_restarted_world_on_a_new_one():
    host, port = _store()
    first = _world(port, 3)
    assert first[0] is not None and len(set(first)) == 1
    # the dead world's greetings, answers and acknowledgements stay in the store; the new world's rank 0
    # comes last, after ranks 1 and 2 greeted, and rank 2 greets only after rank 0 came
    second = _world(port, 3, delays={0: 0.5, 2: 1.0})
    assert second[0] is not None and len(set(second)) == 1 and second[0] != first[0]
    assert host.check([f"rlcore/ack/{first[0]}/1"])  # the old world's keys were there all along


def test_a_stale_greeting_is_not_taken_for_a_live_rank():
    """Rank 1 of a dead world greeted and died before its answer came: a new rank 0 answers that greeting,
    but waits for the live rank 1's own."""
    host, port = _store()
    host.set("rlcore/hello/1", "0123456789abcdef")
    names = _world(port, 2, delays={1: 0.5})
    assert names[0] is not None and names[0] == names[1]
    assert host.get("rlcore/answer/1/0123456789abcdef").decode() == names[0]  # answered, never acknowledged


def test_a_rank_that_never_comes_ends_the_wait_naming_it():
    _, port = _store()
    start = time.monotonic()
    with pytest.raises(WorldNotFormed, match=r"rank\(s\) 1, 2 did not arrive"):
        meet(_client(port), 0, 3, timeout_s=1.0)
    assert time.monotonic() - start < 5
