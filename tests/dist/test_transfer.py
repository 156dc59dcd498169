"""rlcore.dist.transfer on 2 gloo ranks: a rollout batch arrives whole (tensors of every dtype, empty
ones, per-row values, meta), blocking and async, without pickle."""

from __future__ import annotations

import pytest
import torch

from rlcore.batch import Batch
from rlcore.dist.transfer import header
from rlcore.models import load_policy
from tests.dist import workers


def sample_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch.from_dict(
        {
            "responses": torch.randint(0, 100, (4, 5), generator=g),
            "response_mask": torch.rand(4, 5, generator=g),
            "bf16": torch.rand(4, 2, generator=g).to(torch.bfloat16),
            "flags": torch.rand(4, generator=g) > 0.5,
            "empty": torch.zeros(4, 0),
            "uid": [f"u{i // 2}" for i in range(4)],
            "ground_truth": ["12", {"answer": [1, 2]}, None, 3.5],
            "extra_info": [{"index": i, "tags": ["a", "b"]} for i in range(4)],
        },
        meta={"step": 3 + seed, "note": "lagged"},
    )


def test_a_batch_arrives_whole_blocking_and_async(tmp_path) -> None:
    workers.spawn("transfer_worker", tmp_path)
    got = torch.load(tmp_path / "received.pt", weights_only=False)
    for key, seed in (("first", 0), ("second", 1)):
        sent, received = sample_batch(seed), got[key]
        for name, tensor in sent.tensors.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
        assert received["rows"] == dict(sent.non_tensors)
        assert received["meta"] == dict(sent.meta)


def test_values_json_cannot_carry_are_refused_naming_the_field() -> None:
    batch = Batch.from_dict({"x": torch.zeros(1), "extra_info": [{"blob": b"bytes"}]})
    with pytest.raises(ValueError, match="field 'extra_info' holds values JSON cannot carry"):
        header(batch)


def test_a_weight_push_over_a_group_reaches_the_other_ranks_engine(tmp_path) -> None:
    workers.spawn("weights_worker", tmp_path)
    trainer = torch.load(tmp_path / "trainer.pt", weights_only=True)
    engine = torch.load(tmp_path / "engine.pt", weights_only=True)
    assert trainer.keys() == engine.keys()
    assert not torch.equal(
        trainer["model.embed_tokens.weight"],
        load_policy("builtin:tiny", seed=0)[0].state_dict()["model.embed_tokens.weight"],
    )
    for name, tensor in trainer.items():
        assert torch.equal(engine[name], tensor), name  # seed 0 -> seed 1 weights, tied head included
