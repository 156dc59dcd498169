"""save_state, a server restart, then a training client from that state with its optimizer: the next steps
equal those of the run that was never stopped, bit for bit (LoRA and full fine-tuning)."""

from __future__ import annotations

import pytest

from tests.tinker.loop import WAIT, rl_step, same
from tests.tinker.server import client, running

BASE = "builtin:tiny-reverse"


@pytest.mark.parametrize("rank", [0, 8], ids=["full", "lora"])
def test_a_resumed_loop_continues_bit_for_bit_after_a_server_restart(tmp_path, rank):
    with running(tmp_path) as url:
        training = client(url).create_lora_training_client(base_model=BASE, rank=rank).result(WAIT)
        tokenizer = training.get_tokenizer()
        for step in range(2):
            rl_step(training, tokenizer, step)
        path = training.save_state("mid").result(WAIT).path
        uninterrupted = [rl_step(training, tokenizer, step) for step in (2, 3)]
    with running(tmp_path) as url:  # a new process: nothing survives but the work directory
        service = client(url)
        resumed = service.create_training_client_from_state_with_optimizer(path).result(WAIT)
        assert resumed.get_info().lora_rank == rank
        again = [rl_step(resumed, tokenizer, step) for step in (2, 3)]
        weights_only = service.create_training_client_from_state(path).result(WAIT)
        without = [rl_step(weights_only, tokenizer, step) for step in (2, 3)]
    assert all(same(a, b) for a, b in zip(uninterrupted, again, strict=True))
    assert same(uninterrupted[0], without[0])  # the same weights: the same samples and gradients,
    assert not same(uninterrupted[1], without[1])  # but Adam started afresh: the step after differs
