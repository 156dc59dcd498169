"""The gateway is local-only by construction: every route needs its key, whatever the path form; a foreign
Host, a body that is not JSON, an oversized body and an oversized `n` are refused before any sampling; a
refused request is never recorded; and during a real `train.py --rollout.agent` run, another local process
that guesses session names gets 401s and changes nothing the run trains on."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

import openai
import pytest

from rlcore.gateway import Gateway
from rlcore.models import load_policy
from rlcore.rollout import NativeEngine
from rlcore.trainer.logger import read_metrics
from tests.gateway.test_agent_train import RUN, agent
from tests.smoke.test_train import ok, train

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

KEY = "k3y"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": "m", "prompt": [1, 5, 72], "max_tokens": 2}
ROUTES = {"/v1/completions": TEXT, "/v1/chat/completions": CHAT, "/v1/models": None}
ROUTES |= {f"/s/sess{path}": body for path, body in ROUTES.items()}
"""Every route in both path forms (/v1/... and /s/<session>/v1/...), with a body that would be served."""


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = load_policy("builtin:tiny")
    return NativeEngine(model, tokenizer), tokenizer


@pytest.fixture(scope="module")
def gw(engine):
    with Gateway(*engine, key=KEY, max_context=256) as gateway:
        yield gateway


def request(gw, method: str, path: str, body: dict | bytes | None = None, **headers: str) -> tuple[int, dict]:
    """(status, JSON body) of one raw HTTP request on a fresh connection (`http.client`: no client-side
    checks); `headers` with `_` for `-` (`Content_Type`); a dict body is sent as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=20)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent |= {name.replace("_", "-"): value for name, value in headers.items()}
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def call(gw, path: str, **headers: str) -> tuple[int, dict]:
    body = ROUTES[path]
    return request(gw, "GET" if body is None else "POST", path, body, **headers)


def assert_serves(gw) -> None:
    """The server still answers a good request (and records it, taken here)."""
    status, body = request(gw, "POST", "/v1/completions", TEXT, Authorization=f"Bearer {KEY}:alive")
    assert status == 200 and body["object"] == "text_completion", body
    assert len(gw.take("alive")) == 1 and gw.sessions() == []


def test_a_missing_or_wrong_key_is_a_401_on_every_route_in_both_path_forms_and_records_nothing(gw):
    bad = {"missing": {}, "wrong": {"Authorization": "Bearer nope"},
           "wrong, a session": {"Authorization": "Bearer nope:sess"},
           "a session alone": {"Authorization": "Bearer sess"},
           "the key, not bearer": {"Authorization": KEY}}  # fmt: skip
    got = {(path, what): call(gw, path, **headers) for path in ROUTES for what, headers in bad.items()}
    statuses = {case: status for case, (status, _) in got.items()}
    assert statuses == dict.fromkeys(got, 401)
    assert {body["error"]["type"] for _, body in got.values()} == {"authentication_error"}
    assert gw.sessions() == []
    for base in (gw.base_url, gw.url_for("sess")):  # the openai client raises its usual error
        for key in ("nope", "nope:sess"):
            c = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=20)
            with pytest.raises(openai.AuthenticationError):
                c.completions.create(model="m", prompt=[1, 5], max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
    assert gw.sessions() == []
    assert_serves(gw)


def test_the_right_key_works_in_both_path_forms(gw):
    c = openai.OpenAI(base_url=gw.base_url, api_key=f"{KEY}:s1", max_retries=0, timeout=20)
    c.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=2)
    c.completions.create(model="m", prompt=[1, 5], max_tokens=2)
    assert [m.id for m in c.models.list().data] == ["rlcore"]
    assert len(gw.take("s1")) == 2
    for key in (KEY, f"{KEY}:other"):  # the path's session wins over the bearer's
        p = openai.OpenAI(base_url=gw.url_for("s2"), api_key=key, max_retries=0, timeout=20)
        p.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=2)
        assert [m.id for m in p.models.list().data] == ["rlcore"]
    assert len(gw.take("s2")) == 2 and gw.sessions() == []


def test_a_foreign_host_is_refused_even_with_the_key(gw):
    auth = f"Bearer {KEY}:h"
    for host in ("evil.example", f"evil.example:{gw.port}", "127.0.0.1.nip.io", "localhost.evil.example"):
        for path in ("/v1/completions", "/s/sess/v1/completions", "/v1/models"):
            status, body = call(gw, path, Host=host, Authorization=auth)
            assert status == 421 and "allowed_hosts" in body["error"]["message"], (host, path, status, body)
            assert_serves(gw)
    assert gw.sessions() == []
    for host in (f"localhost:{gw.port}", f"127.0.0.1:{gw.port}", "localhost"):
        assert call(gw, "/v1/completions", Host=host, Authorization=auth)[0] == 200
    assert len(gw.take("h")) == 3


def test_a_named_host_is_served_when_allowed(engine):
    with Gateway(*engine, key=KEY, max_context=256, allowed_hosts=("agents.internal",)) as named:
        auth = f"Bearer {KEY}:named"
        host = f"agents.internal:{named.port}"
        assert call(named, "/v1/completions", Host=host, Authorization=auth)[0] == 200
        assert call(named, "/v1/completions", Host="evil.example", Authorization=auth)[0] == 421
        assert len(named.take("named")) == 1


def test_a_body_that_is_not_json_is_refused(gw):
    """A web page can post these cross-site without a CORS preflight."""
    auth = f"Bearer {KEY}:ct"
    as_json = json.dumps(TEXT).encode()
    for content_type, body in (("text/plain", as_json), ("text/plain;charset=UTF-8", as_json),
                               ("application/x-www-form-urlencoded", b"prompt=hi&model=m"),
                               ("multipart/form-data; boundary=x", b"--x--\r\n")):  # fmt: skip
        for path in ("/v1/completions", "/s/ct/v1/completions"):
            status, reply = request(gw, "POST", path, body, Content_Type=content_type, Authorization=auth)
            assert status == 415 and reply["error"]["type"] == "invalid_request_error", (content_type, status)
            assert gw.sessions() == []
            assert_serves(gw)


def test_a_body_over_the_limit_is_a_413(gw):
    auth = f"Bearer {KEY}:big"
    limit = 16 << 20
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=20)  # Content-Length: refused unread
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Content-Length", str(limit + 1)),
                        ("Authorization", auth)):  # fmt: skip
        conn.putheader(name, value)
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "max_body_bytes" in json.loads(response.read())["error"]["message"]
    conn.close()
    assert_serves(gw)
    assert chunked(gw, limit + (1 << 20), auth) == 413  # chunked: counted as it streams
    assert gw.sessions() == []
    assert_serves(gw)


def chunked(gw, size: int, auth: str) -> int:
    """The status of a chunked POST of `size` bytes, stopped as soon as the server answers."""
    import select

    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=20)
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Transfer-Encoding", "chunked"),
                        ("Authorization", auth)):  # fmt: skip
        conn.putheader(name, value)
    conn.endheaders()
    piece = b" " * (256 << 10)
    try:
        for _ in range(size // len(piece)):
            if select.select([conn.sock], [], [], 0)[0]:
                break  # the server answered before the end of the body
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        else:
            conn.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server closed its side after answering
    try:
        return conn.getresponse().status
    finally:
        conn.close()


def test_n_over_the_limit_is_a_400_naming_it(gw):
    for path in ("/v1/completions", "/s/n/v1/completions"):
        status, body = request(gw, "POST", path, TEXT | {"n": 65}, Authorization=f"Bearer {KEY}:n")
        assert status == 400 and body["error"]["param"] == "n" and "max_n" in body["error"]["message"], body
    assert gw.sessions() == []
    assert_serves(gw)
    most = TEXT | {"n": 64, "max_tokens": 1}
    status, _ = request(gw, "POST", "/v1/completions", most, Authorization=f"Bearer {KEY}:n")
    assert status == 200 and len(gw.take("n")) == 64


# ------------------------------------------------------------------ another local process during a real run


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (/proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.isdigit():
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports `pids` listen on (their sockets' inodes in /proc/net/tcp, state 0A = LISTEN)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    rows = [line.split() for line in lines]
    return {int(f[1].rpartition(":")[2], 16) for f in rows if f[3] == "0A" and f[9] in inodes}


def attacks() -> list[tuple[str, dict, dict]]:
    """(path, body, headers) of what another local process can send without the run's key: no key, the
    sessions the old naming scheme gave (e{step}-p{i}-s{j}), in both path forms."""
    guessed = [f"e{e}-p{p}-s{s}" for e in range(4) for p in range(4) for s in range(4)]
    out = [("/v1/chat/completions", CHAT, {h: v}) for h, v in (("X-No-Key", ""), ("Authorization", "Bearer rlcore"))]
    out += [("/v1/chat/completions", CHAT, {"Authorization": f"Bearer {g}"}) for g in guessed[::5]]
    out += [(f"/s/{g}/v1/chat/completions", CHAT, {"Authorization": "Bearer rlcore"}) for g in guessed]
    return out + [(f"/s/{g}/v1/completions", TEXT, {}) for g in guessed[::3]]


def test_a_local_process_that_guesses_sessions_during_a_real_run_gets_401s_and_changes_nothing(tmp_path):
    # one episode at a time: the engine's batches, and so the run, do not depend on timing
    args = [*RUN, *agent("two_turns"), "--rollout.agent-concurrency", "1", "--trainer.steps", "1",
            "--data.builtin-val-size", "4"]  # fmt: skip
    ok(train(*args, out=tmp_path / "quiet"))
    done: list = []
    run = threading.Thread(target=lambda: done.append(train(*args, out=tmp_path / "attacked")))
    run.start()
    ports: set[int] = set()
    while run.is_alive() and not ports:
        ports = listening_ports(descendants(os.getpid()))
        time.sleep(0.01)
    assert len(ports) == 1, ports  # the run's gateway
    target = type("Target", (), {"port": ports.pop()})
    statuses: list[int] = []
    while run.is_alive():
        for path, body, headers in attacks():
            try:
                statuses.append(request(target, "POST", path, body, **headers)[0])
            except OSError:  # the run ended and its gateway with it
                break
        time.sleep(0.05)  # rounds all through the run, leaving the run most of the CPU
    run.join()
    ok(done[0])
    assert len(statuses) >= len(attacks()) and set(statuses) == {401}, sorted(set(statuses))
    quiet, attacked = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("quiet", "attacked"))
    skip = ("timing/", "perf/", "throughput/")
    assert [{k: v for k, v in r.items() if not k.startswith(skip)} for r in attacked] == [
        {k: v for k, v in r.items() if not k.startswith(skip)} for r in quiet
    ]
