"""Code that runs inside the 2 spawned gloo ranks of tests/dist (kept out of the test modules so the
children import little). Each worker writes what rank 0 saw to files the test process compares."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from configs import AlgoConfig, OptimConfig
from rlcore.batch import Batch
from rlcore.dist import (
    apply_activation_checkpointing,
    apply_fsdp,
    build_mesh,
    gathered_state,
    init_distributed,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    save_hf_pretrained,
)
from rlcore.dist.ep import apply_ep, expert_params
from rlcore.models.recompute import selective_contexts
from rlcore.models import load_policy
from rlcore.models.forward import compute_logprobs, micro_batches
from tests.configured import new_state, update
from tests.configured import update as update_step  # noqa: F401  (the tests call workers.update_step)

WORLD = 2
EP_AXES = ("ep_replicate", "ep")


def spawn(worker: str, directory: Path, *args) -> None:
    """Run `worker(rank, directory, *args)` on WORLD gloo ranks (a FileStore in `directory`)."""
    store = str(directory / f"store-{worker}")
    mp.spawn(_entry, args=(worker, store, str(directory), args), nprocs=WORLD, join=True)


def _entry(rank: int, worker: str, store: str, directory: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        globals()[worker](rank, Path(directory), *args)
    finally:
        dist.destroy_process_group()


def rank_rows(batch: Batch, *, n: int, prompts_per_update: int, rank: int, world: int) -> Batch:
    """This rank's rows: its share of every mini-batch (whole groups of n rows), in order."""
    rows = []
    per_rank = prompts_per_update // world
    for first in range(0, len(batch) // n, prompts_per_update):
        start = (first + rank * per_rank) * n
        rows.extend(range(start, start + per_rank * n))
    return batch[rows]


def scenario_model(sc: dict) -> Any:
    """builtin:tiny (builtin:tiny-moe when the scenario says `moe`), with seeded LoRA adapters when it
    says `lora` (the same init everywhere)."""
    model, _ = load_policy("builtin:tiny-moe" if sc.get("moe") else "builtin:tiny")
    if sc.get("lora"):
        from rlcore.models.lora import apply_lora

        torch.manual_seed(7)
        model = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=())
        with torch.no_grad():  # B != 0, so that A's gradient is not 0 either
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape) * 0.05)
    return model


def update_scenarios(rank: int, directory: Path, scenarios: list[dict]) -> None:
    """One update_step per scenario on an FSDP2-sharded builtin:tiny; rank 0 saves metrics + full weights."""
    info = init_distributed("cpu")
    batch = torch.load(directory / "batch.pt", weights_only=True)
    batch = Batch.from_dict(batch)
    # compute_logprobs on the sharded model, ranks holding 9 and 3 rows and a small token budget:
    # rank 1 runs fewer real micro-batches and pads with empty ones (FSDP needs equal pass counts)
    model, _ = load_policy("builtin:tiny")
    apply_fsdp(model, build_mesh(info))
    mine = batch[:9] if rank == 0 else batch[9:]
    lp, ent = compute_logprobs(model, mine, max_tokens=24, with_entropy=True)
    pieces = len(micro_batches(mine, max_tokens=24))
    torch.save({"logprobs": lp, "entropy": ent, "pieces": pieces}, directory / f"logprobs_rank{rank}.pt")
    for sc in scenarios:
        mesh = build_mesh(info, replicate=sc["replicate"])
        model = scenario_model(sc)
        experts = None
        if sc.get("checkpointing"):  # the backward recomputes each layer: its all-to-alls again
            selective = sc["checkpointing"] == "selective"
            apply_activation_checkpointing(model, context_fn=selective_contexts if selective else None)
        if sc.get("ep"):  # experts over an (ep_replicate, ep) mesh of the 2 ranks, FSDP2 for the rest
            apply_ep(model, DeviceMesh("cpu", torch.arange(WORLD).view(sc["ep"]), mesh_dim_names=EP_AXES))
            experts = expert_params(model)
        apply_fsdp(model, mesh, ignored_params=experts)
        state = new_state(model, sc["optim"])
        prompts = sc["algo"].mini_batch_size or len(batch) // sc["n"]
        rows = Batch.from_dict(torch.load(directory / "batch_moe.pt", weights_only=True)) if sc.get("moe") else batch
        local = rank_rows(rows, n=sc["n"], prompts_per_update=prompts, rank=rank, world=WORLD)
        state, metrics = update(state, local, sc["algo"], sc["optim"], mesh=mesh, horizon=sc["horizon"])
        weights = gathered_state(model)
        if rank == 0:
            torch.save({"metrics": metrics, "weights": weights}, directory / f"{sc['name']}.pt")


def checkpoint_and_stream(rank: int, directory: Path, algo: AlgoConfig, optim: OptimConfig) -> None:
    """Step, save (DCP), step; a fresh differently-initialised model loads the checkpoint and steps;
    then the first model is exported with save_hf_pretrained (small buckets: several files)."""
    info = init_distributed("cpu")
    mesh = build_mesh(info)
    data = torch.load(directory / "batch.pt", weights_only=True)
    batch = Batch.from_dict(data)
    half = len(batch) // 2
    first, second = batch[:half], batch[half:]  # two training steps' data, 2 prompts x 3 each
    local = [rank_rows(b, n=3, prompts_per_update=2, rank=rank, world=WORLD) for b in (first, second)]

    model, tokenizer = load_policy("builtin:tiny", seed=0)
    apply_fsdp(model, mesh)
    state = new_state(model, optim)
    state, _ = update(state, local[0], algo, optim, mesh=mesh, horizon=12)
    after_first = gathered_state(model)
    rng = rng_state()
    save_checkpoint(
        directory / "ckpt",
        1,
        model,
        state.optimizer,
        extra={"step": 1, "scheduler": state.scheduler.state_dict()},
        tensors=rng,
    )
    state, metrics = update(state, local[1], algo, optim, mesh=mesh, horizon=12)
    after_second = gathered_state(model)

    fresh, _ = load_policy("builtin:tiny", seed=5)  # different weights before loading
    apply_fsdp(fresh, mesh)
    resumed = new_state(fresh, optim)
    extra, tensors = load_checkpoint(latest_checkpoint(directory / "ckpt"), fresh, resumed.optimizer)
    resumed.scheduler.load_state_dict(extra["scheduler"])
    resumed, resumed_metrics = update(resumed, local[1], algo, optim, mesh=mesh, horizon=12)
    after_resumed = gathered_state(fresh)

    save_hf_pretrained(model, tokenizer, directory / "hf", bucket_bytes=64 * 2**10)
    if rank == 0:
        torch.save(
            {
                "after_first": after_first,
                "after_second": after_second,
                "after_resumed": after_resumed,
                "metrics": metrics,
                "resumed_metrics": resumed_metrics,
                "rng_saved": rng,
                "rng_loaded": tensors,
                "extra": extra,
            },
            directory / "checkpoint.pt",
        )


def critic_update_worker(rank: int, directory: Path, batch: Batch) -> None:
    """One critic update on this rank's rows of `batch` (whole prompt groups), FSDP2 over 2 ranks."""
    from configs import CriticConfig
    from rlcore.step.critic import build_critic
    from tests.configured import update_critic

    info = init_distributed("cpu")
    mesh = build_mesh(info)
    critic = apply_fsdp(build_critic("builtin:tiny", seed=0), mesh)
    state = new_state(critic, OptimConfig(lr=1e-3, eps=1e-3))
    mine = rank_rows(batch, n=2, prompts_per_update=len(batch) // 2, rank=rank, world=WORLD)
    algo = AlgoConfig(micro_batch_size=3)
    state, metrics = update_critic(state, mine, algo, CriticConfig(value_clip=0.2), mesh=mesh, horizon=6)
    weights = gathered_state(critic)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, directory / "critic.pt")


def reduce_metrics_worker(rank: int, directory: Path) -> None:
    """Each rank reduces its own metrics; every rank writes what it got."""
    import json

    from rlcore.dist.reduce import reduce_metrics

    mesh = build_mesh(init_distributed("cpu"))
    local = {"a": rank + 1.0, "b_max": 10.0 * rank, "c/min": 5.0 - rank, "d/max": -1.0 - rank}
    if rank == 0:
        local["only_rank0"] = 7.0
    (directory / f"reduced{rank}.json").write_text(json.dumps(reduce_metrics(local, mesh)))


def context_worker(rank: int, directory: Path) -> None:
    """Only rank 1 holds a prompt too long for builtin:tiny-reverse's 2048 positions beside 1900 tokens;
    every rank writes what `check_context` said."""
    import dataclasses

    from configs import PRESETS, ConfigError
    from rlcore.config.model_checks import check_context

    cfg = PRESETS["grpo"][1]
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_tokens=1900))
    lengths = {"--data.train-files": [10, 20] + ([200] if rank == 1 else [])}
    try:
        check_context(cfg, lengths)
        said = "fits"
    except ConfigError as e:
        said = str(e)
    (directory / f"context{rank}.txt").write_text(said)


def exact_rows_worker(rank: int, directory: Path, differ: bool) -> None:
    """Each rank's exact products in the layout its own CPU chose: rank 1 in tiles of 64 where `differ`;
    every rank writes what `agree_exact_rows` said."""
    from configs import ConfigError
    from rlcore.models import exact_kernels
    from rlcore.trainer.models import agree_exact_rows

    exact_kernels.ROWS[torch.float32] = exact_kernels.KernelRows(tile=64) if differ and rank == 1 else exact_kernels.KernelRows()
    try:
        agree_exact_rows()
        said = "agree"
    except ConfigError as e:
        said = str(e)
    (directory / f"exact_rows{rank}.txt").write_text(said)


def transfer_worker(rank: int, directory: Path) -> None:
    """Rank 0 sends two batches (one blocking, one async with a collective in between); rank 1 saves them."""
    from rlcore.dist.transfer import recv_batch, send_batch
    from tests.dist.test_transfer import sample_batch

    if rank == 0:
        send_batch(sample_batch(), dst=1)
        works = send_batch(sample_batch(seed=1), dst=1, async_op=True)
        dist.broadcast(torch.ones(3), src=0)  # e.g. a weight push the receiver joins before reading
        for work in works:
            work.wait()
        return
    first = recv_batch(src=0)
    dist.broadcast(torch.zeros(3), src=0)
    second = recv_batch(src=0)
    plain = {key: dict(b.tensors) | {"rows": dict(b.non_tensors), "meta": dict(b.meta)}
             for key, b in (("first", first), ("second", second))}  # fmt: skip
    torch.save(plain, directory / "received.pt")


def weights_worker(rank: int, directory: Path) -> None:
    """Rank 1 (a trainer) broadcasts a push of its model; rank 0's native engine copy loads it in one call."""
    from rlcore.dist.stream import WeightPush
    from rlcore.dist.transfer import broadcast_weights, receive_weights
    from rlcore.rollout.native.engine import NativeEngine

    if rank == 1:
        model, _ = load_policy("builtin:tiny", seed=1)
        with WeightPush(model, bucket_bytes=1) as push:
            broadcast_weights(model, push, src=1)
        torch.save(dict(model.state_dict()), directory / "trainer.pt")
        return
    model, tokenizer = load_policy("builtin:tiny", seed=0)
    engine = NativeEngine(model, tokenizer, device=torch.device("cpu"))
    engine.load_weights(receive_weights(src=1))
    torch.save(dict(engine.model.state_dict()), directory / "engine.pt")


def tp_logprobs_and_grads(rank: int, directory: Path, kind: str, fsdp: bool, lora: bool = False) -> None:
    """Log-probs and gradients of a tp-2 model (composed with FSDP2 on a dp_shard of 1 when `fsdp`; with
    LoRA adapters on every linear layer when `lora`, B nonzero) vs the same model in this process
    unsplit; rank 0 saves the largest differences."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from rlcore.models.parallel import apply_family_tp
    from tests.dist.rollouts import fake_rollout

    tied = kind.endswith("-tied")
    reference, model = tp_model_pair(kind.removesuffix("-tied"), tied=tied)
    if lora:
        reference, model = (_lora_pair_member(m) for m in (reference, model))
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp_shard", "tp"))
    apply_family_tp(model, mesh["tp"])
    if fsdp:
        apply_fsdp(model, mesh["dp_shard"])
    batch = fake_rollout(3, 2, max_prompt=5, max_response=6, vocab=model.config.vocab_size, seed=1)
    from rlcore.dist import tp
    from rlcore.dist.tp import vocab_group
    from rlcore.models.forward import model_inputs, response_logprobs

    tp._CHUNK = 3 * 25  # vocab-parallel passes over 3 positions at a time: many chunks, a short last one

    out = {}
    for name, m in (("ref", reference), ("tp", model)):
        inputs = model_inputs(m, batch, share_prompts=False)
        logprobs, ent = response_logprobs(
            m, inputs, temperature=0.7, entropy=True, entropy_grad=True
        )  # (b, r)
        mask = batch["response_mask"][:, : inputs.labels.shape[1]]
        ((logprobs + 0.1 * ent) * mask).sum().backward()
        out[name] = (logprobs * mask).detach(), (ent * mask).detach()
    diffs = {
        "logprobs": (out["tp"][0] - out["ref"][0]).abs().max().item(),
        "entropy": (out["tp"][1] - out["ref"][1]).abs().max().item(),
        "vocab_parallel": vocab_group(model) is not None,
    }
    worst, trained = 0.0, 0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if q.grad is None:  # a frozen base weight under LoRA
            assert p.grad is None
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst, trained = max(worst, (grad - q.grad).abs().max().item()), trained + 1
    diffs["grads"], diffs["trained"] = worst, trained
    full = gathered_state(model)  # what the engine sync and the HF export gather (rank 0; every rank runs it)
    diffs["sharded"] = sum(
        isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters()
    )
    if lora:
        from rlcore.models.lora import merged_state

        merged = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in merged_state(model)}
        expected = dict(merged_state(reference))
        diffs["merged"] = max((v - expected[k]).abs().max().item() for k, v in merged.items())
    if rank == 0:
        expected = reference.state_dict()  # a tied lm_head is gathered once, as the embeddings
        diffs["state"] = max((v - expected[k]).abs().max().item() for k, v in full.items())
        torch.save(diffs, directory / f"tp-{kind}-{fsdp}-{lora}.pt")


def _lora_pair_member(model: Any) -> Any:
    """`model` with rank-4 adapters on every linear layer, B drawn from a fixed seed (peft starts it at
    0, which would leave A's gradient 0)."""
    from rlcore.models.lora import apply_lora

    torch.manual_seed(1)
    model = apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    return model


def tp_model_pair(kind: str, kv_heads: int = 2, *, tied: bool = False) -> tuple[Any, Any]:
    """(reference, copy) of a small random Llama or Qwen3 decoder with 4 heads and `kv_heads` KV heads, a
    vocabulary of 49 (split 25 + 24 by tp 2), lm_head `tied` to the embeddings or not."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    config = config_cls(vocab_size=49, tie_word_embeddings=tied, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    reference = model_cls(config)
    model = model_cls(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def sp_logprobs_and_grads(rank: int, directory: Path, kind: str, fsdp: bool, kv_heads: int) -> None:
    """Log-probs, entropies and gradients of an sp-2 (Ulysses) model — FSDP2 over dp_shard x sp when
    `fsdp`, else its partial gradients summed by hand — vs the same model unsplit; rank 0 saves the
    largest differences."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from rlcore.dist.ulysses import apply_sp
    from rlcore.models.forward import model_inputs, response_logprobs
    from tests.dist.rollouts import fake_rollout

    reference, model = tp_model_pair(kind, kv_heads)
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp_shard", "sp"))
    apply_sp(model, mesh["sp"])
    if fsdp:
        apply_fsdp(model, mesh[("dp_shard", "sp")]._flatten("dp_shard_sp"))
    batch = fake_rollout(3, 2, max_prompt=5, max_response=7, vocab=model.config.vocab_size, seed=1)
    out = {}
    for name, m in (("ref", reference), ("sp", model)):
        inputs = model_inputs(m, batch, share_prompts=False)
        logprobs, ent = response_logprobs(m, inputs, entropy=True, entropy_grad=True)  # (b, r)
        mask = batch["response_mask"][:, : inputs.labels.shape[1]]
        ((logprobs + 0.1 * ent) * mask).sum().backward()
        out[name] = (logprobs * mask).detach(), (ent * mask).detach()
    diffs = {
        "logprobs": (out["sp"][0] - out["ref"][0]).abs().max().item(),
        "entropy": (out["sp"][1] - out["ref"][1]).abs().max().item(),
    }
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if not fsdp:
            dist.all_reduce(grad)  # each sp rank's gradient is its own columns' part
        worst = max(worst, (grad - q.grad).abs().max().item())
    diffs["grads"] = worst
    diffs["grad_scale"] = max(q.grad.abs().max().item() for q in reference.parameters())
    if rank == 0:
        torch.save(diffs, directory / f"sp-{kind}-{fsdp}-{kv_heads}.pt")


def vision_rollout() -> Batch:
    """builtin:tiny-vl's rollout of 4 shapes prompts x 2 samples (seeded), with perturbed old log-probs and
    advantages: the same on every rank and in the test process."""
    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import row_from_dict
    from rlcore.data.shapes import generate_rows
    from rlcore.models.policy import load_vision
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.native.engine import NativeEngine
    from tests.dist.rollouts import with_logprobs

    model, tokenizer = load_policy("builtin:tiny-vl")
    rows = [row_from_dict(r, f"r{i}") for i, r in enumerate(generate_rows("train", 4, seed=3))]
    prompts = make_prompt_batch(rows, tokenizer, vision=load_vision("builtin:tiny-vl"), uids=list("abcd"))
    out = NativeEngine(model, tokenizer).generate(prompts, SamplingParams(n=2, max_tokens=4, seed=0))
    advantages = torch.linspace(-1, 1, len(out))[:, None] * out["response_mask"]
    out = out.select(*(k for k in out.keys() if k != "rollout_logprobs"))  # noqa: SIM118
    return with_logprobs(model, out).with_(advantages=advantages)


def vision_update(rank: int, directory: Path, algo: AlgoConfig, optim: OptimConfig) -> None:
    """One update_step of builtin:tiny-vl sharded by FSDP2 (its decoder layers and vision blocks) over 2 ranks,
    each with its 2 prompts' rows; rank 0 saves the metrics and the gathered weights."""
    info = init_distributed("cpu")
    batch = vision_rollout()
    model, _ = load_policy("builtin:tiny-vl")
    apply_fsdp(model, build_mesh(info))
    state = new_state(model, optim)
    local = rank_rows(batch, n=2, prompts_per_update=4, rank=rank, world=WORLD)
    _, metrics = update(state, local, algo, optim, horizon=4)
    weights = gathered_state(model)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, directory / "vision.pt")


def agreed_checkpoint_worker(rank: int, directory: Path, shared: bool) -> None:
    """Rank 0's checkpoints/ holds complete steps 1 and 2 and an unfinished step_3.tmp; rank 1 lists the same
    directory (`shared`) or its own, with step 1 only; each writes what `--resume auto` took or said."""
    from rlcore.dist.checkpoint import COMPLETE
    from rlcore.trainer.checkpoints import _agreed_latest
    from rlcore.trainer.errors import StopRun

    root = (directory if shared or rank == 0 else directory / "node1") / "checkpoints"
    if rank == 0 or not shared:
        for step in (1, 2) if rank == 0 else (1,):
            (root / f"step_{step}").mkdir(parents=True)
            (root / f"step_{step}" / COMPLETE).write_text("")
        (root / "step_3.tmp").mkdir(exist_ok=True)
    dist.barrier()
    try:
        said = _agreed_latest(root).name
    except StopRun as e:
        said = str(e)
    (directory / f"agreed{rank}.txt").write_text(said)
