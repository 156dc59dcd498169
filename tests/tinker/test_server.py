"""The Tinker API served by rlcore, driven by the real `tinker` SDK (0.38) over HTTP against a real server
process: the losses it returns against rlcore's pure functions on the same tensors, forward_backward_custom,
sampling with prompt log-probs, an SFT loop, retries that must not apply twice, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import torch
from tinker import types

from rlcore.data.tasks import compute_score, generate_rows
from rlcore.models.policy import load_model
from rlcore.tinker.losses import TINKER_LOSSES
from tests.tinker.server import ROOT, client, running

BASE = "builtin:tiny-reverse"
WAIT = 120


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with running(tmp_path_factory.mktemp("tinker"), "--max-models", "64") as base_url:  # a model a test
        yield base_url


def _datums(n: int = 3, seed: int = 0) -> list[types.Datum]:
    """n datums of different lengths (the shorter ones are padded on the server) with every loss's inputs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 6 + 3 * i
        tokens = torch.randint(3, 40, (length + 1,), generator=g).tolist()
        inputs = {"target_tokens": tokens[1:], "weights": torch.rand(length, generator=g).tolist(),
                  "logprobs": (-torch.rand(length, generator=g) * 4).tolist(), "advantages": torch.randn(length, generator=g).tolist()}  # fmt: skip
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return out


def _ce(data: list[types.Datum]) -> list[types.Datum]:
    """The datums with cross_entropy's inputs only."""
    return [types.Datum(model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")})
            for d in data]  # fmt: skip


def _local_logprobs(model: torch.nn.Module, datum: types.Datum) -> torch.Tensor:
    ids = torch.tensor([datum.model_input.to_ints()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().long()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def _inputs(datum: types.Datum, names) -> dict:
    return {k: datum.loss_fn_inputs[k].to_torch().float()[None] for k in names}


@pytest.mark.parametrize("name", sorted(TINKER_LOSSES))
def test_each_loss_the_server_returns_is_rlcores_pure_loss_on_the_same_tensors(url, name):
    """The log-probs equal a plain forward of the same weights (no padding), and loss:sum equals the loss
    table's pure function on those log-probs and the datums' inputs (1e-6)."""
    training = client(url).create_lora_training_client(base_model=BASE, rank=0).result(WAIT)
    data = _datums()
    loss = TINKER_LOSSES[name]
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                                   if k in ("target_tokens", *loss.inputs, *loss.optional)})
            for d in data]  # fmt: skip
    out = training.forward_backward(data, loss_fn=name).result(WAIT)
    model = load_model(BASE)
    want = 0.0
    for d, got in zip(data, out.loss_fn_outputs, strict=True):
        lp = got["logprobs"].to_torch()
        torch.testing.assert_close(lp, _local_logprobs(model, d), rtol=0, atol=2e-5)
        names = [k for k in d.loss_fn_inputs if k != "target_tokens"]
        want += float(loss.fn(lp[None].double(), {k: v.double() for k, v in _inputs(d, names).items()},
                               {**loss.config}, torch.ones(1, len(lp), dtype=torch.float64)))  # fmt: skip
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-6, abs=1e-6)


def _probe(training, datum):
    return training.forward([datum], "cross_entropy").result(WAIT).loss_fn_outputs[0]["logprobs"].to_torch()


def test_forward_backward_custom_moves_the_weights_exactly_as_the_loss_it_stands_for(url):
    """A custom loss -sum(w lp) on the client and the built-in cross_entropy with weights w give the same
    update, bit for bit (the SDK sends back -dLoss/dlp as cross_entropy's weights)."""
    service = client(url)
    data = _ce(_datums(seed=1))
    adam = types.AdamParams(learning_rate=1e-2)
    custom, builtin = (service.create_lora_training_client(base_model=BASE, rank=0).result(WAIT) for _ in range(2))

    def loss_fn(batch, logprobs):
        total = sum(-(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(batch, logprobs, strict=False))
        return total, {"custom:sum": float(total.detach())}

    got = custom.forward_backward_custom(data, loss_fn).result(WAIT)
    ref = builtin.forward_backward(data, "cross_entropy").result(WAIT)
    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-6)
    custom.optim_step(adam).result(WAIT)
    builtin.optim_step(adam).result(WAIT)
    before = _probe(service.create_lora_training_client(base_model=BASE, rank=0).result(WAIT), data[0])
    after = _probe(custom, data[0])
    assert not torch.equal(after, before)  # the update moved the weights
    assert torch.equal(after, _probe(builtin, data[0]))


def test_samples_and_prompt_logprobs_agree_with_the_trainer_forward(url):
    training = client(url).create_lora_training_client(base_model=BASE, rank=4).result(WAIT)
    assert training.get_info().is_lora and training.get_info().lora_rank == 4
    tokenizer = training.get_tokenizer()  # the directory the server wrote, loaded offline
    prompt = tokenizer.encode("reverse 40213")
    sampler = training.save_weights_and_get_sampling_client().result(WAIT)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    result = sampler.sample(types.ModelInput.from_ints(prompt), 3, params, include_prompt_logprobs=True).result(WAIT)
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result(WAIT)
    assert [s.tokens for s in result.sequences] == [s.tokens for s in again.sequences]  # seeded
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    ce = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                     loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)})  # fmt: skip
    forward = _probe(training, ce)
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), forward, rtol=0, atol=1e-5)
    for s in result.sequences:
        full = prompt + s.tokens
        d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})  # fmt: skip
        torch.testing.assert_close(torch.tensor(s.logprobs), _probe(training, d)[len(prompt) - 1 :], rtol=0, atol=1e-4)


def test_an_sft_loop_with_cross_entropy_learns_the_task(url):
    """Supervised fine-tuning of LoRA adapters on reverse's answers lifts the greedy score from the
    warm start's 0.23 (the model echoes the digits)."""
    training = client(url).create_lora_training_client(base_model=BASE, rank=16).result(WAIT)
    tokenizer = training.get_tokenizer()

    def prompt_ids(row):
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    train, val = generate_rows("reverse", "train", 256), generate_rows("reverse", "val", 64)
    data = []
    for row in train:
        p = prompt_ids(row)
        full = p + tokenizer.encode(row["reward_model"]["ground_truth"], add_special_tokens=False) + [tokenizer.eos_token_id]
        weights = [0.0] * (len(p) - 1) + [1.0] * (len(full) - len(p))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))  # fmt: skip

    def greedy_score():
        sampler = training.save_weights_and_get_sampling_client().result(WAIT)
        greedy = types.SamplingParams(max_tokens=12, temperature=0.0)
        futures = [sampler.sample(types.ModelInput.from_ints(prompt_ids(r)), 1, greedy) for r in val]
        texts = [tokenizer.decode(f.result(WAIT).sequences[0].tokens, skip_special_tokens=True) for f in futures]
        return sum(compute_score(r["data_source"], t, r["reward_model"]["ground_truth"]) for r, t in zip(val, texts, strict=False)) / len(val)

    before = greedy_score()
    losses = []
    for step in range(8):
        batch = data[step * 32 : (step + 1) * 32]
        losses.append(training.forward_backward(batch, "cross_entropy").result(WAIT).metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result(WAIT)
    after = greedy_score()
    assert before < 0.4 and after > 0.8, (before, after, losses)
    assert losses[-1] < losses[0] / 3


def _post(url: str, path: str, headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{path}", headers={"X-API-Key": "tml-rlcore-tests", **(headers or {})}, timeout=60, **kw)


def _result(url: str, request_id: str) -> httpx.Response:
    while True:
        r = _post(url, "retrieve_future", json={"request_id": request_id})
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r


def test_a_request_sent_again_runs_once(url):
    """The SDK retries a POST whose answer was lost with the same (model, seq_id): the server answers it with the
    first request id and runs it once. Sent twice here, an optimizer step moves the weights as one does."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    service = client(url)
    twice, once = (service.create_lora_training_client(base_model=BASE, rank=0).result(WAIT) for _ in range(2))
    data = _ce(_datums(1, seed=3))
    model_id = twice.get_info().model_id
    fb = types.ForwardBackwardRequest(model_id=model_id, seq_id=1,
                                      forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"))  # fmt: skip
    body = forward_backward_request_to_proto(fb).SerializeToString()
    ids = [_post(url, "forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}).json()["request_id"]
           for _ in range(2)]  # fmt: skip
    step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}}
    ids += [_post(url, "optim_step", json=step).json()["request_id"] for _ in range(2)]
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]
    assert _result(url, ids[2]).json()["metrics"]["skipped"] == 0.0
    once.forward_backward(data, "cross_entropy").result(WAIT)
    once.optim_step(types.AdamParams(learning_rate=1e-2)).result(WAIT)
    probe = data[0]
    got = _post(url, "forward_backward", headers={"Content-Type": "application/x-protobuf"},
                content=forward_backward_request_to_proto(types.ForwardBackwardRequest(
                    model_id=model_id, seq_id=3, forward_backward_input=types.ForwardBackwardInput(data=[probe], loss_fn="cross_entropy"))
                ).SerializeToString()).json()["request_id"]  # fmt: skip
    from tinker.proto.response_conv import deserialize_forward_backward_output

    twice_lp = deserialize_forward_backward_output(_result(url, got).content).loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.equal(twice_lp, _probe(once, probe))


BAD = [
    (lambda t, d: t.forward_backward(d, "no_such_loss"), "unknown loss_fn 'no_such_loss'; served: cross_entropy"),
    (lambda t, d: t.forward_backward(d, "stable_reinforce"), "stable_reinforce is not served"),
    (lambda t, d: t.forward_backward(d, "importance_sampling"), "needs loss_fn_inputs advantages, logprobs, target_tokens; missing"),
    (lambda t, d: t.forward_backward([types.Datum(model_input=d[0].model_input, loss_fn_inputs={
        "target_tokens": d[0].loss_fn_inputs["target_tokens"].to_torch()[:-1], "weights": d[0].loss_fn_inputs["weights"]})],
        "cross_entropy"), "loss_fn_inputs['target_tokens'] has shape [5]; expected [6]"),
    (lambda t, d: t.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 99999]), loss_fn_inputs={
        "target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})], "cross_entropy"), "token ids must lie in [0, "),
    (lambda t, d: t.forward_backward(d, "ppo", {"clip_range": 0.2}), "unknown key(s) clip_range"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "message"), BAD)
def test_bad_input_fails_that_request_in_one_line_and_the_server_goes_on(url, call, message):
    import tinker

    training = client(url).create_lora_training_client(base_model=BASE, rank=0).result(WAIT)
    data = _ce(_datums(2, seed=5))
    with pytest.raises(tinker.RequestFailedError) as e:
        call(training, data).result(WAIT)
    assert message in str(e.value), str(e.value)
    assert training.forward_backward(data, "cross_entropy").result(WAIT).metrics["loss:sum"] > 0  # still serving


def test_a_model_that_does_not_exist_is_one_line(url):
    import tinker

    with pytest.raises(tinker.RequestFailedError) as e:
        client(url).create_lora_training_client(base_model="builtin:no-such-model", rank=0).result(WAIT)
    assert "base_model 'builtin:no-such-model'" in str(e.value) and "tiny-reverse" in str(e.value)


CLIENT = """
import sys, tinker
from tinker import types
t = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-x").create_lora_training_client(base_model="builtin:tiny-reverse", rank=0).result()
data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 40))), loss_fn_inputs={"target_tokens": list(range(4, 41)), "weights": [1.0] * 37})] * 256
t.forward_backward(data, "cross_entropy")
print("sent", flush=True)
import time; time.sleep(60)
"""


def test_a_client_killed_mid_session_leaves_the_server_serving_others(url):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, url], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "sent"
    proc.kill()
    proc.wait()
    training = client(url).create_lora_training_client(base_model=BASE, rank=0).result(WAIT)
    data = _ce(_datums(2, seed=6))
    started = time.monotonic()
    assert training.forward_backward(data, "cross_entropy").result(WAIT).metrics["loss:sum"] > 0
    assert time.monotonic() - started < WAIT
    info = json.loads(httpx.get(f"{url}/api/v1/healthz", timeout=10).text)
    assert info == {"status": "ok"}


def test_bad_sample_requests_fail_in_one_line_and_sampling_goes_on(url):
    import tinker

    training = client(url).create_lora_training_client(base_model=BASE, rank=0).result(WAIT)
    old = training.save_weights_and_get_sampling_client().result(WAIT)
    ok, short = types.ModelInput.from_ints([1, 5, 6, 7]), types.SamplingParams(max_tokens=2)
    bad = [
        (lambda: old.sample(types.ModelInput.from_ints([1, 99999]), 1, short), "prompt token ids must lie in [0, "),
        (lambda: old.sample(ok, 1, types.SamplingParams(max_tokens=2, temperature=-1.0)),
         "sampling_params.temperature=-1.0: must be >= 0 (0 is greedy)"),
        (lambda: old.sample(ok, 1, short, topk_prompt_logprobs=2), "sample: topk_prompt_logprobs is not served here"),
    ]  # fmt: skip
    for call, message in bad:
        with pytest.raises(tinker.RequestFailedError) as e:
            call().result(WAIT)
        assert message in str(e.value), str(e.value)
    training.forward_backward(_ce(_datums(1, seed=7)), "cross_entropy").result(WAIT)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(WAIT)
    new = training.save_weights_and_get_sampling_client().result(WAIT)
    with pytest.raises(tinker.RequestFailedError) as e:
        old.sample(ok, 1, short).result(WAIT)  # the engine now holds the newer weights
    assert "holds version 0" in str(e.value) and "save_weights_for_sampler again" in str(e.value)
    assert len(new.sample(ok, 2, short).result(WAIT).sequences) == 2


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tinker://../weights/x", "model id '..': use a letter or digit"),
        ("tinker://m-1/weights/a/b", "expected tinker://<model_id>/weights/<name>"),
        ("s3://bucket/x", "expected tinker://<model_id>/weights/<name>"),
        ("tinker://m-nobody/weights/mid", "no saved state at 'mid'"),
    ],
)
def test_a_state_path_outside_the_work_directory_or_missing_is_one_line(url, path, message):
    import tinker

    with pytest.raises(tinker.RequestFailedError) as e:
        client(url).create_training_client_from_state(path).result(WAIT)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("optim_step", {"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": "abc"}},
         "/api/v1/optim_step: a field is unreadable (could not convert string to float: 'abc')"),
        ("asample", {"num_samples": "x"}, "/api/v1/asample: a field is unreadable (invalid literal for int()"),
        ("create_model", b"{not json", "/api/v1/create_model: the body is not JSON"),
    ],
)
def test_a_body_the_server_cannot_read_is_a_400_with_one_line(url, path, body, message):
    kw = {"json": body} if isinstance(body, dict) else {"content": body, "headers": {"Content-Type": "application/json"}}
    r = _post(url, path, **kw)
    assert r.status_code == 400 and message in r.json()["detail"] and "\n" not in r.json()["detail"]
