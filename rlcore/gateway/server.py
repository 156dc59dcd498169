"""An OpenAI-compatible HTTP endpoint in front of a rollout engine, recording token-exact trajectories.

    with Gateway(engine, tokenizer) as gw:                      # uvicorn on 127.0.0.1, a free port
        client = openai.OpenAI(base_url=gw.base_url, api_key="episode-17")
        client.chat.completions.create(model="any", messages=[...], n=2, logprobs=True)
        calls = gw.take("episode-17")                           # [Call(prompt_ids, ids, logprobs, ...)]
        gw.version = 3                                          # after a weight push: later calls say 3

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (a text or token-id prompt), `GET
/v1/models` (any `model` name is accepted). Sampling fields: `n`, `temperature`, `top_p`, `max_tokens` /
`max_completion_tokens` (clamped to the context's room), `stop`, `seed`, `logprobs`, `tools` /
`tool_choice` (schemas rendered by the chat template; tool calls parsed from the completion into
`tool_calls`, `finish_reason: "tool_calls"`; "required" or a named function is not enforced, since
forcing would sample from another distribution than the policy's). Not supported (400): `stream`,
`top_logprobs` > 0, `echo`. Every engine call goes through `rlcore.gateway.batcher.Batcher` (continuous
batching on one engine thread) and is recorded as a `Call` under the request's session.

The session (one trajectory, e.g. one agent episode) travels in what a stock `openai` client sends:
- the API key: `OpenAI(api_key="<session>", base_url="http://127.0.0.1:PORT/v1")`, i.e.
  `Authorization: Bearer <session>`;
- or the base URL: `OpenAI(api_key="unused", base_url="http://127.0.0.1:PORT/s/<session>/v1")`
  (`Gateway.url_for(session)`); the path wins over the key.
Sessions are 1-128 characters of `[A-Za-z0-9._-]`.

Who may call it. Every request passes `rlcore.serving.guard` before any route (a refusal has OpenAI's
error body, so `openai` raises its usual `AuthenticationError` / `BadRequestError`...):
- **Key.** With a server `key`, every route in both path forms (`/v1/...`, `/s/<session>/v1/...`,
  `/v1/models` too) needs `Authorization: Bearer <key>:<session>`, or `Bearer <key>` (any `:<rest>`
  ignored) with the session in the path; a missing or wrong key is a 401, and nothing is recorded.
  Without one (`Gateway(engine, tokenizer)`), the bearer is the session, and any process on the machine
  can record calls under any session: that mode trusts every local process. The trainer's agent engine
  (`rlcore.gateway.agents`) always sets a random key, and random session names.
- **Host.** Only a `Host` of the bound address, `localhost`, `127.0.0.1` or `::1` (and `allowed_hosts`)
  is served, a 421 otherwise: a web page cannot reach the gateway through a name it rebinds to 127.0.0.1.
- **Content type.** A body must be `application/json` (a 415 otherwise): a page can post `text/plain` or a
  form cross-site without a CORS preflight, but not JSON (that needs a preflight, never answered here).
- **Limits.** A body over `max_body_bytes` (16 MiB) is a 413, from its Content-Length or as a chunked
  body streams; `n` over `max_n` (64) is a 400 naming it; `max_tokens` is clamped to the context's room.

Why FastAPI on uvicorn: a well-kept ASGI stack (HTTP/1.1 parsing, keep-alive, pydantic validation)
rather than a hand-written HTTP parser; the app itself stays a thin adapter: it validates, translates
(`rlcore.gateway.translate`) and forwards to the batcher, and owns no training logic. It binds
127.0.0.1 by default: the endpoint is for agents on the training host (binding another address serves
the network, with the same checks: give it a key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlcore.data.prompts import pad_token_id
from rlcore.gateway.batcher import Batcher
from rlcore.gateway.record import Call
from rlcore.gateway.schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    error_body,
    on_api_error,
    on_validation_error,
)
from rlcore.gateway.translate import (
    SamplingLimits,
    chat_choice,
    chat_prompt,
    refuse_unsupported,
    sampling_of,
    text_choice,
    text_prompt,
    usage,
    uses_tools,
)
from rlcore.models.policy import context_length
from rlcore.rollout.agent.chat import TOOL_CALL_FORMATS
from rlcore.rollout.base import RolloutEngine, SamplingParams
from rlcore.serving.guard import JSON_ONLY, Guard, GuardFlags, Key, guarded, local_hosts

log = logging.getLogger(__name__)

_SESSION = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Served:
    """What the app serves with (`app.state.served`)."""

    batcher: Batcher
    tokenizer: Any
    limits: SamplingLimits
    model_name: str = "rlcore"
    key: str | None = None
    """The server key; None: any bearer is a session."""
    call_format: str = "hermes"
    """The model's tool-call format (`rlcore.rollout.agent.chat.TOOL_CALL_FORMATS`)."""


def _served(request: Request) -> Served:
    return request.app.state.served


def _bearer_session(request: Request, served: Served) -> str:
    """The bearer's session part: the whole token without a server key, what follows `<key>:` with one (the
    key itself is checked before routing, `rlcore.serving.guard`)."""
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    return token if served.key is None else token.partition(":")[2]


def session_of(request: Request) -> str:
    """The request's session: the `/s/<session>/v1` path, else the bearer (see the module docstring)."""
    session = request.path_params.get("session") or _bearer_session(request, _served(request))
    if not _SESSION.fullmatch(session or ""):
        raise ApiError(401, "no valid session: send Authorization: Bearer <session> (<key>:<session> with a "
                            "server key; 1-128 of [A-Za-z0-9._-]) or use the base URL /s/<session>/v1", None,
                       "authentication_error")  # fmt: skip
    return session


router = APIRouter()


async def _sample(
    served: Served, session: str, prompt: list[int], body: Any, field: str
) -> tuple[Any, list[Call]]:
    refuse_unsupported(body)
    sampling = sampling_of(body, len(prompt), served.limits, field=field)
    calls = await asyncio.wrap_future(served.batcher.submit(session, prompt, sampling))
    return sampling, calls


def _envelope(
    kind: str, body: Any, choices: list[dict[str, Any]], prompt: list[int], calls: list[Call]
) -> dict:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": body.model, "choices": choices, "usage": usage(len(prompt), calls),
            "system_fingerprint": None}  # fmt: skip


@router.post("/chat/completions")
async def chat_completions(body: ChatBody, request: Request, session: str = Depends(session_of)) -> dict:
    served = _served(request)
    prompt = chat_prompt(served.tokenizer, body)
    sampling, calls = await _sample(served, session, prompt, body, "messages")
    fmt = TOOL_CALL_FORMATS[served.call_format] if uses_tools(body) else None
    choices = [chat_choice(i, c, served.tokenizer, sampling, tool_format=fmt, logprobs=bool(body.logprobs))
               for i, c in enumerate(calls)]  # fmt: skip
    return _envelope("chat.completion", body, choices, prompt, calls)


@router.post("/completions")
async def completions(body: CompletionBody, request: Request, session: str = Depends(session_of)) -> dict:
    served = _served(request)
    prompt = text_prompt(served.tokenizer, body)
    sampling, calls = await _sample(served, session, prompt, body, "prompt")
    choices = [text_choice(i, c, served.tokenizer, sampling, logprobs=body.logprobs is not None)
               for i, c in enumerate(calls)]  # fmt: skip
    return _envelope("text_completion", body, choices, prompt, calls)


@router.get("/models")
async def models(request: Request) -> dict:
    model = {"id": _served(request).model_name, "object": "model", "created": 0, "owned_by": "rlcore"}
    return {"object": "list", "data": [model]}


async def _on_crash(request: Request, exc: Exception) -> JSONResponse:
    """An unexpected failure (the engine raised): a 500 with one log line, never a traceback to the client."""
    log.error("gateway: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", None, "server_error"), 500)


def create_app(served: Served) -> FastAPI:
    """The FastAPI app: the routes under `/v1` and `/s/{session}/v1`, OpenAI-shaped errors."""
    app = FastAPI(title="rlcore gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/s/{session}/v1")
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, _on_crash)
    return app


MAX_BODY_BYTES = 16 << 20
"""A request body's default bound: a 128k-token conversation is well under 1 MiB of JSON."""

FLAGS = GuardFlags(hosts="Gateway(allowed_hosts=...) naming", body="Gateway(max_body_bytes=...)",
                   key="Gateway(key=...); under train.py --rollout.agent, the agent's client.api_key")  # fmt: skip
"""The arguments named in the guard's refusals (the gateway has no flags of its own)."""


def refuse(status: int, message: str) -> dict[str, Any]:
    """A guard's refusal in OpenAI's error shape (`openai` raises AuthenticationError for the 401)."""
    return error_body(message, None, "authentication_error" if status == 401 else "invalid_request_error")


def guard_of(host: str, allowed_hosts: tuple[str, ...], max_body_bytes: int, key: str | None) -> Guard:
    """What the gateway accepts before routing (module docstring): JSON bodies within `max_body_bytes`, sent
    to `host`, localhost or 127.0.0.1 (or `allowed_hosts`), with the bearer `key` when there is one."""
    bearer = None if key is None else Key(header="authorization", value=key, bearer=True)
    return Guard(hosts=local_hosts(host, allowed_hosts), content_types=JSON_ONLY,
                 max_body_bytes=max_body_bytes, key=bearer, flags=FLAGS)  # fmt: skip


class Gateway:
    """The server on a background thread, with the batcher it forwards to (see the module docstring). Who may
    call it: `key` (None: every local process), `allowed_hosts` (Host names served besides the bound address,
    localhost and 127.0.0.1), `max_body_bytes` and `max_n` (samples a request)."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, *, key: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "rlcore", max_context: int | None = None,
                 default_max_tokens: int = 256, call_format: str = "hermes",
                 allowed_hosts: tuple[str, ...] = (), max_body_bytes: int = MAX_BODY_BYTES,
                 max_n: int = 64) -> None:  # fmt: skip
        if call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"call_format={call_format!r}: expected one of {', '.join(TOOL_CALL_FORMATS)}")
        if key is not None and (not key or ":" in key):
            raise ValueError("key: must be non-empty and hold no ':' (the bearer is <key>:<session>)")
        if isinstance(allowed_hosts, str):
            raise ValueError(f"allowed_hosts={allowed_hosts!r}: give a tuple of names, e.g. ({allowed_hosts!r},)")
        if max_body_bytes < 1 or max_n < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes}, max_n={max_n}: both must be >= 1")
        self.host, self.port = host, port
        limits = SamplingLimits(max_context=max_context or context_length(engine.module, tokenizer),
                               default_max_tokens=default_max_tokens, max_n=max_n)  # fmt: skip
        self._engine, self._tokenizer, self._limits = engine, tokenizer, limits
        self._options = {"key": key, "model_name": model_name, "call_format": call_format}
        self._guard = guard_of(host, tuple(allowed_hosts), max_body_bytes, key)
        self._batcher: Batcher | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Gateway:
        self._batcher = Batcher(self._engine, pad_id=pad_token_id(self._tokenizer))
        served = Served(
            batcher=self._batcher, tokenizer=self._tokenizer, limits=self._limits, **self._options
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        app = guarded(create_app(served), self._guard, refuse)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="gateway-http", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"gateway: uvicorn did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
        if self._batcher is not None:
            self._batcher.close()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`http://HOST:PORT/v1`): the session goes in the API key."""
        return f"http://{self.host}:{self.port}/v1"

    def url_for(self, session: str) -> str:
        """The base URL that carries `session` itself (`http://HOST:PORT/s/<session>/v1`)."""
        return f"http://{self.host}:{self.port}/s/{session}/v1"

    @property
    def version(self) -> int:
        """The policy version stamped on calls sampled from now on."""
        return self._batcher.version

    @version.setter
    def version(self, value: int) -> None:
        self._batcher.version = value

    def force(self, sampling: SamplingParams | None) -> None:
        """Impose the run's `sampling` on every request from now on (`rlcore.gateway.batcher.forced`: its
        temperature, top-p, top-k and min-p, `max_tokens` at most its); None: the requests' own."""
        self._batcher.forced = sampling

    def expect(self, count: Callable[[], int] | None) -> None:
        """Let each engine call wait for `count()` pending requests (the live episodes), at most
        `Batcher.linger_s` after the first; None: serve what is pending at once."""
        self._batcher.expected = count

    def drain(self) -> None:
        """Return once every request already queued is served (what timed-out episodes had in flight)."""
        self._batcher.drain()

    def sessions(self) -> list[str]:
        """The sessions with recorded calls not yet taken."""
        return self._batcher.sessions()

    def discard(self, prefix: str) -> None:
        """Forget the calls of every session whose name starts with `prefix`."""
        self._batcher.discard(prefix)

    def take(self, session: str) -> list[Call]:
        """Remove and return the calls recorded under `session`."""
        return self._batcher.take(session)
