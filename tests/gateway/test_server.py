"""The gateway over HTTP with the real `openai` client, on the tiny model and a real NativeEngine: recorded
calls are what the engine sampled (re-scored by the model), sessions and segments, continuous batching,
OpenAI-shaped errors, tool calls, the session in the path and the server key."""

import asyncio
import dataclasses
import logging

import openai
import pytest
import torch

from rlcore.batch import Batch
from rlcore.data.prompts import pad_token_id
from rlcore.gateway import Gateway, sample, segments, splits, to_batch
from rlcore.models import load_policy
from rlcore.pure.logprobs import token_logprobs
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.agent.chat import ChatRenderer
from rlcore.rollout.base import RolloutEngine, Wrapping
from tests.rollout.fakes import ScriptedLMCache, turn_script

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

CONTEXT = 256


@dataclasses.dataclass
class Counting(Wrapping):
    """The inner engine, counting its `generate` calls and their rows."""

    inner: RolloutEngine
    calls: list[int] = dataclasses.field(default_factory=list)

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        self.calls.append(len(prompts))
        return self.inner.generate(prompts, sampling)


@pytest.fixture(scope="module")
def policy():
    return load_policy("builtin:tiny")


@pytest.fixture(scope="module")
def engine(policy):
    return Counting(NativeEngine(*policy))


@pytest.fixture(scope="module")
def gw(policy, engine):
    with Gateway(engine, policy[1], max_context=CONTEXT) as gateway:
        yield gateway


def client(gw, session):
    return openai.OpenAI(base_url=gw.base_url, api_key=session, max_retries=0, timeout=20)


def rescored(model, batch):
    """Teacher-forced log-probs of `batch`'s responses (temperature 1), as the trainer computes them."""
    ids = torch.cat([batch["input_ids"], batch["responses"]], dim=1)  # (b, p + t)
    mask = torch.cat([batch["attention_mask"].long(), batch["response_attention"].long()], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # (b, p + t, v)
    p = batch["input_ids"].shape[1]
    return token_logprobs(logits[:, p - 1 : -1], batch["responses"])  # (b, t)


def assert_rescored(model, tokenizer, calls, uid):
    samples = [sample(s) for s in segments(calls)]
    batch = to_batch(samples, pad_id=pad_token_id(tokenizer), max_response=CONTEXT, uids=[uid] * len(samples))
    diff = (rescored(model, batch) - batch["rollout_logprobs"]).abs()[batch["response_mask"].bool()]
    assert diff.numel() > 0 and diff.max() <= 1e-5, diff.max()
    return batch


def test_recorded_call_is_what_the_engine_sampled(gw, policy):
    model, tokenizer = policy
    messages = [{"role": "user", "content": "reverse: abc"}]
    gw.version = 7
    try:
        r = client(gw, "exact").chat.completions.create(
            model="any-name", messages=messages, n=3, max_tokens=10, temperature=1.0, logprobs=True
        )
    finally:
        gw.version = 0
    calls = gw.take("exact")
    assert len(calls) == 3 and len(r.choices) == 3
    prompt = ChatRenderer(tokenizer).prompt_ids(messages)
    for choice, call in zip(r.choices, calls, strict=True):
        assert call.prompt_ids == tuple(prompt) and call.version == 7
        assert [t.logprob for t in choice.logprobs.content] == list(call.logprobs)  # exact, not approximate
        assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([i]) for i in call.ids]
        assert choice.message.content == tokenizer.decode(list(call.ids), skip_special_tokens=True)
        assert choice.finish_reason == call.finish_reason
    assert r.model == "any-name" and r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(c.ids) for c in calls)
    assert_rescored(model, tokenizer, calls, "exact")
    assert gw.take("exact") == []  # taken once


def test_two_turns_that_extend_are_one_segment(gw, policy):
    model, tokenizer = policy
    chat = client(gw, "two-turns").chat.completions
    history = [{"role": "user", "content": "reverse: abc"}]
    first = chat.create(model="m", messages=history, max_tokens=6, seed=5).choices[0].message.content
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    chat.create(model="m", messages=history, max_tokens=6, seed=4)
    calls = gw.take("two-turns")
    assert not set(calls[0].ids[:-1]) & set(tokenizer.all_special_ids), (
        "seed 5 samples plain text (no special id a client never sees)"
    )
    assert len(calls) == 2 and splits(calls) == 0 and segments(calls) == [calls]
    batch = assert_rescored(model, tokenizer, calls, "two-turns")  # observations between the turns
    assert batch["num_turns"].tolist() == [2] and int(batch["num_observation_tokens"][0]) > 0


def test_an_edited_history_starts_a_new_segment(gw, policy):
    model, tokenizer = policy
    chat = client(gw, "edited").chat.completions
    history = [{"role": "user", "content": "reverse: abc"}]
    first = chat.create(model="m", messages=history, max_tokens=6, seed=5).choices[0].message.content
    # what a template that drops the past turn's <think>...</think> (Qwen3) does: the history the next
    # prompt renders is not the tokens the policy sampled
    edited = first[len(first) // 2 :]
    history += [{"role": "assistant", "content": edited}, {"role": "user", "content": "again"}]
    chat.create(model="m", messages=history, max_tokens=6, seed=4)
    calls = gw.take("edited")
    assert len(calls) == 2 and splits(calls) == 1 and segments(calls) == [[calls[0]], [calls[1]]]
    assert_rescored(model, tokenizer, calls, "edited")


def test_64_concurrent_agents_are_batched_and_kept_apart(gw, engine, policy):
    model, tokenizer = policy
    engine.calls.clear()

    async def agent(i):
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=f"agent-{i}", max_retries=0) as c:
            history = [{"role": "user", "content": f"agent {i:02d}"}]
            texts = []
            for _ in range(2):
                r = await c.chat.completions.create(model="m", messages=history, max_tokens=8)
                texts.append(r.choices[0].message.content)
                history += [{"role": "assistant", "content": texts[-1]}, {"role": "user", "content": "more"}]
            return texts

    async def all_agents():
        return await asyncio.gather(*(agent(i) for i in range(64)))

    answers = asyncio.run(all_agents())
    assert len(engine.calls) <= 16, engine.calls  # 128 requests in a few engine calls (7 seen)
    assert sum(engine.calls) == 128 and max(engine.calls) > 8
    recorded = []
    for i, texts in enumerate(answers):
        calls = gw.take(f"agent-{i}")
        recorded += calls
        assert len(calls) == 2, (i, calls)
        assert f"agent {i:02d}" in tokenizer.decode(list(calls[0].prompt_ids))
        assert calls[1].prompt_ids[: len(calls[0].prompt_ids)] == calls[0].prompt_ids  # its own history
        assert texts == [tokenizer.decode(list(c.ids), skip_special_tokens=True) for c in calls]
        assert gw.take(f"agent-{i}") == []  # recorded exactly once
    # each call's sampled ids follow from its own prompt (rows were not mixed up between requests)
    batch = to_batch([sample([c]) for c in recorded], pad_id=pad_token_id(tokenizer), max_response=8,
                     uids=[str(k) for k in range(len(recorded))])  # fmt: skip
    diff = (rescored(model, batch) - batch["rollout_logprobs"]).abs()[batch["response_mask"].bool()]
    assert diff.max() <= 1e-5, diff.max()


BAD = [
    ({"model": "m"}, "messages"),  # missing
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (
        {"model": "m", "messages": [{"role": "user", "content": "x" * CONTEXT}]},
        "messages",
    ),  # over the context
    ({"model": "m", "messages": [{"role": "tool", "content": "4"}]}, "messages"),  # the template refuses
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_get_an_openai_error_naming_the_field(gw, body, param, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(openai.APIStatusError) as info:
        client(gw, "bad").post("/chat/completions", body=body, cast_to=object)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert isinstance(info.value, openai.BadRequestError) and info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["code"] is None
    assert info.value.body["param"] == param and info.value.body["message"]
    assert gw.take("bad") == []


def test_typed_client_errors_and_a_bad_completion_prompt(gw):
    with pytest.raises(openai.BadRequestError) as info:
        client(gw, "bad").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=0)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client(gw, "bad").completions.create(model="m", prompt=[1, 10_000])
    assert info.value.body["param"] == "prompt"


def test_completions_on_token_ids_and_the_session_in_the_path(gw):
    c = openai.OpenAI(base_url=gw.url_for("by-path"), api_key="ignored", max_retries=0)
    r = c.completions.create(model="m", prompt=[1, 5, 72], max_tokens=4, logprobs=1, n=2)
    calls = gw.take("by-path")
    assert [call.prompt_ids for call in calls] == [(1, 5, 72)] * 2 and gw.take("ignored") == []
    assert [ch.logprobs.token_logprobs for ch in r.choices] == [list(call.logprobs) for call in calls]
    assert [m.id for m in c.models.list().data] == ["rlcore"]


def test_server_key(policy, engine):
    with Gateway(engine, policy[1], key="sekret", max_context=CONTEXT) as keyed:
        ok = openai.OpenAI(base_url=keyed.base_url, api_key="sekret:s1", max_retries=0)
        ok.completions.create(model="m", prompt="ab", max_tokens=2)
        assert len(keyed.take("s1")) == 1
        path = openai.OpenAI(base_url=keyed.url_for("s2"), api_key="sekret", max_retries=0)
        path.completions.create(model="m", prompt="ab", max_tokens=2)
        assert len(keyed.take("s2")) == 1
        for key in ("wrong:s1", "s1", "sekret:", "sekret:bad session"):
            bad = openai.OpenAI(base_url=keyed.base_url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as info:
                bad.completions.create(model="m", prompt="ab", max_tokens=2)
            assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
        assert keyed.take("s1") == []


def test_tool_calls_are_parsed_from_the_completion(policy):
    tokenizer = policy[1]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    scripted = NativeEngine(
        ScriptedLMCache(turn_script(tokenizer, ["sum: " + call]), len(tokenizer)), tokenizer
    )
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with Gateway(scripted, tokenizer, max_context=CONTEXT) as g:
        chat = client(g, "tools").chat.completions
        messages = [{"role": "user", "content": "2+3?"}]
        r = chat.create(model="m", messages=messages, tools=tools, max_tokens=120, temperature=0)
        plain = chat.create(model="m", messages=messages, tools=tools, tool_choice="none", max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "sum:"
    [tool_call] = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.function.name == "add"
    assert tool_call.function.arguments == '{"a": 2, "b": 3}' and tool_call.id.startswith("call_")
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None


class Broken(Wrapping):
    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompts, sampling):
        raise RuntimeError("engine down")


def test_an_engine_failure_is_a_500_and_the_gateway_lives_on(policy, engine):
    with Gateway(Broken(engine), policy[1], max_context=CONTEXT) as g:
        for _ in range(2):  # the worker survives the first failure
            with pytest.raises(openai.InternalServerError) as info:
                client(g, "down").completions.create(model="m", prompt="ab", max_tokens=2)
            assert info.value.body["type"] == "server_error" and "engine down" in info.value.body["message"]
        assert g.take("down") == []
