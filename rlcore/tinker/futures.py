"""Requests as futures, the way the Tinker SDK drives them: every operation is answered at once with a
request id, and the SDK long-polls `/retrieve_future` for its result. A request the SDK sends again (a
retry after a lost answer) carries the same idempotency key and gets the same request id: it never runs
twice. At most `limit` (--max-futures) are kept: past it the oldest finished result is dropped, and a request
that would make more than `limit` wait to run is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Hashable
from typing import Any

from rlcore.tinker.errors import UserError

KEEP_S = 600.0
"""How long a finished result stays retrievable after it finished (the SDK fetches it at once)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request: a protobuf body, a JSON body, or a failure ("user" or "server" category)."""

    proto: bytes | None = None
    json: dict[str, Any] | None = None
    error: str | None = None
    category: str = "user"


class Futures:
    """Request ids, their idempotency keys, and their results (thread-safe: the worker finishes them,
    the HTTP handlers wait on them)."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._keys: dict[Hashable, str] = {}
        self._key_of: dict[str, Hashable] = {}
        self._results: dict[str, tuple[Result, float]] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._open: set[str] = set()

    def open(self, key: Hashable | None) -> tuple[str, bool]:
        """(the request id of `key`, whether it is new); a repeated key returns the first id, not new."""
        with self._lock:
            if key is not None and key in self._keys:
                return self._keys[key], False
            self._make_room()
            request_id = f"req-{next(self._ids)}"
            if key is not None:
                self._keys[key] = request_id
                self._key_of[request_id] = key
            self._open.add(request_id)
            return request_id, True

    def finish(self, request_id: str, result: Result) -> None:
        with self._lock:
            self._open.discard(request_id)
            self._results[request_id] = (result, time.monotonic())
            waiters = self._waiters.pop(request_id, [])
            self._expire()
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._open or request_id in self._results

    async def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None if it is not done within `timeout` seconds (the SDK then polls again)."""
        event = asyncio.Event()
        with self._lock:
            if request_id in self._results:
                return self._results[request_id][0]
            self._waiters.setdefault(request_id, []).append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        with self._lock:
            kept = self._results.get(request_id)
        return kept[0] if kept is not None else Result(error=self.gone(request_id))

    def gone(self, request_id: str) -> str:
        """Why `request_id` is not known (one line)."""
        return (f"unknown request {request_id}: results are kept {KEEP_S / 60:g} minutes, the newest {self.limit} of "
                "them (--max-futures); fetch results as they finish, or start the server with a larger --max-futures")  # fmt: skip

    def _make_room(self) -> None:
        """Drop the oldest finished results past the limit; a UserError if the waiting requests fill it."""
        self._expire()
        while self._results and len(self._open) + len(self._results) >= self.limit:
            self._drop(next(iter(self._results)))
        if len(self._open) >= self.limit:
            raise UserError(f"{len(self._open)} requests wait to run, this server's limit: wait for their results, "
                            "or start the server with a larger --max-futures")  # fmt: skip

    def _drop(self, request_id: str) -> None:
        del self._results[request_id]
        self._keys.pop(self._key_of.pop(request_id, None), None)

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (_, t) in self._results.items() if now - t > KEEP_S]:
            self._drop(request_id)
