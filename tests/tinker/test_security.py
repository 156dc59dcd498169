"""The server against a hostile caller, over real HTTP (the `tinker` SDK and raw `http.client`): names that
climb out of the work directory (absolute, `..`, a planted symlink), a base model outside the served roots,
requests sized to exhaust memory (num_samples, max_tokens, a sparse tensor's shape, the body), a cross-site
`text/plain` post, a foreign `Host`, a missing or wrong key, too many models, kept futures, and an operation
that runs past its timeout. Each is refused (a 4xx, or the SDK's one-line user error), nothing is written
outside the work directory, and the server goes on answering."""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.tinker.server import client, running

BASE = "builtin:tiny-reverse"
WAIT = 60
KEY = "tml-security-test-key"
FLAGS = ("--api-key", KEY, "--max-models", "5", "--max-samples", "4", "--max-lora-rank", "8", "--max-body-mb", "1",
         "--max-futures", "64", "--op-timeout-s", "3", "--micro-batch-tokens", "4")  # fmt: skip
"""The server's key and limits (the model roots are added by the fixture): a forward_backward of thousands of
datums runs one micro-batch a datum and passes the timeout; one of a few datums stays far within it."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """The work directory, an `outside` sibling that must stay empty, the served model roots and a directory
    beside them."""
    base = tmp_path_factory.mktemp("security")
    made = {name: base / name for name in ("work", "outside", "roots", "elsewhere")}
    for d in made.values():
        d.mkdir()
    return made


@pytest.fixture(scope="module")
def url(dirs):
    with running(dirs["work"], *FLAGS, "--model-roots", str(dirs["roots"])) as base_url:
        yield base_url


def _client(url: str) -> tinker.ServiceClient:
    return client(url, api_key=KEY)


@pytest.fixture(scope="module")
def training(url):
    return _client(url).create_lora_training_client(base_model=BASE, rank=1).result(WAIT)


@pytest.fixture(scope="module")
def sampler_id(url, training):
    return training.save_weights_and_get_sampling_client().result(WAIT)._sampling_session_id


@pytest.fixture(autouse=True)
def _nothing_outside_and_still_serving(request, dirs):
    yield
    written = sorted(p.name for p in dirs["outside"].iterdir())
    for p in dirs["outside"].iterdir():  # so that one escape fails one test
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    assert written == []
    if "url" in request.fixturenames:
        assert _call(request.getfixturevalue("url"), "GET", "healthz")[0] == 200


def _call(url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
          timeout: float = WAIT) -> tuple[int, dict | bytes]:  # fmt: skip
    """(status, JSON body or bytes) of one raw request; `headers` replace the defaults (JSON, the test key)."""
    parsed = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    sent = {"Content-Type": "application/json", "X-API-Key": KEY, **(headers or {})}
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request(method, f"/api/v1/{path}", body=data, headers={k: v for k, v in sent.items() if v is not None})
        r = conn.getresponse()
        raw = r.read()
        is_json = r.getheader("content-type", "").startswith("application/json")
        return r.status, json.loads(raw) if is_json else raw
    finally:
        conn.close()


def _future(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> dict:
    """The finished result of a request answered with a request id (its JSON, or {"error": ...}); a refusal of
    the request itself as {"status": ..., "detail": ...}."""
    status, answer = _call(url, "POST", path, body, headers)
    if status != 200:
        return {"status": status, "detail": answer.get("detail") if isinstance(answer, dict) else answer}
    while True:
        status, result = _call(url, "POST", "retrieve_future", {"request_id": answer["request_id"]}, headers)
        if not isinstance(result, dict):
            return {"proto": result}
        if result.get("type") != "try_again":
            return result


def _refused(result: dict) -> str:
    """The one-line message of a refusal (a 4xx or a failed future of category user)."""
    if "status" in result:
        assert 400 <= result["status"] < 500, result
        message = result["detail"]
    else:
        assert result.get("category") == "user", result
        message = result["error"]
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------------- paths


@pytest.mark.parametrize("session", ["{outside}/abs", "../outside/s", "../../outside", "a/../../outside/b", ""])
def test_a_session_id_that_names_a_path_is_refused_and_writes_nothing(url, dirs, session):
    session = session.format(outside=dirs["outside"])
    made = _future(url, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                         "lora_config": {"rank": 1}})  # fmt: skip
    if "model_id" in made:  # the old server made it: its save lands outside
        _future(url, "save_weights", {"model_id": made["model_id"], "seq_id": 1, "path": "x"})
    assert "session" in _refused(made)


@pytest.mark.parametrize("name", ["../../outside", "/abs", "a/b", "..", ""])
def test_a_save_name_that_names_a_path_is_refused(url, training, name):
    model_id = training.get_info().model_id
    for path in ("save_weights", "save_weights_for_sampler"):
        result = _future(url, path, {"model_id": model_id, "seq_id": None, "path": name})
        if name:
            assert "name" in _refused(result)


def test_a_symlink_planted_in_the_workdir_is_not_followed_out(url, dirs):
    made = _client(url).create_lora_training_client(base_model=BASE, rank=1).result(WAIT)
    model_id = made.get_info().model_id
    (dirs["work"] / model_id).symlink_to(dirs["outside"], target_is_directory=True)
    try:
        with pytest.raises(tinker.RequestFailedError) as e:
            made.save_state("planted").result(WAIT)
        assert "outside the work directory" in str(e.value) and "--workdir" in str(e.value), str(e.value)
        with pytest.raises(tinker.RequestFailedError) as e:
            _client(url).create_training_client_from_state(f"tinker://{model_id}/weights/planted").result(WAIT)
        assert "outside the work directory" in str(e.value), str(e.value)
    finally:
        (dirs["work"] / model_id).unlink()


@pytest.mark.parametrize("path", ["tinker://../weights/x", "tinker:///etc/weights/x", "tinker://a/weights/../../x",
                                  "tinker://a:train:0/weights/..", "/etc/passwd"])  # fmt: skip
def test_a_tinker_path_that_climbs_is_refused(url, path):
    for body in ({"path": path, "session_id": "s-sec", "model_seq_id": 7}, {"path": path, "model_id": "x", "seq_id": 1}):
        message = _refused(_future(url, "load_weights", body))
        assert "tinker://" in message or "unknown model_id" in message, message
    status, answer = _call(url, "POST", "create_sampling_session", {"model_path": path, "session_id": "s-sec"})
    assert 400 <= status < 500, answer


def test_a_base_model_outside_the_model_roots_is_refused(url, dirs):
    from rlcore.models.policy import load_policy

    model, tokenizer = load_policy(BASE)  # a local copy of the built-in model, inside the roots and beside them
    for where in ("roots", "elsewhere"):
        model.save_pretrained(dirs[where] / "tiny")
        tokenizer.save_pretrained(dirs[where] / "tiny")
    for base in (str(dirs["elsewhere"] / "tiny"), str(dirs["roots"] / ".." / "elsewhere" / "tiny"), "/etc",
                 "../elsewhere", "~/x"):  # fmt: skip
        with pytest.raises(tinker.RequestFailedError) as e:
            _client(url).create_lora_training_client(base_model=base, rank=1).result(WAIT)
        assert "--model-roots" in str(e.value), str(e.value)
    inside = _client(url).create_lora_training_client(base_model=str(dirs["roots"] / "tiny"), rank=1).result(WAIT)
    assert inside.forward_backward(_data(1), "cross_entropy").result(WAIT).metrics["loss:sum"] > 0


# ------------------------------------------------------------------------------------------- bounds


def test_a_billion_samples_is_refused_at_once(url, sampler_id):
    started = time.monotonic()
    body = {"sampling_session_id": sampler_id, "seq_id": 1, "num_samples": 1e9,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]}, "sampling_params": {"max_tokens": 2}}  # fmt: skip
    status, answer = _call(url, "POST", "asample", body, timeout=15)
    result = answer if status != 200 else _future(url, "asample", body)
    message = _refused({"status": status, **answer} if status != 200 else result)
    assert "--max-samples" in message and time.monotonic() - started < 10, message


def test_max_tokens_is_clamped_to_the_context_and_a_longer_prompt_is_refused(url, training):
    sampler = training.save_weights_and_get_sampling_client().result(WAIT)
    context = 2048  # tiny-reverse's max_positions
    prompt = types.ModelInput.from_ints([3 + i % 30 for i in range(context - 4)])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10**9, temperature=1.0)).result(WAIT)
    assert 1 <= len(out.sequences[0].tokens) <= 4
    with pytest.raises(tinker.RequestFailedError) as e:
        sampler.sample(types.ModelInput.from_ints([3] * (context + 1)), 1, types.SamplingParams(max_tokens=1)).result(WAIT)
    assert "context" in str(e.value) and str(context) in str(e.value), str(e.value)


def test_a_lora_rank_over_the_limit_is_refused(url):
    with pytest.raises(tinker.RequestFailedError) as e:
        _client(url).create_lora_training_client(base_model=BASE, rank=4096).result(WAIT)
    assert "--max-lora-rank" in str(e.value), str(e.value)


def _fb_body(model_id: str, tensor) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([3, 4, 5], dtype=np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(tensor)
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.ones(3, dtype=np.float32).tobytes()
    weights.shape.extend([3])
    return msg.SerializeToString()


def test_a_sparse_tensor_with_a_huge_shape_is_refused_before_it_is_densified(url, training):
    from tinker.proto import tinker_public_pb2 as pb

    bomb = pb.Tensor(dtype=pb.DTYPE_INT64)
    bomb.shape.extend([3, 10**6])
    bomb.sparse_csr.values = np.array([4], dtype=np.int64).tobytes()
    bomb.sparse_csr.crow_indices = np.array([0, 1, 1, 1], dtype=np.int64).tobytes()
    bomb.sparse_csr.col_indices = np.array([0], dtype=np.int64).tobytes()
    body = _fb_body(training.get_info().model_id, bomb)
    assert len(body) < 200
    message = _refused(_future(url, "forward_backward", body, {"Content-Type": "application/x-protobuf"}))
    assert "for a datum of 3 tokens" in message, message


def test_a_body_over_the_limit_is_a_413(url):
    status, answer = _call(url, "POST", "forward_backward", b"\0" * (2 << 20), {"Content-Type": "application/x-protobuf"})
    assert status == 413 and "--max-body-mb" in answer["detail"], answer


def test_too_many_models_are_refused(url):
    for _ in range(6):  # the limit is 5, and other tests made some
        try:
            _client(url).create_lora_training_client(base_model=BASE, rank=1).result(WAIT)
        except tinker.RequestFailedError as e:
            assert "--max-models" in str(e), str(e)
            return
    pytest.fail("no model was refused")


def test_kept_futures_are_bounded(url):
    first = _call(url, "POST", "optim_step", {"model_id": "nobody", "seq_id": 0, "adam_params": {}})[1]["request_id"]
    for seq in range(1, 80):
        _future(url, "optim_step", {"model_id": "nobody", "seq_id": seq, "adam_params": {}})
    answer = _call(url, "POST", "retrieve_future", {"request_id": first})[1]
    assert "unknown request" in answer["error"] and "--max-futures" in answer["error"], answer


# ------------------------------------------------------------------------------------------- the door


def test_a_text_plain_post_is_a_415(url):
    body = json.dumps({"session_id": "s-plain", "model_seq_id": 0, "base_model": BASE}).encode()
    status, answer = _call(url, "POST", "create_model", body, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in answer["detail"], answer


def test_a_foreign_host_is_a_421(url):
    status, answer = _call(url, "GET", "healthz", headers={"Host": "attacker.example"})
    assert status == 421 and "--allowed-hosts" in answer["detail"], answer
    port = urllib.parse.urlsplit(url).port
    assert _call(url, "GET", "healthz", headers={"Host": f"localhost:{port}"})[0] == 200


def test_with_a_key_every_request_needs_it_and_the_sdk_sends_it(url, training):
    for key in (None, "tml-wrong"):
        status, answer = _call(url, "GET", "healthz", headers={"X-API-Key": key})
        assert status == 401 and "--api-key" in answer["detail"], answer
    assert training.forward_backward(_data(1), "cross_entropy").result(WAIT).metrics["loss:sum"] > 0
    with pytest.raises(tinker.APIStatusError) as e:
        client(url, api_key="tml-wrong").create_lora_training_client(base_model=BASE, rank=1).result(WAIT)
    assert e.value.status_code == 401


def test_an_operation_past_the_timeout_fails_alone_and_the_next_runs(url, training):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    data = [types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5]),
                        loss_fn_inputs={"target_tokens": [4, 5, 6], "weights": [1.0, 1.0, 1.0]})] * 6000  # fmt: skip
    request = types.ForwardBackwardRequest(model_id=training.get_info().model_id, seq_id=10**6,
                                           forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"))  # fmt: skip
    body = forward_backward_request_to_proto(request).SerializeToString()  # one body: the SDK would send 6
    started = time.monotonic()
    message = _refused(_future(url, "forward_backward", body, {"Content-Type": "application/x-protobuf"}))
    assert "--op-timeout-s (3 s)" in message and "gradients" in message and time.monotonic() - started < 20, message
    assert _call(url, "GET", "healthz")[0] == 200
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result(WAIT).metrics["grad_norm"] == 0.0
    assert training.forward_backward(_data(1), "cross_entropy").result(WAIT).metrics["loss:sum"] > 0


def _data(n: int) -> list[types.Datum]:
    tokens = list(range(3, 15))
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})] * n  # fmt: skip


def test_sampling_stops_between_decode_steps_past_the_deadline():
    """The engine's each_step hook ends a `generate` past the operation's deadline; the engine samples on."""
    from rlcore.data.prompts import pad_token_id
    from rlcore.models.policy import load_policy
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.native.engine import NativeEngine
    from rlcore.tinker.errors import UserError
    from rlcore.tinker.limits import Deadline
    from rlcore.tinker.sampling import SampleOp, run_samples

    model, tokenizer = load_policy(BASE)
    engine, pad = NativeEngine(model, tokenizer), pad_token_id(tokenizer)
    op = SampleOp(sampler_id="s", prompt=(3, 4, 5), sampling=SamplingParams(n=4, max_tokens=50, seed=1),
                  prompt_logprobs=False)  # fmt: skip
    with pytest.raises(UserError, match=r"sample ran past the server's --op-timeout-s \(1 s\)"):
        run_samples(engine, pad, [op], Deadline(time.monotonic() - 1, 1.0))
    assert len(run_samples(engine, pad, [op], Deadline(time.monotonic() + 60, 60.0))) == 1
