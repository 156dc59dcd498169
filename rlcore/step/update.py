"""The policy update: `update_step(state, batch, ...) -> (state, metrics)`, plus optimizer and schedule.

    opt = build_optimizer(model, lr=1e-6)
    actor = ModelState(model=model, optimizer=opt, scheduler=build_scheduler(opt, total_updates=100))
    plan = UpdatePlan(ppo_epochs=1, mini_batch_size=None, micro_batch_size=8)
    actor, metrics = update_step(actor, batch, algorithm, plan, mesh=mesh, horizon=512, temperature=1.0)

`algorithm` is a `rlcore.algorithm.Algorithm` (the policy loss and its terms as bound callables);
`run_updates` is the one update loop, shared with the critic (`rlcore.step.critic.critic_update`): each
model's update is a micro-batch loss plugged into it (the actor's: `rlcore.step.actor_loss`).

One call runs `ppo_epochs` passes over the batch; each pass splits it into mini-batches of
`mini_batch_size` prompts (whole groups of consecutive rows with the same `uid`; the size is global,
each rank takes its share) and makes one optimizer update per mini-batch, accumulating gradients
over micro-batches (`micro_batch_size` rows or a `max_tokens_per_micro_batch` budget) and reducing
them across ranks once, after the last micro-batch.

Normalisation. The token and sequence counts of the whole mini-batch (every rank) are all-reduced
before the first backward and passed to the loss as `num_tokens` / `num_seqs` (`horizon` is the
rollout's max_tokens), so each micro-batch's loss is its share of the global loss, and FSDP2 sums
(not averages) gradients over ranks (`rlcore.dist.fsdp`): the gradient equals the one-process,
one-micro-batch gradient for any world size and micro-batch split.

Departures from verl 0.9.1 (`dp_actor.update_policy`), on purpose: the learning-rate schedule steps
once per optimizer update (verl: once per training step); the warm-up reaches the peak at its last
update (verl's starts at 0); mini-batches keep their order across epochs (no shuffle); an update with
a non-finite loss or gradient norm on any rank is skipped on every rank and counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from rlcore.algorithm import Algorithm, parameters
from rlcore.batch import Batch, group_ids
from rlcore.dist.fsdp import model_mesh, set_gradient_sync
from rlcore.dist.reduce import all_reduce, mesh_size
from rlcore.models.footprint import SavedBytes
from rlcore.models.forward import aligned_micro_batches
from rlcore.models.moe import router_tap
from rlcore.plan import UpdatePlan
from rlcore.state import ModelState
from rlcore.step.actor_loss import NORMS, actor_micro_loss, needed_fields  # noqa: F401  (NORMS: imported from here)


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Optimizer:
    """AdamW over every trained parameter of `model` (`requires_grad`: a LoRA model's adapters only;
    sharded DTensors included), weight decay on all of them."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return AdamW(trained, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def lr_factor(update: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for 0-based optimizer update `update`.

    Warm-up: (update + 1) / warmup for update < warmup; then 1 (constant), or cosine from 1 down to
    `min_ratio` at update `total`: min_ratio + (1 - min_ratio) (1 + cos(pi progress)) / 2.
    """
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: Optimizer,
    *,
    total_updates: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> LRScheduler:
    """Linear warm-up over `warmup_steps` updates, then constant or cosine (see `lr_factor`).

    `total_updates` is the number of optimizer updates of the run (steps x ppo_epochs x mini-batches).
    Its `state_dict()` is JSON-able (the factor is a `functools.partial` of a module function).
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"--optim.schedule must be constant or cosine, got {schedule!r}")
    factor = partial(
        lr_factor, warmup=warmup_steps, total=total_updates, schedule=schedule, min_ratio=min_lr_ratio
    )
    return LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------------------


def _group_starts(batch: Batch) -> list[int]:
    """Row index where each prompt group starts (a run of equal consecutive `uid`s; each row without uid)."""
    ids = group_ids(batch).tolist()
    return [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]


def mini_batches(batch: Batch, mini_batch_size: int | None, mesh: DeviceMesh | None) -> list[Batch]:
    """This rank's mini-batches: `mini_batch_size` prompts over all ranks, whole groups each.

    Every rank must hold as many prompt groups (checked with one collective); the last mini-batch
    may hold fewer prompts. None: the whole batch is one mini-batch.
    """
    starts = _group_starts(batch)
    groups = len(starts)
    if mesh is not None:
        both = all_reduce(torch.tensor([groups, -groups], device=mesh.device_type), mesh, op="max")
        most, fewest = int(both[0]), -int(both[1])
        if most != fewest:
            raise ValueError(
                f"ranks hold different numbers of prompt groups ({fewest} to {most}); "
                "give every rank the same number of prompts"
            )
    if mini_batch_size is None:
        return [batch]
    world = mesh_size(mesh)
    if mini_batch_size < 1 or mini_batch_size % world:
        raise ValueError(
            f"--algo.mini-batch-size {mini_batch_size} must be a positive multiple of the "
            f"data-parallel size {world}"
        )
    per_rank = mini_batch_size // world
    bounds = [*starts[::per_rank], len(batch)]
    return [batch[a:b] for a, b in itertools.pairwise(bounds)]


SAVED_KEY = "perf/mem/saved_tensors_mb"
"""The update's memory metric: the most bytes one micro-batch saved for backward, MiB (this rank's)."""
MAX_SUFFIX = "_max"
"""Metrics whose name ends so are maxima (over micro-batches, updates and ranks), not averages."""


def _accumulate(totals: dict[str, Tensor], metrics: dict[str, Tensor]) -> None:
    """Add `metrics` into `totals` in place; `*_max` metrics keep their maximum instead."""
    for key, value in metrics.items():
        combine = torch.maximum if key.endswith(MAX_SUFFIX) else torch.add
        totals[key] = combine(totals[key], value) if key in totals else value


MicroLoss = Callable[[nn.Module, Batch, dict[str, Any]], tuple[Tensor, dict[str, Tensor]]]
"""(model, micro-batch, norms) -> (this micro-batch's share of the mini-batch loss, local metric sums).
`norms` holds the mini-batch's global `num_tokens`, `num_seqs` (0-dim tensors) and `horizon` (`NORMS`), and
`fresh`: whether this is the call's first update (the weights the old log-probs are of)."""


def grad_norm(model: nn.Module, grad_clip: float) -> Tensor:
    """Global L2 norm of the gradients (DTensor shards included), clipping them to `grad_clip` if > 0.

    Under tensor parallelism the gradients live on different meshes (the split layers' 2-D DTensors,
    the replicated embeddings' 1-D ones or plain tensors), which torch's clipping cannot stack: each
    mesh's norm is taken on its own, then combined. A gradient still Partial over its mesh (a replicated
    parameter fed by split activations: a LoRA A beside a column-wise layer, a per-head norm) is summed
    to its parameter's placement first, once, before the norm and the optimizer read it."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)
    by_mesh: dict[Any, list[Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if len(by_mesh) <= 1:
        if grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    norm = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    if grad_clip > 0:
        coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ rule
        with implicit_replication():  # the plain 0-dim factor times every DTensor shard
            for grads in by_mesh.values():
                torch._foreach_mul_(grads, coef)
    return norm


def _one_update(
    state: ModelState, mini: Batch, micro_loss: MicroLoss, plan: UpdatePlan, mesh: DeviceMesh | None,
    horizon: int, prefix: str, fresh: bool = False,
) -> tuple[bool, dict[str, Tensor], int]:  # fmt: skip
    """Accumulate the mini-batch's gradient over micro-batches and step; (stepped?, metric sums, the bytes
    the largest micro-batch saved for backward).
    `fresh`: the call's first update (the weights are still those the batch's old log-probs are of).

    The step is skipped on every rank when the loss is non-finite on any rank or the gradient norm is.
    """
    model, optimizer = state.model, state.optimizer
    optimizer.zero_grad(set_to_none=True)
    kept = mini["response_mask"] != 0  # (b, t)
    counts = all_reduce(torch.stack([kept.sum(), kept.any(dim=-1).sum()]), mesh)  # int64, exact
    num_tokens, num_seqs = counts.to(torch.float32).clamp(min=1.0).unbind()
    norms = {"num_tokens": num_tokens, "num_seqs": num_seqs, "horizon": horizon, "fresh": fresh}
    pieces = aligned_micro_batches(
        mini, mesh, micro_batch_size=plan.micro_batch_size, max_tokens=plan.max_tokens_per_micro_batch
    )
    sums: dict[str, Tensor] = {}
    total = torch.zeros((), dtype=torch.float32, device=kept.device)
    largest = 0
    for i, (micro, _) in enumerate(pieces):
        set_gradient_sync(model, i == len(pieces) - 1)  # reduce across ranks after the last one only
        with SavedBytes(model) as saved:  # the activations it saves, for perf/mem/saved_tensors_mb
            loss, metrics = micro_loss(model, micro, norms)
        largest = max(largest, saved.total)
        loss.backward()
        total = total + loss.detach()
        _accumulate(sums, metrics)
    bad = all_reduce((~torch.isfinite(total)).to(torch.float32), mesh)  # any rank non-finite
    norm = grad_norm(model, plan.grad_clip)
    ok = bool((torch.isfinite(norm) & (bad == 0)).item())  # the one host sync of the update
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still advances the schedule (no optimizer.step)
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        state.scheduler.step()
    sums = {k: v.float().cpu() for k, v in sums.items()}
    return ok, sums | {f"{prefix}/grad_norm": norm.detach().float().cpu()}, largest


def run_updates(
    state: ModelState,
    batch: Batch,
    micro_loss: MicroLoss,
    plan: UpdatePlan,
    *,
    mesh: DeviceMesh | None = None,
    horizon: int,
    prefix: str,
) -> tuple[ModelState, dict[str, float]]:
    """`plan.ppo_epochs` x mini-batches optimizer updates of `state.model` with `micro_loss`.

    The one update loop of rlcore (actor and critic): global token / sequence counts per mini-batch,
    gradient accumulation over micro-batches with one cross-rank reduction, an update with a
    non-finite loss or gradient on any rank skipped on every rank and counted, and the metrics
    reduced over updates and ranks in one collective. Metrics: the micro-loss's sums averaged over
    the updates that stepped (NaN when none did; `*_max` keys: maxima), `<prefix>/grad_norm`
    (before clipping), `<prefix>/lr` of the last update, `<prefix>/bad_updates` skipped in this call, and
    `perf/mem/saved_tensors_mb`: the most a micro-batch's forward saved for backward on this rank (a
    memory measure, not reduced: `rlcore.models.footprint.SavedBytes`).
    """
    mesh = mesh if mesh is not None else model_mesh(state.model)
    minis = mini_batches(batch, plan.mini_batch_size, mesh)
    was_training = state.model.training
    state.model.train()
    summed: dict[str, Tensor] = {}
    keys: set[str] = set()
    good = bad = saved = 0
    lr = float("nan")
    consecutive = state.bad_updates
    try:
        for index, mini in enumerate([m for _ in range(plan.ppo_epochs) for m in minis]):
            lr = state.optimizer.param_groups[0]["lr"]  # the lr this update uses
            ok, sums, largest = _one_update(state, mini, micro_loss, plan, mesh, horizon, prefix, fresh=index == 0)
            keys |= sums.keys()
            saved = max(saved, largest)
            if not ok:
                bad, consecutive = bad + 1, consecutive + 1
                continue
            good, consecutive = good + 1, 0
            _accumulate(summed, sums)
    finally:
        state.model.train(was_training)
        tap = router_tap(state.model)
        if tap is not None:  # a replay stays set through each backward (recompute); not past the updates
            tap.set_replay(None)
    metrics = dict.fromkeys(sorted(keys), float("nan")) | _finish_metrics(summed, good, mesh, prefix)
    metrics |= {f"{prefix}/lr": float(lr), f"{prefix}/bad_updates": float(bad), SAVED_KEY: saved / 2**20}
    return dataclasses.replace(state, step=state.step + 1, bad_updates=consecutive), metrics


def _finish_metrics(
    summed: dict[str, Tensor], good: int, mesh: DeviceMesh | None, prefix: str
) -> dict[str, float]:
    """Sum the per-rank sums over ranks (one collective), divide by the good updates, floats once."""
    norm_key = f"{prefix}/grad_norm"  # the same on every rank already
    keys = sorted(k for k in summed if k != norm_key and not k.endswith(MAX_SUFFIX))
    stacked = torch.stack([summed[k] for k in keys]) if keys else torch.zeros(0)
    if mesh is not None and keys:  # every rank has the same keys: the skip decisions are global
        stacked = all_reduce(stacked.to(mesh.device_type), mesh).cpu()
    denom = float(good) if good else float("nan")
    values = dict(zip(keys, (stacked / denom).tolist(), strict=True))
    for key in sorted(k for k in summed if k.endswith(MAX_SUFFIX)):  # maxima: over updates and ranks
        top = summed[key]
        if mesh is not None:
            top = all_reduce(top.to(mesh.device_type), mesh, op="max").cpu()
        values[key] = float(top)
    if norm_key in summed:
        values[norm_key] = float(summed[norm_key]) / denom
    return values


# -------------------------------------------------------------------------------------------- the actor


def update_step(
    state: ModelState,
    batch: Batch,
    algorithm: Algorithm,
    plan: UpdatePlan,
    *,
    mesh: DeviceMesh | None = None,
    horizon: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[ModelState, dict[str, float]]:
    """The policy's `plan.ppo_epochs` x mini-batches optimizer updates on this rank's rows (`run_updates`).

    `batch`: this rank's rows (whole prompt groups) with the sequence fields, `advantages`,
    `old_logprobs` (unless `algorithm.on_policy`), and `ref_logprobs` (KL loss) / `rollout_logprobs`
    (tis_cap) as needed. `mesh`: the data-parallel mesh (default: the one the model is sharded over;
    None for 1 process). `horizon`: the rollout's max_tokens (seq-mean-token-sum-norm). `temperature`:
    the sampling temperature the log-probs are taken under. `seed`: with `state.step`, seeds the
    generator of a sampling loss (clip_cov), so each step draws anew and a resumed run draws the same.
    Every rank must call this with the same algorithm and plan.
    Metrics (floats, identical on every rank): actor/pg_loss, actor/ppo_kl, actor/pg_clipfrac,
    actor/pg_clipfrac_lower (per the policy loss), actor/entropy, actor/kl_loss (with the KL loss)
    averaged over the updates that stepped (NaN when none did); actor/grad_norm (before clipping),
    likewise; actor/lr of the last update; actor/bad_updates: updates skipped in this call.
    """
    work = batch.select(*needed_fields(state.model, batch, algorithm))
    if algorithm.on_policy and (plan.ppo_epochs > 1 or plan.mini_batch_size is not None):
        raise ValueError(
            "update_step: an on-policy algorithm makes one update per step: ppo_epochs 1 and "
            f"mini_batch_size None (the whole batch), got {plan.ppo_epochs} and {plan.mini_batch_size}"
        )
    generator = None  # only for a loss that samples (clip_cov), looked up once per step
    if "generator" in parameters(algorithm.policy_loss_fn):
        device = next(state.model.parameters()).device  # where the log-probs (and the draws) live
        generator = torch.Generator(device=device).manual_seed((seed * 1_000_003 + state.step) % (2**63 - 1))
    loss = partial(actor_micro_loss, algorithm=algorithm, temperature=temperature,
                   share_prompts=plan.share_prompts, generator=generator)  # fmt: skip
    return run_updates(state, work, loss, plan, mesh=mesh, horizon=horizon, prefix="actor")
