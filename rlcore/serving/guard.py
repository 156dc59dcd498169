"""What every rlcore HTTP server checks before a request reaches its routes: the `Host` it was sent to, the
type of its body, the size of its body, and the caller's key.

    app = guarded(create_app(...), Guard(hosts=local_hosts("127.0.0.1"), content_types=JSON_ONLY,
                                         max_body_bytes=8 << 20, key=Key("X-API-Key", "tml-..."),
                                         flags=GuardFlags(hosts="--allowed-hosts", body="--max-body-mb",
                                                          key="--api-key")),
                  refuse=lambda status, message: {"detail": message})

Each check answers a threat a server on a developer's machine meets:
- **Host**: a web page the user visits can make the browser send requests to `127.0.0.1` through a name
  it controls (DNS rebinding). Such a request carries that name in `Host`; only the bound address,
  `localhost` and `127.0.0.1` (and the names a flag adds) are served. A 421 otherwise.
- **Content type**: a web page can post a `text/plain` (or form) body cross-site without a CORS
  preflight. A body whose type is not one of the server's own (JSON, or protobuf where the Tinker SDK
  sends it) is a 415 before any route reads it.
- **Body size**: `Content-Length` above the limit is a 413 before a byte is read; a chunked body is
  counted as it streams and refused with a 413 as soon as it passes the limit.
- **Key**: when the server has a key, every route requires it (compared in constant time), whatever
  the path; a 401 otherwise. The check is on the raw header, before routing, so no route can skip it.

The middleware is plain ASGI: a request refused on its headers costs no more than parsing them, and the
body (read here, within the limit) is handed to the app whole.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_ONLY = frozenset({"application/json"})
"""The content types of a JSON API (a body of another type is a 415)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Key:
    """A key every request must carry in `header`: the whole value, or (with `bearer`) what follows
    `Bearer ` up to an optional `:<rest>`."""

    header: str
    """The header's name, any case (`X-API-Key`, `Authorization`)."""
    value: str
    bearer: bool = False
    """`Authorization: Bearer <value>[:<rest>]` (the gateway's key with a session after it)."""

    def matches(self, given: str) -> bool:
        if self.bearer:
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer":
                return False
            given = token.strip().partition(":")[0]
        return hmac.compare_digest(given.encode(), self.value.encode())


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardFlags:
    """The flags that change each limit, named in the refusals so the caller knows the fix."""

    hosts: str
    body: str
    key: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Guard:
    """What a server accepts (module docstring)."""

    hosts: frozenset[str]
    """Host names served, lower case, without the port (`local_hosts`)."""
    content_types: frozenset[str]
    """Media types a body may have (parameters such as `; charset=utf-8` are ignored)."""
    max_body_bytes: int
    key: Key | None
    """None: no key is asked for."""
    flags: GuardFlags


def local_hosts(bound: str, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The Host names a server bound to `bound` answers: the address itself, localhost, 127.0.0.1, ::1,
    and `extra`."""
    names = {bound, "localhost", "127.0.0.1", "::1", *extra}
    return frozenset(n.strip().strip("[]").lower() for n in names if n and n.strip())


def host_name(header: str) -> str:
    """`Host: name[:port]` (or `[v6]:port`) as the bare lower-case name."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rpartition(":")[0] if header.count(":") == 1 else header


Refuse = Callable[[int, str], dict]
"""The server's error body for a status and a one-line message (the Tinker SDK and the openai client
read different shapes)."""


def refusal(guard: Guard, scope: Scope) -> tuple[int, str] | None:
    """(status, message) for a request the guard refuses from its headers alone, else None."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
    host = host_name(headers.get("host", ""))
    if host not in guard.hosts:
        return 421, (f"Host {host!r} is not served here (DNS rebinding guard): send it to one of "
                     f"{', '.join(sorted(guard.hosts))}, or start the server with {guard.flags.hosts} {host}")  # fmt: skip
    if guard.key is not None and not guard.key.matches(headers.get(guard.key.header.lower(), "")):
        return 401, f"a missing or wrong key: send the key the server was started with ({guard.flags.key})"
    length = headers.get("content-length")
    if length is not None and (not length.strip().isdigit() or int(length) > guard.max_body_bytes):
        return 413, _too_large(guard)
    has_body = (length is not None and length.strip() != "0") or "transfer-encoding" in headers
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if has_body and media not in guard.content_types:
        return 415, (f"content type {media or 'none'!r} is not accepted: send "
                     f"{' or '.join(sorted(guard.content_types))}")  # fmt: skip
    return None


def _too_large(guard: Guard) -> str:
    return (f"the request body is over {guard.max_body_bytes} bytes: send less, or start the server with a "
            f"larger {guard.flags.body}")  # fmt: skip


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes `limit` bytes (read no further)."""
    chunks, seen = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def guarded(app: App, guard: Guard, refuse: Refuse) -> App:
    """`app` behind `guard`'s checks: a refused request gets `refuse(status, message)` as JSON. The body
    is read here, within the limit, and handed to `app` whole."""

    async def reply(send: Send, status: int, message: str) -> None:
        body = json.dumps(refuse(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        refused = refusal(guard, scope)
        if refused is not None:
            return await reply(send, *refused)
        body = await read_body(receive, guard.max_body_bytes)
        if body is None:
            return await reply(send, 413, _too_large(guard))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return middleware
