"""train.py on 2-D meshes (issue 21): 2 gloo ranks with --trainer.tp 2 or --trainer.sp 2 train the
default task (and tp x sp on 4 ranks an untied model) as one process does (every metric within 1e-5 over 4 steps: the two ranks hold one model
split, and train the batch one process trains); a checkpoint saved at tp 2 resumes in one process; a
mesh that does not fit the world exits 2 naming its factors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlcore.trainer.logger import read_metrics
from tests.frames import our_frames
from tests.smoke.test_torchrun import torchrun
from tests.smoke.test_train import ok, train

ARGS = ["--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--trainer.steps", "4",
        "--trainer.val-every", "0", "--log.no-progress"]  # fmt: skip
PPO_KL = ["ppo", "--algo.use-kl-loss"]
"""PPO with a KL loss: the critic and the reference are split too."""
UNCOMPARED = ("timing/", "throughput/", "perf/", "sync/", "actor/shared_prompt_frac")
"""Wall times, and under sp the packing share (shared-prompt packing is off there)."""
ABSOLUTE = ("rollout/logprob_diff_",)
"""Differences of ~1e-7 between two forwards: compared absolutely."""


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    """A Hugging Face directory of the built-in tiny shape with lm_head untied from the embeddings (as in
    most models past 3B): tp splits it by vocabulary, where the built-in model's tied head stays whole."""
    from transformers import LlamaForCausalLM

    from rlcore.models.policy import builtin_config, load_policy

    _, tokenizer = load_policy("builtin:tiny")
    config = builtin_config("tiny", tokenizer)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("untied")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, untied) -> dict[str, Path]:
    """The 1-process runs: of the default model, and of the untied one."""
    out = {"default": tmp_path_factory.mktemp("one"), "untied": tmp_path_factory.mktemp("one-untied")}
    ok(train(*ARGS, out=out["default"]))
    ok(train(*PPO_KL, *ARGS, "--model.path", str(untied), out=out["untied"]))
    return out


def assert_same_metrics(expected: list[dict], got: list[dict], tol: float = 1e-5) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got, strict=True):
        compared = {k for k in want if not k.startswith(UNCOMPARED)}  # (a trainer rank has no rollout phase peak)
        assert compared <= set(have), compared - set(have)  # a resumed run logs its model counts again
        for key, value in want.items():
            if key.startswith(UNCOMPARED) or not isinstance(value, float):
                continue
            scale = 1.0 if key.startswith(ABSOLUTE) else abs(value)
            close = (
                abs(have[key] - value) <= tol * scale + 1e-6
            )  # a mean of ~0 (whitened advantages): rounding
            assert close, (want["step"], key, value, have[key])


@pytest.mark.parametrize("axis", ["tp", "sp", "tp+sp"])
def test_ranks_that_split_one_model_train_like_one_process(axis, one_process, untied, tmp_path):
    """GRPO at tp 2, sp 2 on 2 ranks; both on 4 ranks (the mesh (1, 2, 2), Ulysses over the tp shards'
    heads) with PPO + KL loss (policy, critic and reference split alike) on the untied model (its
    lm_head split by vocabulary: vocab-parallel log-probs and entropies)."""
    flags = [arg for name in axis.split("+") for arg in (f"--trainer.{name}", "2")]
    nproc = len(flags)  # 2 per axis
    model = "untied" if axis == "tp+sp" else "default"
    preset = PPO_KL if model == "untied" else []
    if model == "untied":
        flags += ["--model.path", str(untied)]
    proc = torchrun(
        *preset, *ARGS, *flags, "--trainer.save-every", "2", "--out-dir", str(tmp_path), nproc=nproc
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    expected = read_metrics(one_process[model] / "metrics.jsonl")
    assert_same_metrics(expected, read_metrics(tmp_path / "metrics.jsonl"))
    assert expected[-1]["actor/grad_norm"] > 0
    assert (tmp_path / "final" / "model.safetensors").is_file()  # gathered whole from the shards
    step_2 = tmp_path / "checkpoints" / "step_2"
    o_proj, embed = (
        _chunks(step_2, f"model.model.{k}.weight") for k in ("layers.0.self_attn.o_proj", "embed_tokens")
    )
    head = _chunks(step_2, "model.lm_head.weight")
    if axis == "tp":  # o_proj split by its input (the heads); the tied lm_head and embeddings whole
        assert (o_proj, head, embed) == ([(96, 48)] * 2, [(103, 96)], [(103, 96)])
    elif axis == "sp":  # FSDP2 over the sp ranks: every parameter sharded by rows
        assert (o_proj, embed) == ([(48, 96), (48, 96)], [(52, 96), (51, 96)])
    else:  # tp's split, each half sharded by rows over the sp ranks; lm_head by vocabulary, then rows
        assert (o_proj, head, embed) == ([(48, 48)] * 4, [(26, 96)] * 3 + [(25, 96)], [(52, 96), (51, 96)])
    if axis == "tp":  # the checkpoint of step 2, saved from the tp shards, resumes in one process
        resumed = tmp_path / "resumed"
        ok(train(*ARGS, "--resume", str(step_2), out=resumed))
        assert_same_metrics(expected[2:], read_metrics(resumed / "metrics.jsonl"))


def test_selective_checkpointing_at_tp_2_trains_like_one_process(one_process, tmp_path):
    """--model.selective-checkpointing on tensor-parallel layers (DTensor products kept, the rest recomputed
    in backward on each rank): the one process's metrics, as tp 2 without it, with less saved for backward."""
    saved = {}
    for name, flags in (("plain", []), ("selective", ["--model.selective-checkpointing"])):
        proc = torchrun(*ARGS, "--trainer.tp", "2", *flags, "--out-dir", str(tmp_path / name), nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = read_metrics(tmp_path / name / "metrics.jsonl")
        assert_same_metrics(read_metrics(one_process["default"] / "metrics.jsonl"), got)
        saved[name] = got[-1]["perf/mem/saved_tensors_mb"]
    assert saved["selective"] < 0.8 * saved["plain"], saved


def test_a_tp_trainer_mesh_under_split_placement_trains_like_one_process(one_process, tmp_path):
    """1 rollout rank + 2 trainer ranks at tp 2 (3 processes, K = 0): the trainer ranks hold one model
    split between them, both receive the whole batch, and the leader gathers whole tensors from the tp
    shards for the push; every metric is the one process's within 1e-5 (the rollout/trainer gap too:
    a push of half a tensor, or of the other peer's part, would be far off)."""
    proc = torchrun(*ARGS, "--trainer.tp", "2", "--pipeline.placement", "split", "--trainer.save-every", "2",
                    "--out-dir", str(tmp_path), nproc=3)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, got = (read_metrics(d / "metrics.jsonl") for d in (one_process["default"], tmp_path))
    assert_same_metrics(expected, got)
    assert all(r["sync/bytes"] > 0 for r in got)
    step_2 = tmp_path / "checkpoints" / "step_2"  # the trainer ranks split o_proj by its input (the heads)
    assert _chunks(step_2, "model.model.layers.0.self_attn.o_proj.weight") == [(96, 48)] * 2


def _chunks(checkpoint: Path, key: str) -> list[tuple[int, ...]]:
    """The shapes of the pieces the ranks saved of `key` in a checkpoint's DCP index."""
    from rlcore.dist.safe_dcp import SafeFileSystemReader

    index = SafeFileSystemReader(str(checkpoint / "dcp")).read_metadata()
    return [tuple(chunk.sizes) for chunk in index.state_dict_metadata[key].chunks]


def test_a_mesh_that_does_not_fit_the_world_names_its_factors(tmp_path):
    proc = torchrun(*ARGS, "--trainer.tp", "4", "--out-dir", str(tmp_path), timeout=120)
    assert proc.returncode != 0
    expected = ("error: --trainer.tp 4: dp_shard(0) * tp(4) != world size (2): every factor must be >= 1 and "
                "their product must divide the number of processes")  # fmt: skip
    assert expected in proc.stderr, proc.stderr[-2000:]  # each rank says it; their writes may interleave
    assert not our_frames(proc.stderr), proc.stderr[-3000:]  # torchrun's own traceback only


def test_lora_at_tp_2_trains_like_one_process(untied, tmp_path):
    """PPO + KL loss with LoRA on the policy and the critic at tp 2 (the adapters split with their base
    layers, rlcore.dist.tp.ADAPTER_PLANS; the reference is the policy with its adapter disabled), on the
    untied model (vocab-parallel log-probs): every metric is one process's within 1e-5, and the adapter
    exported from the tp shards is the one process's (to 1e-3 of each tensor's norm: the basis below). The adapters are
    drawn from the run's seed, so the engine copy a tp rank builds first does not shift the critic's."""
    from safetensors.torch import load_file

    lora = [*PPO_KL, *ARGS, "--trainer.steps", "2", "--model.path", str(untied), "--model.lora-rank", "8",
            "--critic.lora-rank", "4"]  # fmt: skip
    one = tmp_path / "one"
    ok(train(*lora, out=one))
    proc = torchrun(*lora, "--trainer.tp", "2", "--out-dir", str(tmp_path / "tp"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, got = (read_metrics(d / "metrics.jsonl") for d in (one, tmp_path / "tp"))
    assert_same_metrics(expected, got)
    assert expected[-1]["actor/grad_norm"] > 0 and expected[-1]["critic/grad_norm"] > 0
    want, have = (
        load_file(d / "final" / "adapter" / "adapter_model.safetensors") for d in (one, tmp_path / "tp")
    )
    assert want.keys() == have.keys() and len(want) == 2 * 7 * 4  # A and B of 7 linears in 4 decoder layers
    # The bound's basis: tp sums each product in two halves, so gradients differ by float rounding, and Adam
    # (lr * g / (|g| + eps)) turns that into up to ~lr on the elements whose gradient is near 0. Measured, the
    # worst tensor's difference over its norm: 1.0e-4 on an AMX Xeon, 2.2e-5 on an AVX-512 EPYC (2026-12-06);
    # the bound is 10x the larger. A mis-split adapter is off by O(1) of its norm.
    for key, tensor in want.items():
        assert (have[key] - tensor).norm() <= 1e-3 * tensor.norm(), key
