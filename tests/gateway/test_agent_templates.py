"""Agents through `GatewayAgentEngine` on the tiny model: a LangChain chat model as the client, and a chat template that
drops earlier `<think>` blocks (as Qwen3's does), whose trajectories split into samples that are counted."""

from __future__ import annotations

import time

import pytest
import torch

from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import Row
from rlcore.gateway.agents import GatewayAgentEngine
from rlcore.models import load_policy
from rlcore.rollout import NativeEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

DROPS_THINK = (
    "{{ bos_token }}{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|' + message['role'] + '|>' + content }}{% if not (loop.last and continue_final_message) %}"
    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The built-in models' template, except that an assistant message before the last keeps only what follows
its `</think>` (Qwen3's rule for past turns)."""


def rollout(agent, *, template: str | None = None, slow_s: float = 0.0, **options):
    model, tokenizer = load_policy("builtin:tiny")
    if template is not None:
        tokenizer.chat_template = template
    rows = [Row(data_source="builtin/reverse", prompt=[{"role": "user", "content": t}], ground_truth=t[::-1])
            for t in ("1234", "98765")]  # fmt: skip
    prompts = make_prompt_batch(rows, tokenizer, uids=["a", "b"])
    inner = NativeEngine(model, tokenizer)
    if slow_s:  # calls of 30 tokens take `slow_s` seconds more
        generate = inner.generate
        inner.generate = lambda p, s: (time.sleep(slow_s) if s.max_tokens == 30 else None) or generate(p, s)
    engine = GatewayAgentEngine(inner, tokenizer, agent, **options)
    try:
        out = engine.generate(prompts, SamplingParams(n=2, max_tokens=40, temperature=1.0))
        time.sleep(slow_s)  # what was still in flight would have landed by now
        assert engine.gateway.sessions() == []  # every episode's calls taken or discarded
        return out
    finally:
        engine.close()


async def thinks_then_asks_again(client, row):
    """Turn 1 opens its reply with a thought (the prompt's assistant prefix), turn 2 sends the history back."""
    thought = "<think>reverse it</think>"
    first = await client.chat.completions.create(
        model="m", messages=[*row["prompt"], {"role": "assistant", "content": thought}], max_tokens=5,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    said = thought + (first.choices[0].message.content or "")
    history = [*row["prompt"], {"role": "assistant", "content": said}, {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="m", messages=history, max_tokens=5)
    return None


def test_a_template_that_drops_past_think_blocks_splits_every_episode_and_counts_it():
    kept = rollout(thinks_then_asks_again)
    assert int(kept["agent_split"].sum()) == 0 and len(kept) == 4  # the history re-renders as sampled
    assert kept["num_turns"].tolist() == [2, 2, 2, 2]
    dropped = rollout(thinks_then_asks_again, template=DROPS_THINK)
    assert int(dropped["agent_split"].sum()) == 4 and len(dropped) == 8  # each episode: two samples
    assert dropped["num_turns"].tolist() == [1] * 8
    mask = dropped["response_mask"]  # every sample holds only the tokens its call sampled
    assert torch.equal(mask, dropped["response_attention"])


async def langchain_agent(client, row):
    """The same two turns written with LangChain's ChatOpenAI, pointed at the session's base URL with the run's key."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=str(client.base_url), api_key=client.api_key, model="policy", max_tokens=5, max_retries=0)
    first = await chat.ainvoke([(m["role"], m["content"]) for m in row["prompt"]])
    await chat.ainvoke([(m["role"], m["content"]) for m in row["prompt"]] + [("assistant", first.content),
                                                                              ("user", "again")])  # fmt: skip
    return 0.5


def test_a_langchain_chat_model_is_an_agent():
    pytest.importorskip("langchain_openai")
    out = rollout(langchain_agent)
    assert len(out) >= 4 and set(out["uid"]) == {"a", "b"}
    assert (out["num_turns"] >= 1).all() and out["agent_rewards"].tolist() == [0.5] * len(out)
    assert out["response_mask"].sum() > 0


async def asks_then_stalls(client, row):
    """One call, then a second that the deadline cuts off."""
    import asyncio

    await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=3)
    await asyncio.gather(client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=30),
                         asyncio.sleep(60))  # fmt: skip


def test_an_episode_past_its_deadline_fails_and_leaves_nothing_behind():
    out = rollout(asks_then_stalls, timeout_s=1.0, failure_score=-1.0, slow_s=2.0)  # the 2nd call outlives it
    assert out["agent_failed"].all() and out["agent_rewards"].tolist() == [-1.0] * len(out)
    assert (out["response_mask"].sum(-1) > 0).all()  # the calls it made before the deadline are its rows
