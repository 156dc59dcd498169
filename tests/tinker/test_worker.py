"""Rank 0's worker (`rlcore.tinker.ops.Worker`): sample requests that arrive together are served in one batch,
and an operation met while gathering them still runs before everything that arrived after it (a training
client's requests must run in seq_id order)."""

from __future__ import annotations

import time

from rlcore.rollout.base import SamplingParams
from rlcore.tinker.futures import Futures, Result
from rlcore.tinker.ops import OptimStep, Worker
from rlcore.tinker.sampling import SampleOp


class Recorder:
    """Stands in for `TinkerModels` (what the worker runs): records the order of the calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def run(self, op):
        self.calls.append(op.adam["learning_rate"])
        return Result(json={})

    def sample(self, ops):
        self.calls.append(("sample", len(ops)))
        return [b""] * len(ops)


def test_operations_keep_their_order_around_a_batch_of_samples():
    served, futures = Recorder(), Futures()
    worker = Worker(served, futures)
    sample = SampleOp(sampler_id="s", prompt=(1, 2), sampling=SamplingParams(max_tokens=1), prompt_logprobs=False)
    items = [sample, sample, OptimStep("m", {"learning_rate": 1.0}), OptimStep("m", {"learning_rate": 2.0}), sample]
    for i, op in enumerate(items):
        worker.submit(f"r{i}", op)
    deadline = time.monotonic() + 10
    while len(served.calls) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert served.calls == [("sample", 2), 1.0, 2.0, ("sample", 1)]
