"""The server under torchrun on 2 gloo ranks (rank 0 serves, both train; FSDP2 splits the model): the datums of
a forward_backward are split over the ranks, a rank short of micro-batches runs a zero-weighted one, the
gradients are summed, and the result equals one process's. A state saved by 2 ranks loads in 1."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from tests.tinker.loop import WAIT, rl_step
from tests.tinker.server import client, running

BASE = "builtin:tiny-reverse"
PROBE = types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 25))),
                    loss_fn_inputs={"target_tokens": list(range(6, 26)), "weights": [1.0] * 20})  # fmt: skip


def _probe(training) -> torch.Tensor:
    return training.forward([PROBE], "cross_entropy").result(WAIT).loss_fn_outputs[0]["logprobs"].to_torch()


def _train(url: str, rank: int, save: bool) -> tuple[list[dict], torch.Tensor, str | None]:
    training = client(url).create_lora_training_client(base_model=BASE, rank=rank).result(WAIT)
    tokenizer = training.get_tokenizer()
    steps = [rl_step(training, tokenizer, step, prompts=3, group=3) for step in range(2)]  # 9 datums a step
    path = training.save_state("two-ranks").result(WAIT).path if save else None
    return steps, _probe(training), path


@pytest.mark.parametrize("rank", [0, 8], ids=["full", "lora"])
def test_two_gloo_ranks_train_as_one_process_does(tmp_path, rank):
    flags = ("--micro-batch-tokens", "1")  # a datum a pass: of 9, rank 0 runs 5, rank 1 runs 4 and a zero-weighted one
    with running(tmp_path / "one", *flags) as url:
        one, one_probe, _ = _train(url, rank, save=False)
    with running(tmp_path / "two", *flags, ranks=2) as url:
        two, two_probe, path = _train(url, rank, save=True)
    assert one[0]["tokens"] == two[0]["tokens"]  # the same starting weights sample the same tokens
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-4)  # a sum of ~150 terms near 0
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    torch.testing.assert_close(two_probe, one_probe, rtol=0, atol=1e-5)
    assert not torch.equal(two_probe, _initial_probe(tmp_path / "fresh"))  # it trained
    with running(tmp_path / "two") as url:  # the 2-rank state (sharded over 2) loads into one process
        loaded = client(url).create_training_client_from_state_with_optimizer(path).result(WAIT)
        assert torch.equal(_probe(loaded), two_probe)


def _initial_probe(workdir) -> torch.Tensor:
    with running(workdir) as url:
        return _probe(client(url).create_lora_training_client(base_model=BASE, rank=0).result(WAIT))


@pytest.mark.parametrize("rank", [0, 8], ids=["full", "lora"])
def test_split_placement_samples_on_rank_0_and_trains_on_the_others(tmp_path, rank):
    """torchrun with 3 ranks and --rollout-ranks 1: rank 0 holds the engine and samples, ranks 1-2 train (FSDP2);
    each save_weights_for_sampler pushes the weights from the trainer ranks to rank 0. The steps equal one
    process's, and the state loads in one process."""
    flags = ("--micro-batch-tokens", "1")
    with running(tmp_path / "one", *flags) as url:
        one, one_probe, _ = _train(url, rank, save=False)
    with running(tmp_path / "split", *flags, "--rollout-ranks", "1", ranks=3) as url:
        two, two_probe, path = _train(url, rank, save=True)
    for a, b in zip(one, two, strict=True):
        assert a["tokens"] == b["tokens"]  # the pushed weights sample as the colocated engine's
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    torch.testing.assert_close(two_probe, one_probe, rtol=0, atol=1e-5)
    with running(tmp_path / "split") as url:
        loaded = client(url).create_training_client_from_state_with_optimizer(path).result(WAIT)
        assert torch.equal(_probe(loaded), two_probe)
