"""The policy update: `update_step(state, batch, ...) -> (state, metrics)`, plus optimizer and schedule.

    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, cfg.optim, total_updates),
                       kl_coef=cfg.algo.kl_coef)                      # opt = build_optimizer(model, cfg.optim)
    state, metrics = update_step(state, batch, cfg.algo, cfg.optim, mesh=mesh,
                                 horizon=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature)

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
import inspect
import itertools
import math
import re
import warnings
from collections.abc import Iterator
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from configs import AlgoConfig, OptimConfig
from rlcore.batch import Batch
from rlcore.dist.fsdp import model_mesh, set_gradient_sync
from rlcore.dist.reduce import all_reduce, mesh_size
from rlcore.models.forward import (
    SEQUENCE_FIELDS,
    aligned_micro_batches,
    model_inputs,
    response_logits,
    token_entropy,
)
from rlcore.pure.kl import kl_estimate
from rlcore.pure.logprobs import token_logprobs
from rlcore.pure.losses import POLICY_LOSSES, aggregate
from rlcore.pure.masks import apply_mask, masked_sum


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """What one training step hands to the next; replaced (never mutated) by `update_step`.

    The model's parameters and the optimizer's state change in place (`optimizer.step()`): the one
    documented exception to immutability.
    """

    model: nn.Module
    """The policy: a plain module (1 process) or an FSDP2-sharded one."""
    optimizer: Optimizer
    """AdamW over the model's parameters (`build_optimizer`)."""
    scheduler: LRScheduler
    """Learning-rate schedule, stepped once per optimizer update (`build_scheduler`)."""
    step: int = 0
    """Training steps done (`update_step` calls)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty in the reward (changed by the adaptive controller, not here)."""
    bad_updates: int = 0
    """Consecutive optimizer updates skipped for a non-finite loss or gradient norm."""


def build_optimizer(model: nn.Module, optim_cfg: OptimConfig) -> Optimizer:
    """AdamW over every parameter of `model` (sharded DTensors included), weight decay on all of them."""
    return AdamW(
        model.parameters(),
        lr=optim_cfg.lr,
        betas=optim_cfg.betas,
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
    )


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


def build_scheduler(optimizer: Optimizer, optim_cfg: OptimConfig, total_updates: int) -> LRScheduler:
    """Linear warm-up over `optim_cfg.warmup_steps` updates, then constant or cosine (see `lr_factor`).

    `total_updates` is the number of optimizer updates of the run (steps x ppo_epochs x mini-batches).
    Its `state_dict()` is JSON-able (the factor is a `functools.partial` of a module function).
    """
    if optim_cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"--optim.schedule must be constant or cosine, got {optim_cfg.schedule!r}")
    factor = partial(
        lr_factor,
        warmup=optim_cfg.warmup_steps,
        total=total_updates,
        schedule=optim_cfg.schedule,
        min_ratio=optim_cfg.min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------------------


def _group_starts(batch: Batch) -> list[int]:
    """Row index where each prompt group starts (a run of equal consecutive `uid`s; each row without uid)."""
    if "uid" not in batch:
        return list(range(len(batch)))
    uids = batch["uid"]
    return [i for i in range(len(uids)) if i == 0 or uids[i] != uids[i - 1]]


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


MAX_SUFFIX = "_max"
"""Metrics whose name ends so are maxima (over micro-batches, updates and ranks), not averages."""


def _accumulate(totals: dict[str, Tensor], metrics: dict[str, Tensor]) -> None:
    """Add `metrics` into `totals` in place; `*_max` metrics keep their maximum instead."""
    for key, value in metrics.items():
        combine = torch.maximum if key.endswith(MAX_SUFFIX) else torch.add
        totals[key] = combine(totals[key], value) if key in totals else value


def _needed_fields(batch: Batch, algo_cfg: AlgoConfig) -> tuple[str, ...]:
    fields = [*SEQUENCE_FIELDS, "advantages"]
    if "old_logprobs" in batch:
        fields.append("old_logprobs")
    elif "rollout_logprobs" in batch:  # on-policy: the rollout gap is measured in the update
        fields.append("rollout_logprobs")
    if algo_cfg.use_kl_loss:
        fields.append("ref_logprobs")
    if algo_cfg.tis_cap is not None and "rollout_logprobs" not in fields:
        fields.append("rollout_logprobs")
    why = {"ref_logprobs": "--algo.use-kl-loss", "rollout_logprobs": "--algo.tis-cap"}
    for key in fields:
        if key not in batch:
            reason = f" (needed by {why[key]})" if key in why else ""
            raise ValueError(f"update_step: the batch has no field {key!r}{reason}")
    return (*fields, "uid") if "uid" in batch else tuple(fields)


def _micro_loss(
    model: nn.Module,
    micro: Batch,
    algo_cfg: AlgoConfig,
    norms: dict[str, Tensor | int],
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the mini-batch loss and its (local) metric sums."""
    inputs = model_inputs(model, micro, share_prompts=algo_cfg.share_prompts)
    logits = response_logits(model, inputs)  # (m, r, v)
    r = logits.shape[1]
    logprob = token_logprobs(logits, inputs.labels, temperature=temperature)  # (m, r) float32
    mask = micro["response_mask"][:, :r]  # (m, r)
    on_policy = "old_logprobs" not in micro  # one update: the policy is its own old policy
    old = logprob.detach() if on_policy else micro["old_logprobs"][:, :r]
    is_weights = None
    if algo_cfg.tis_cap is not None:  # truncated importance sampling: trainer vs rollout probabilities
        log_w = (old - micro["rollout_logprobs"][:, :r]).clamp(-20.0, 20.0)
        is_weights = log_w.exp().clamp(max=algo_cfg.tis_cap)  # (m, r)
    extra = {"clip_c": algo_cfg.clip_c} if algo_cfg.policy_loss in ("ppo_clip", "vanilla") else {}
    if "generator" in inspect.signature(POLICY_LOSSES[algo_cfg.policy_loss]).parameters:
        extra["generator"] = generator  # clip_cov: new token draws every step, the same on a resume
    agg = {"num_tokens": norms["num_tokens"], "num_seqs": norms["num_seqs"], "horizon": norms["horizon"]}
    pg_loss, pg_metrics = POLICY_LOSSES[algo_cfg.policy_loss](
        logprob, old, micro["advantages"][:, :r], mask, agg=algo_cfg.loss_agg,
        clip_low=algo_cfg.clip_low, clip_high=algo_cfg.clip_high, is_weights=is_weights, **extra, **agg,
    )  # fmt: skip
    loss = pg_loss
    if algo_cfg.entropy_coef > 0:
        ent = token_entropy(logits, temperature=temperature)  # (m, r), differentiable
        loss = loss - algo_cfg.entropy_coef * aggregate(ent, mask, algo_cfg.loss_agg, **agg)
    else:
        with torch.no_grad():
            ent = token_entropy(logits.detach(), temperature=temperature)
    share = (mask != 0).sum() / norms["num_tokens"]  # this micro-batch's share of the mini-batch tokens
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/entropy": masked_sum(ent.detach(), mask) / norms["num_tokens"],
        "actor/shared_prompt_frac": share * float(inputs.gather is not None),  # tokens in packed forwards
    }
    metrics |= {f"actor/{k}": v.detach() * share for k, v in pg_metrics.items()}
    if on_policy and "rollout_logprobs" in micro:  # the engine's log-probs vs these, as logprob_gap
        gap = apply_mask((old - micro["rollout_logprobs"][:, :r]).abs(), mask)  # (m, r)
        metrics["rollout/logprob_diff_mean"] = masked_sum(gap, mask) / norms["num_tokens"]
        metrics["rollout/logprob_diff_max"] = gap.amax() if gap.numel() else gap.new_zeros(())
    if algo_cfg.use_kl_loss:
        kl = kl_estimate(logprob, micro["ref_logprobs"][:, :r], algo_cfg.kl_loss_kind)  # (m, r)
        kl_loss = aggregate(kl, mask, algo_cfg.loss_agg, **agg)
        loss = loss + algo_cfg.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    return loss, metrics


def _grad_norm(model: nn.Module, grad_clip: float) -> Tensor:
    """Global L2 norm of the gradients (DTensor shards included), clipping them to `grad_clip` if > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _one_update(
    state: TrainState,
    mini: Batch,
    algo_cfg: AlgoConfig,
    optim_cfg: OptimConfig,
    mesh: DeviceMesh | None,
    horizon: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[bool, dict[str, Tensor]]:
    """Accumulate the mini-batch's gradient over micro-batches and step; (stepped?, metric sums)."""
    model, optimizer = state.model, state.optimizer
    optimizer.zero_grad(set_to_none=True)
    kept = mini["response_mask"] != 0  # (b, t)
    counts = all_reduce(torch.stack([kept.sum(), kept.any(dim=-1).sum()]), mesh)  # int64, exact
    num_tokens, num_seqs = counts.to(torch.float32).clamp(min=1.0).unbind()
    norms = {"num_tokens": num_tokens, "num_seqs": num_seqs, "horizon": horizon}
    pieces = aligned_micro_batches(
        mini, mesh, micro_batch_size=algo_cfg.micro_batch_size, max_tokens=algo_cfg.max_tokens_per_micro_batch
    )
    sums: dict[str, Tensor] = {}
    total = torch.zeros((), dtype=torch.float32, device=kept.device)
    for i, (micro, _) in enumerate(pieces):
        set_gradient_sync(model, i == len(pieces) - 1)  # reduce across ranks after the last one only
        loss, metrics = _micro_loss(model, micro, algo_cfg, norms, temperature, generator)
        loss.backward()
        total = total + loss.detach()
        _accumulate(sums, metrics)
    bad = all_reduce((~torch.isfinite(total)).to(torch.float32), mesh)  # any rank non-finite
    grad_norm = _grad_norm(model, optim_cfg.grad_clip)
    ok = bool((torch.isfinite(grad_norm) & (bad == 0)).item())  # the one host sync of the update
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still advances the schedule (no optimizer.step)
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        state.scheduler.step()
    sums = {k: v.float().cpu() for k, v in sums.items()}
    return ok, sums | {"actor/grad_norm": grad_norm.detach().float().cpu()}


def _iter_updates(batch: Batch, algo_cfg: AlgoConfig, mesh: DeviceMesh | None) -> Iterator[Batch]:
    minis = mini_batches(batch, algo_cfg.mini_batch_size, mesh)
    if "old_logprobs" not in batch and (algo_cfg.ppo_epochs > 1 or len(minis) > 1):
        raise ValueError(
            "update_step: the batch has no field 'old_logprobs'; without it the update must be on-policy "
            f"(ppo_epochs 1 and one mini-batch, got {algo_cfg.ppo_epochs} x {len(minis)})"
        )
    for _ in range(algo_cfg.ppo_epochs):
        yield from minis


def update_step(
    state: TrainState,
    batch: Batch,
    algo_cfg: AlgoConfig,
    optim_cfg: OptimConfig,
    *,
    mesh: DeviceMesh | None = None,
    horizon: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[TrainState, dict[str, float]]:
    """`ppo_epochs` x mini-batches optimizer updates on this rank's rows; (new state, metrics).

    `batch`: this rank's rows (whole prompt groups) with the sequence fields, `old_logprobs`,
    `advantages`, and `ref_logprobs` (use_kl_loss) / `rollout_logprobs` (tis_cap) as needed.
    `mesh`: the data-parallel mesh (default: the one the model is sharded over; None for 1 process).
    `horizon`: the rollout's max_tokens (seq-mean-token-sum-norm). `temperature`: the sampling
    temperature the log-probs are taken under. `seed`: with `state.step`, seeds the generator of a
    sampling loss (clip_cov), so each step draws anew and a resumed run draws the same. Every rank
    must call this with the same config.
    Metrics (floats, identical on every rank): actor/pg_loss, actor/ppo_kl, actor/pg_clipfrac,
    actor/pg_clipfrac_lower (per the policy loss), actor/entropy, actor/kl_loss (with use_kl_loss)
    averaged over the updates that stepped (NaN when none did); actor/grad_norm (before clipping),
    likewise; actor/lr of the last update; actor/bad_updates: updates skipped in this call.
    """
    mesh = mesh if mesh is not None else model_mesh(state.model)
    work = batch.select(*_needed_fields(batch, algo_cfg))
    was_training = state.model.training
    state.model.train()
    summed: dict[str, Tensor] = {}
    keys: set[str] = set()
    good = bad = 0
    lr = float("nan")
    consecutive = state.bad_updates
    device = next(state.model.parameters()).device  # where the log-probs (and clip_cov's draws) live
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + state.step)
    try:
        for mini in _iter_updates(work, algo_cfg, mesh):
            lr = state.optimizer.param_groups[0]["lr"]  # the lr this update uses
            ok, sums = _one_update(state, mini, algo_cfg, optim_cfg, mesh, horizon, temperature, generator)
            keys |= sums.keys()
            if not ok:
                bad, consecutive = bad + 1, consecutive + 1
                continue
            good, consecutive = good + 1, 0
            _accumulate(summed, sums)
    finally:
        state.model.train(was_training)
    metrics = dict.fromkeys(sorted(keys), float("nan")) | _finish_metrics(summed, good, mesh)
    metrics |= {"actor/lr": float(lr), "actor/bad_updates": float(bad)}
    return dataclasses.replace(state, step=state.step + 1, bad_updates=consecutive), metrics


def _finish_metrics(summed: dict[str, Tensor], good: int, mesh: DeviceMesh | None) -> dict[str, float]:
    """Sum the per-rank sums over ranks (one collective), divide by the good updates, floats once."""
    keys = sorted(k for k in summed if k != "actor/grad_norm" and not k.endswith(MAX_SUFFIX))
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
    if "actor/grad_norm" in summed:
        values["actor/grad_norm"] = float(summed["actor/grad_norm"]) / denom
    return values
