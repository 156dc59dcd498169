"""The shared request guard (`rlcore.serving.guard`) in front of a real uvicorn server, driven with raw HTTP
(`http.client`): every check refuses before the route runs, and the route sees the body whole."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from rlcore.serving.guard import JSON_ONLY, Guard, GuardFlags, Key, guarded, host_name, local_hosts

LIMIT = 1000
FLAGS = GuardFlags(hosts="--allowed-hosts", body="--max-body-mb", key="--api-key")


def _app(seen: list[bytes]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append(body)
        return {"bytes": len(body)}

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    return app


@contextlib.contextmanager
def _serving(guard: Guard, seen: list[bytes]) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = guarded(_app(seen), guard, lambda status, message: {"detail": message, "status": status})
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def _guard(key: Key | None = None) -> Guard:
    return Guard(
        hosts=local_hosts("127.0.0.1"), content_types=JSON_ONLY, max_body_bytes=LIMIT, key=key, flags=FLAGS
    )


def _send(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
          chunked: bool = False) -> tuple[int, dict]:  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=iter([body]) if chunked else body, headers=headers or {},
                 encode_chunked=chunked)  # fmt: skip
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def open_server() -> Iterator[tuple[int, list[bytes]]]:
    seen: list[bytes] = []
    with _serving(_guard(), seen) as port:
        yield port, seen


def test_a_json_body_within_the_limit_reaches_the_route_whole(open_server):
    port, seen = open_server
    body = json.dumps({"x": "a" * 500}).encode()
    assert _send(port, "POST", "/echo", body, JSON) == (200, {"bytes": len(body)})
    assert seen[-1] == body
    assert _send(port, "POST", "/echo", body, JSON, chunked=True) == (200, {"bytes": len(body)})
    assert _send(port, "GET", "/ping") == (200, {"ok": True})


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.2", "[::2]:80"])
def test_a_foreign_host_is_refused_before_the_route(open_server, host):
    port, seen = open_server
    before = len(seen)
    status, data = _send(port, "POST", "/echo", b"{}", {**JSON, "Host": host})
    assert status == 421 and "--allowed-hosts" in data["detail"] and host_name(host) in data["detail"]
    assert len(seen) == before


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])  # fmt: skip
def test_a_body_of_another_type_is_a_415(open_server, content_type):
    port, seen = open_server
    before = len(seen)
    headers = {"Content-Type": content_type} if content_type else {}
    status, data = _send(port, "POST", "/echo", b'{"a": 1}', headers)
    assert status == 415 and "application/json" in data["detail"]
    assert len(seen) == before


def test_a_body_over_the_limit_is_a_413_declared_or_streamed(open_server):
    port, seen = open_server
    before = len(seen)
    big = b'"' + b"a" * LIMIT + b'"'
    for chunked in (False, True):
        status, data = _send(port, "POST", "/echo", big, JSON, chunked=chunked)
        assert status == 413 and "--max-body-mb" in data["detail"]
    assert len(seen) == before
    assert _send(port, "GET", "/ping") == (200, {"ok": True})


def test_a_key_is_asked_on_every_route():
    seen: list[bytes] = []
    with _serving(_guard(Key(header="X-API-Key", value="tml-secret")), seen) as port:
        for headers in (
            {},
            {"X-API-Key": "tml-wrong"},
            {"X-API-Key": "tml-secre"},
            {"Authorization": "tml-secret"},
        ):
            assert _send(port, "GET", "/ping", None, headers)[0] == 401
            assert _send(port, "POST", "/echo", b"{}", {**JSON, **headers})[0] == 401
        assert _send(port, "GET", "/missing", None, {})[0] == 401  # before routing
        assert seen == []
        assert _send(port, "POST", "/echo", b"{}", {**JSON, "X-API-Key": "tml-secret"}) == (200, {"bytes": 2})


def test_a_bearer_key_may_carry_a_session_after_it():
    key = Key(header="Authorization", value="k1", bearer=True)
    assert key.matches("Bearer k1") and key.matches("bearer k1:episode-3")
    assert not key.matches("Bearer k2:k1") and not key.matches("k1") and not key.matches("Bearer ")
    assert not key.matches("Basic k1")


def test_host_names():
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1" and host_name("::1") == "::1"
    assert local_hosts("0.0.0.0", ("box.lan",)) >= {"0.0.0.0", "localhost", "127.0.0.1", "::1", "box.lan"}
