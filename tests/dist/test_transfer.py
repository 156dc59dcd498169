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
    image = {"pixel_values": torch.rand(6, 12, generator=g), "image_grid_thw": torch.tensor([[1, 2, 3]])}
    other = {"pixel_values": torch.rand(4, 12, generator=g), "image_grid_thw": torch.tensor([[1, 2, 2]])}
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
            "multi_modal_inputs": [image, image, {}, other],  # a prompt's images, shared by its 2 samples
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
        images, sent_images = received["rows"].pop("multi_modal_inputs"), sent["multi_modal_inputs"]
        assert received["rows"] == {k: v for k, v in sent.non_tensors.items() if k != "multi_modal_inputs"}
        assert received["meta"] == dict(sent.meta)
        for got_row, sent_row in zip(images, sent_images, strict=True):
            assert got_row.keys() == sent_row.keys()
            for name, tensor in sent_row.items():
                assert got_row[name].dtype == tensor.dtype and torch.equal(got_row[name], tensor), name
        assert images[0]["pixel_values"] is images[1]["pixel_values"]  # sent once, shared again


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
