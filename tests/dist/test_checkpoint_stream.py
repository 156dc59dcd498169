"""DCP checkpoints and the full-state streamer on 2 FSDP2 ranks (gloo), one spawn for all checks.

- save -> load into a fresh, differently initialised sharded model + optimizer -> the next step is
  bit-identical (weights and metrics) to the step taken without the round trip;
- the 2-rank checkpoint loads into a plain one-process model (another world size) exactly;
- `save_hf_pretrained` from the sharded model loads with a plain `from_pretrained`, every tensor
  equal and the tied embedding still tied; checkpoint bookkeeping (latest, prune, atomicity).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from configs import AlgoConfig, OptimConfig
from rlcore.dist import (
    iter_full_state,
    latest_checkpoint,
    load_checkpoint,
    prune,
    save_checkpoint,
    save_hf_pretrained,
)
from rlcore.models import load_policy
from rlcore.trainer.algorithm import optimizer as build_optimizer
from tests.dist import workers
from tests.dist.rollouts import fake_rollout, with_logprobs

ALGO = AlgoConfig(micro_batch_size=2)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=3)  # the scheduler state matters after the reload


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    model, _ = load_policy("builtin:tiny")
    batch = with_logprobs(model, fake_rollout(4, 3, max_prompt=6, max_response=12, seed=2))
    torch.save({**batch.tensors, **batch.non_tensors}, directory / "batch.pt")
    workers.spawn("checkpoint_and_stream", directory, ALGO, OPTIM)
    return directory, torch.load(directory / "checkpoint.pt")


def test_resume_is_bit_identical(run):
    _, out = run
    assert out["extra"]["step"] == 1 and out["extra"]["scheduler"]["last_epoch"] == 1
    assert set(out["after_resumed"]) == set(out["after_second"])
    for key, value in out["after_second"].items():
        assert torch.equal(out["after_resumed"][key], value), key
    moved = [k for k, v in out["after_second"].items() if not torch.equal(out["after_first"][k], v)]
    assert len(moved) == len(out["after_second"])  # the second step changed every tensor
    math_only = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in (out["resumed_metrics"], out["metrics"])]
    assert math_only[0] == math_only[1]  # (perf/: memory measures; FSDP's gathered weights count where held)
    assert out["metrics"]["actor/lr"] == pytest.approx(OPTIM.lr * 2 / 3)  # second warm-up update
    for key, value in out["rng_saved"].items():  # rank 0's RNG tensors came back
        assert torch.equal(out["rng_loaded"][key], value)


def test_checkpoint_loads_in_one_process(run):
    directory, out = run
    path = latest_checkpoint(directory / "ckpt")
    assert path is not None and path.name == "step_1"
    model, _ = load_policy("builtin:tiny", seed=7)
    optimizer = build_optimizer(model, OPTIM)
    extra, tensors = load_checkpoint(path, model, optimizer)
    assert extra["step"] == 1 and set(tensors) == set(out["rng_saved"])
    state = model.state_dict()
    for key, value in out["after_first"].items():
        assert torch.equal(state[key], value), key
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(optimizer.state) == len(list(model.parameters()))  # Adam moments restored too


def test_hf_export_round_trips(run):
    directory, out = run
    hf = directory / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())  # small buckets: several files
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as the embedding
    loaded = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied again
    state = loaded.state_dict()
    for key, value in out["after_second"].items():
        assert torch.equal(state[key], value), key
    assert (hf / "tokenizer_config.json").is_file()


def test_latest_ignores_partial_and_prune_keeps_newest(tmp_path):
    for step in (3, 10, 20):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "COMPLETE").write_text("{}")
    (tmp_path / "step_30.tmp").mkdir()  # a save that crashed
    (tmp_path / "step_40").mkdir()  # renamed without COMPLETE: never produced by save_checkpoint
    assert latest_checkpoint(tmp_path).name == "step_20"  # numeric order, not lexical (3 < 10 < 20)
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_3", "step_30.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_20", "step_40"]
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_40", torch.nn.Linear(1, 1), None)


def test_iter_full_state_of_a_plain_module_in_buckets():
    model, _ = load_policy("builtin:tiny")
    limit = 100_000
    buckets = list(iter_full_state(model, bucket_bytes=limit))
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == [k for k in model.state_dict() if k != "lm_head.weight"]  # order kept, tie sent once
    for bucket in buckets[:-1]:  # a bucket closes at the first tensor that reaches the limit
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) >= limit and sum(sizes[:-1]) < limit
    state = model.state_dict()
    assert all(torch.equal(t, state[name]) for bucket in buckets for name, t in bucket)


def test_one_process_checkpoint_and_export(tmp_path):
    """`python train.py` (no process group): save -> load -> same next step; a single-file HF export."""
    model, tokenizer = load_policy("builtin:tiny")
    batch = with_logprobs(model, fake_rollout(2, 3, max_prompt=6, max_response=8, seed=3))
    state = workers.new_state(model, OPTIM)
    state, _ = workers.update_step(state, batch, ALGO, OPTIM, horizon=8)
    save_checkpoint(
        tmp_path / "ckpt", 1, model, state.optimizer, extra={"scheduler": state.scheduler.state_dict()}
    )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]  # the .tmp was renamed
    _, expected = workers.update_step(state, batch, ALGO, OPTIM, horizon=8)

    fresh, _ = load_policy("builtin:tiny", seed=9)
    resumed = workers.new_state(fresh, OPTIM)
    extra, tensors = load_checkpoint(tmp_path / "ckpt" / "step_1", fresh, resumed.optimizer)
    resumed.scheduler.load_state_dict(extra["scheduler"])
    assert tensors == {}  # none were saved
    _, got = workers.update_step(resumed, batch, ALGO, OPTIM, horizon=8)
    assert got == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))

    save_hf_pretrained(model, tokenizer, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
