"""The HTTP endpoints the Tinker SDK (tinker 0.38) calls, on FastAPI and uvicorn.

Session endpoints answer at once (JSON). Training and sampling endpoints answer with a request id
(`rlcore.tinker.futures`) and hand the operation to rank 0's worker (`rlcore.tinker.ops`); the SDK then
long-polls `/retrieve_future` and gets a protobuf body (forward_backward, sample), a JSON body (the
others), or `{"error": ..., "category": "user"}`, which the SDK raises as one line. The client config
the server announces turns off the JWT exchange (a plain `tml-` key works) and parallel chunk submission
(chunks then arrive in seq_id order), and keeps the SDK's pyqwest transport (half httpx's cost a request).
A body the endpoints cannot read is a 400 with one line. Every request first passes `rlcore.serving.guard`
(`rlcore.tinker.serve` wraps the app: Host, content type, body size, key), and each request is checked against
the server's limits (`rlcore.tinker.limits`) before anything sized by it is allocated.

Not served, each refused in one line: images and audio in model inputs, top-k log-probs, targeted prompt
log-probs, prompt alternatives, stability records, sampling a base model that no training client holds.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlcore.rollout.base import SamplingParams
from rlcore.tinker import names
from rlcore.tinker.errors import UserError
from rlcore.tinker.futures import Futures, Result
from rlcore.tinker.limits import check_samples
from rlcore.tinker.ops import (
    CreateModel,
    FwdBwd,
    LoadState,
    OptimStep,
    Sampler,
    SaveForSampler,
    SaveState,
    TinkerModels,
    Worker,
)
from rlcore.tinker.sampling import SampleOp, fitted, prompt_tokens, sampling_params
from rlcore.tinker.wire import decode_forward_backward

POLL_S = 20.0
"""How long one `/retrieve_future` waits for a result before it answers try_again (the SDK waits 45 s)."""

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": True,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
"""The SDK's feature flags as this server wants them (module docstring)."""

_ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
_UNSERVED_SAMPLE = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs",
                    "record_stability_info", "prompt_logprobs_last_n")  # fmt: skip


class Api:
    """The state behind the endpoints: the futures, rank 0's worker, and what it serves."""

    def __init__(self, served: TinkerModels, supported: list[str]) -> None:
        self.served, self.supported = served, supported
        self.futures = Futures(served.options.limits.max_futures)
        self.worker = Worker(served, self.futures)

    def submit(self, key: Any, op: Any, **extra: Any) -> dict:
        """The request id of `op` (run once per idempotency `key`), as the SDK's UntypedAPIFuture."""
        request_id, new = self.futures.open(key)
        if new:
            self.worker.submit(request_id, op)
        return {"request_id": request_id, **extra}

    def failed(self, key: Any, error: UserError) -> dict:
        """A request refused before it runs, answered as a failed future (the SDK shows its line)."""
        request_id, new = self.futures.open(key)
        if new:
            self.futures.finish(request_id, Result(error=str(error), category="user"))
        return {"request_id": request_id}


def _need(body: dict, *names: str) -> list:
    missing = [n for n in names if body.get(n) is None]
    if missing:
        raise UserError(f"the request lacks {', '.join(missing)}")
    return [body[n] for n in names]


def create_app(api: Api) -> FastAPI:
    """The FastAPI app of `api` (module docstring)."""
    app = FastAPI(title="rlcore Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    for add in (_error_handlers, _session_routes, _model_routes, _training_routes, _sampling_routes,
                _future_routes):  # fmt: skip
        add(app, api)
    return app


def _error_handlers(app: FastAPI, api: Api) -> None:
    """Bad requests as 400s with a readable `detail`."""
    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    @app.exception_handler(json.JSONDecodeError)
    async def _not_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": f"{request.url.path}: the body is not JSON ({exc})"})

    @app.exception_handler(TypeError)
    @app.exception_handler(ValueError)
    async def _unreadable(request: Request, exc: Exception) -> JSONResponse:  # a field of the wrong type
        return JSONResponse(status_code=400, content={"detail": f"{request.url.path}: a field is unreadable ({exc})"})


def _session_routes(app: FastAPI, api: Api) -> None:
    """The client's configuration, health, capabilities and the session calls."""
    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": [{"model_name": m, "trainable": True, "sampleable": True} for m in api.supported]}

    @app.post("/api/v1/create_session")
    async def create_session() -> dict:
        return {"session_id": f"s-{uuid.uuid4().hex[:12]}", "type": "create_session"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat() -> dict:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict:
        return {}


def _model_routes(app: FastAPI, api: Api) -> None:
    """Training clients: create one (fresh or from a saved state), describe it, load a state into it."""
    served = api.served

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        body = await request.json()
        key = ("model", body.get("session_id"), body.get("model_seq_id"))
        try:
            (base_model,) = _need(body, "base_model")
            rank = int((body.get("lora_config") or {}).get("rank", 0))
            model_id = _model_id(body)
        except UserError as e:
            return api.failed(key, e)
        return api.submit(key, CreateModel(model_id, base_model, rank), model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        (model_id,) = _need(await request.json(), "model_id")
        model = served.model(model_id)
        data = {"model_name": model.base_model, "tokenizer_id": model.write_tokenizer(), "arch": model.arch}
        return {"model_id": model_id, "model_data": data, "is_lora": model.lora_rank > 0,
                "lora_rank": model.lora_rank, "type": "get_info"}  # fmt: skip

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        body = await request.json()
        optimizer = bool(body.get("optimizer", False))
        if body.get("model_id"):  # load_state on an existing training client
            key = ("train", body["model_id"], body.get("seq_id"))
            return api.submit(key, LoadState(body["model_id"], body.get("path", ""), optimizer, create=False))
        key = ("model", body.get("session_id"), body.get("model_seq_id"))
        try:
            model_id = _model_id(body)
        except UserError as e:
            return api.failed(key, e)
        return api.submit(key, LoadState(model_id, body.get("path", ""), optimizer, create=True), model_id=model_id)


def _training_routes(app: FastAPI, api: Api) -> None:
    """Training clients' operations: forward_backward, optim_step, save, a sampler's weights."""
    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        body = await request.body()
        try:
            fb = decode_forward_backward(body)
        except UserError as e:
            return api.failed(None, e)
        return api.submit(("train", fb.model_id, fb.seq_id), FwdBwd(fb))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        body = await request.json()
        key = ("train", body.get("model_id"), body.get("seq_id"))
        params = {**_ADAM, **(body.get("adam_params") or {})}
        if body.get("optimizer_params") is not None:
            return api.failed(key, UserError("only Adam is served: pass AdamParams to optim_step"))
        return api.submit(key, OptimStep(body.get("model_id", ""), {k: float(params[k]) for k in _ADAM}))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        body = await request.json()
        key = ("train", body.get("model_id"), body.get("seq_id"))
        name = body.get("path") or f"state-{body.get('seq_id', 0)}"
        return api.submit(key, SaveState(body.get("model_id", ""), name))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        body = await request.json()
        key = ("train", body.get("model_id"), body.get("seq_id"))
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        return api.submit(key, SaveForSampler(body.get("model_id", ""), sampler_id, body.get("path")))


def _sampling_routes(app: FastAPI, api: Api) -> None:
    """Sampling clients: create one from saved weights, describe it, sample."""
    served = api.served

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        body = await request.json()
        path = body.get("model_path")
        sampler = served.sampler_paths.get(path) if path else None
        if sampler is None:
            what = f"model_path {path!r}" if path else f"base_model {body.get('base_model')!r}"
            raise UserError(f"{what}: this server samples weights saved by save_weights_for_sampler (by name) or "
                            "save_weights_and_get_sampling_client")  # fmt: skip
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        served.add_sampler(sampler_id, sampler)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict:
        sampler = _sampler(served, sampler_id)
        return {"sampler_id": sampler_id, "base_model": served.model(sampler.model_id).base_model,
                "model_path": sampler.path}  # fmt: skip

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        body = await request.json()
        sampler_id, n = body.get("sampling_session_id"), int(body.get("num_samples", 1))
        key = ("sample", sampler_id, body.get("seq_id")) if body.get("seq_id") is not None else None
        try:
            check_samples(n, served.options.limits)
            op = _sample_op(served, body, sampler_id, n)
        except UserError as e:
            return {**api.failed(key, e), "sample_sequence_ids": []}
        return api.submit(key, op, sample_sequence_ids=[f"seq-{uuid.uuid4().hex[:12]}" for _ in range(n)])


def _future_routes(app: FastAPI, api: Api) -> None:
    """The SDK's polling of a submitted operation's result."""
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        (request_id,) = _need(await request.json(), "request_id")
        if not api.futures.known(request_id):
            return JSONResponse({"error": api.futures.gone(request_id), "category": "user"})
        result = await api.futures.wait(request_id, POLL_S)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if result.error is not None:
            return JSONResponse({"error": result.error, "category": result.category})
        if result.proto is not None:
            return Response(content=result.proto, media_type="application/x-protobuf")
        return Response(content=json.dumps(result.json), media_type="application/json")


def _model_id(body: dict) -> str:
    """A new model's id as the SDK derives it (it names a model loaded from a state before the answer), its
    session id checked (`rlcore.tinker.names`)."""
    session, seq = body.get("session_id"), body.get("model_seq_id")
    if session is None and seq is None:
        return f"m-{uuid.uuid4().hex[:12]}"
    return names.model_id(session, seq)


def _sampler(served: TinkerModels, sampler_id: Any) -> Sampler:
    if sampler_id not in served.samplers:
        raise UserError(f"unknown sampling session {sampler_id!r}: get one from save_weights_and_get_sampling_client "
                        f"(the newest {served.options.limits.max_sampling_sessions} are kept: --max-sampling-sessions)")  # fmt: skip
    return served.samplers[sampler_id]


def _sample_op(served: TinkerModels, body: dict, sampler_id: Any, n: int) -> SampleOp:
    model = served.model(_sampler(served, sampler_id).model_id)
    asked = [k for k in _UNSERVED_SAMPLE if body.get(k) not in (None, 0, False)]
    if asked:
        raise UserError(f"sample: {', '.join(asked)} is not served here; ask for tokens, their log-probs and "
                        "prompt_logprobs")  # fmt: skip
    sampling: SamplingParams = sampling_params(body.get("sampling_params") or {}, n)
    prompt = prompt_tokens(body.get("prompt"))
    if min(prompt) < 0 or max(prompt) >= model.vocab:
        raise UserError(f"prompt token ids must lie in [0, {model.vocab}) for {model.base_model}")
    sampling = fitted(sampling, prompt, model.context, model.base_model)
    return SampleOp(sampler_id=sampler_id, prompt=prompt, sampling=sampling,
                    prompt_logprobs=bool(body.get("prompt_logprobs")))  # fmt: skip
