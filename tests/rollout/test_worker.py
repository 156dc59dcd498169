"""The engine worker (`rlcore.rollout.worker`) on the real native engine: requests gathered together become one
`generate` per group of their key, a prompt asked m times is sent once with m*n samples, every future is
answered with its own rows of the call (or with the call's exception), and `gather` stops at the item it is
told to leave."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, pad_token_id
from rlcore.models import load_policy
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.worker import EngineWorker, Sample, after_last, gather, generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

A, B, C = (5, 6, 7), (8, 9), (10, 11, 12, 13)
SEEDED = SamplingParams(n=2, max_tokens=4, seed=1)
OTHER = SamplingParams(n=1, max_tokens=3, seed=2)


class Recording:
    """The real engine, with each `generate`'s prompt ids and sampling recorded."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        self.calls.append((prompts["input_ids"].clone(), sampling))
        return self.engine.generate(prompts, sampling)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_policy("builtin:tiny")
    return NativeEngine(model, tokenizer), pad_token_id(tokenizer)


def served(tiny, asked, *, key=None, share_prompts=False, version=0):
    """Submit `asked` ((prompt, sampling) pairs) so that one gather takes them all; (the futures' results or
    exceptions, the recorded engine calls)."""
    engine, pad = tiny
    recording = Recording(engine)
    options = {"key": key} if key is not None else {}
    worker = EngineWorker(recording, pad_id=pad, share_prompts=share_prompts, **options)
    worker.expected, worker.linger_s, worker.version = (lambda: len(asked)), 60.0, version
    futures = [worker.submit(prompt, sampling, lambda s, v: (s, v)) for prompt, sampling in asked]
    worker.close()
    assert all(f.done() for f in futures)
    return [f.exception() or f.result() for f in futures], recording.calls


def ids(samples: list[Sample]) -> list[tuple[int, ...]]:
    return [s.tokens for s in samples]


def test_equal_sampling_shares_one_call_in_arrival_order(tiny):
    results, calls = served(tiny, [(A, SEEDED), (B, OTHER), (C, SEEDED)], version=7)
    engine, pad = tiny
    assert [sampling for _, sampling in calls] == [SEEDED, OTHER]
    assert torch.equal(calls[0][0], left_pad([A, C], pad)[0]) and torch.equal(calls[1][0], left_pad([B], pad)[0])
    first, second = generate(engine, pad, [A, C], SEEDED), generate(engine, pad, [B], OTHER)
    assert [r[0] for r in results] == [first[0], second[0], first[1]]  # each its own rows of its group's call
    assert [len(r[0]) for r in results] == [2, 1, 2] and {r[1] for r in results} == {7}
    assert all(len(s.tokens) == len(s.logprobs) > 0 for r in results for s in r[0])


def test_a_key_can_put_a_seeded_request_in_a_group_of_its_own(tiny):
    def alone(i, sampling):
        return ("seeded", i) if sampling.seed is not None else sampling

    unseeded = SamplingParams(n=1, max_tokens=3)
    _, calls = served(tiny, [(A, SEEDED), (B, unseeded), (C, SEEDED), (A, unseeded)], key=alone)
    _, pad = tiny
    assert [sampling for _, sampling in calls] == [SEEDED, unseeded, SEEDED]
    assert [c[0].shape[0] for c in calls] == [1, 2, 1]
    assert torch.equal(calls[1][0], left_pad([B, A], pad)[0])


def test_a_prompt_asked_m_times_is_sent_once_with_m_times_n_samples(tiny):
    results, calls = served(tiny, [(A, SEEDED), (B, SEEDED), (A, SEEDED), (B, SEEDED)], share_prompts=True)
    engine, pad = tiny
    ((prompt_ids, sampling),) = calls
    assert torch.equal(prompt_ids, left_pad([A, B], pad)[0]) and sampling.n == 4  # 2 askers * n=2
    out = engine.generate(_prompts(A, B, pad), SamplingParams(n=4, max_tokens=4, seed=1))
    rows = [[out["responses"][r, : int(out["response_attention"][r].sum())].tolist() for r in range(k, k + 2)]
            for k in (0, 4, 2, 6)]  # A's first asker, B's first, A's second, B's second  # fmt: skip
    assert [[list(t) for t in ids(r[0])] for r in results] == rows


def test_prompts_asked_unequally_are_each_their_own_row(tiny):
    _, calls = served(tiny, [(A, SEEDED), (A, SEEDED), (B, SEEDED)], share_prompts=True)
    _, pad = tiny
    ((prompt_ids, sampling),) = calls
    assert torch.equal(prompt_ids, left_pad([A, A, B], pad)[0]) and sampling.n == 2


def test_a_failed_call_reaches_every_future_of_its_group_and_no_other(tiny):
    out_of_vocabulary = (5, 10_000)
    results, calls = served(tiny, [(A, SEEDED), (B, OTHER), (out_of_vocabulary, SEEDED)])
    assert len(calls) == 2
    assert isinstance(results[0], IndexError) and results[2] is results[0]
    assert len(results[1][0]) == 1


def test_drain_returns_once_what_was_queued_is_served(tiny):
    engine, pad = tiny
    worker = EngineWorker(engine, pad_id=pad)
    futures = [worker.submit(p, OTHER) for p in (A, B)]
    worker.drain()
    assert all(f.done() for f in futures) and [len(f.result()) for f in futures] == [1, 1]
    worker.close()


def test_gather_takes_what_waits_and_leaves_the_item_it_refuses():
    source: queue.Queue = queue.Queue()
    for item in (2, 3, "op", 4):
        source.put(item)
    start = time.monotonic()
    assert gather(source, 1, after_last(0.01), lambda item: isinstance(item, int)) == ([1, 2, 3], "op")
    assert source.get_nowait() == 4 and time.monotonic() - start < 1
    assert gather(source, 5, after_last(0.01)) == ([5], None)


def _prompts(a, b, pad):
    input_ids, attention_mask, position_ids = left_pad([a, b], pad)
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})
