"""Rollouts and rewards: `fill(state, handles, algorithm)` generates the batches the next steps train on.

Under torchrun every rank draws the same global batch of prompts from the shared cursor and keeps
its own slice; with DAPO's dynamic sampling the number of rounds is decided over all ranks (every
rank draws until every rank is full), so the cursor the step returns is the same on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import torch

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch
from rlcore.data.dataset import Cursor
from rlcore.data.prompts import pad_token_id
from rlcore.dist.reduce import all_reduce_int
from rlcore.plan import RolloutPlan, StepPlan
from rlcore.rollout.base import SamplingParams
from rlcore.state import Rollout, TrainState
from rlcore.step.phases import phase
from rlcore.step.steps import concat_rollouts, filter_groups, group_signal, rollout_step, score_step

if TYPE_CHECKING:
    from rlcore.step.handles import Handles


def step_seed(seed: int, step: int, what: str) -> int:
    """A sampling seed that depends on (seed, step, what) only, so resumed runs sample identically."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{step}:{what}".encode(), digest_size=7).digest(), "little")


def sampling(plan: StepPlan, step: int, round_: int = 0, rank: int = 0) -> SamplingParams:
    """Step `step`'s sampling; each rank draws its own stream (its prompts are not another rank's)."""
    return plan.rollout.seeded(
        step_seed(plan.seed, step, f"train{round_}" + (f"/rank{rank}" if rank else ""))
    )


def this_rank(h: Handles, prompts: Batch) -> Batch:
    """SPMD data parallelism: every rank draws the same global batch and keeps its own slice of prompts."""
    per = len(prompts) // h.dist.world_size
    return prompts[h.dist.rank * per : (h.dist.rank + 1) * per]


def from_first_peer(batch: Batch, h: Handles) -> Batch:
    """tp / sp: the batch of the first of this rank's peers, on every peer. Their engines sample the same
    prompts with the same seeds, but a model split between ranks must train one batch exactly."""
    group = h.placement.peers
    if group is None:
        return batch
    box = [batch.to("cpu")]  # pickled on the host: a CUDA tensor would unpickle on the sender's device
    torch.distributed.broadcast_object_list(box, group=group, group_src=0)
    return box[0].to(h.dist.device)


def due(state: TrainState, plan: StepPlan) -> range:
    """The steps whose batches may be generated now and are not pending yet (`Schedule.due`): the batch
    of step t is generated with policy version max(0, t - 1 - K) at the oldest (lag mode: exactly)."""
    return plan.schedule.due(state.step, state.pending[-1].step if state.pending else None)


def fill(state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan) -> TrainState:
    """Generate, with the engine's current weights, the batches of every step `due` (lag mode)."""
    for step in due(state, plan):
        state = generate(state, h, algorithm, plan, step)
    return state


def generate(
    state: TrainState,
    h: Handles,
    algorithm: Algorithm,
    plan: StepPlan,
    step: int,
    extra: dict[str, float] | None = None,
) -> TrainState:
    """The state with the batch of `step` appended to `pending` (generated with the engine's weights,
    version state.policy_version unless the engine tagged each token's, `rollout_versions`) and the
    cursor after its prompts; `extra` metrics are logged with it."""
    batch, metrics, cursor = collect(state, h, algorithm, plan, step)
    batch = from_first_peer(batch, h)
    h.hooks.slow_rollout()  # test-only (RLCORE_TEST_SLOW_ROLLOUT_S)
    if "rollout_versions" not in batch:  # else tagged token by token (partial rollouts)
        versions = torch.full(batch["responses"].shape, state.policy_version, dtype=torch.long)  # (b, t)
        batch = batch.with_(rollout_versions=versions)
    floats = {k: float(v) for k, v in metrics.items()} | dict(extra or {})
    rollout = Rollout(step=step, batch=batch, metrics=floats, version=state.policy_version)
    return dataclasses.replace(state, cursor=cursor, pending=(*state.pending, rollout))


def collect(
    state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan, step: int
) -> tuple[Batch, dict[str, torch.Tensor], Cursor]:
    """Rollout + rewards for step `step`; with dynamic sampling, more rounds until every rank's share of
    the batch is full. Returns this rank's rows, metrics, and the cursor after the prompts drawn."""
    cursor, r = state.cursor, plan.rollout
    share = plan.batch_size // h.dist.world_size  # this rank's prompts
    dynamic = r.dynamic
    kept: list[Batch] = []
    metrics: dict[str, torch.Tensor] = {}
    groups_seen = groups_kept = 0
    for round_ in range(r.rounds if dynamic else 1):
        drawn, cursor = h.train_ds.take(cursor, plan.batch_size)
        prompts = this_rank(h, drawn)
        with phase("rollout"):
            batch, m = rollout_step(h.engine, prompts, sampling(plan, step, round_, h.dist.rank))
        with phase("scoring"):
            h.hooks.stall(h.dist.rank, step, "scoring")  # test-only (RLCORE_TEST_STALL)
            batch, rm = score_step(h.scorer, batch, tokenizer=h.tokenizer, overlong=r.overlong, judge=h.judge,
                                   given=given_rewards(batch, r))  # fmt: skip
        if algorithm.needs_greedy_baseline:
            batch = batch.with_(baseline_rewards=greedy_baseline(h, plan, prompts))
        if round_ == 0:
            metrics |= m | rm
            metrics["train/reward_mean"] = batch["token_scores"].sum(-1).mean()
            _, varied = group_signal(batch)  # groups whose samples all scored the same: no signal
            metrics["train/equal_reward_group_frac"] = 1.0 - varied.float().mean()
        if not dynamic:
            return batch, metrics, cursor
        batch, n_kept, n_seen = filter_groups(batch)
        groups_seen, groups_kept = groups_seen + n_seen, groups_kept + n_kept
        kept.append(batch)
        if all_reduce_int(groups_kept, h.mesh, op="min") >= share:  # every rank is full
            break
    batch = concat_rollouts(kept, pad_token_id(h.tokenizer)) if len(kept) > 1 else kept[0]
    batch = batch[: min(len(batch), share * r.sampling.n)]
    seen, kept_all = all_reduce_int(groups_seen, h.mesh), all_reduce_int(groups_kept, h.mesh)
    metrics["train/groups_drawn"] = torch.tensor(float(seen))  # over all ranks
    metrics["train/groups_kept_frac"] = torch.tensor(kept_all / max(seen, 1))
    return batch, metrics, cursor


def given_rewards(batch: Batch, plan: RolloutPlan) -> torch.Tensor | None:
    """The rewards the rollout gave itself (`RolloutPlan.given_rewards`), or None."""
    return None if plan.given_rewards is None else batch[plan.given_rewards]


def greedy_baseline(h: Handles, plan: StepPlan, prompts: Batch) -> torch.Tensor:
    """ReMax: the reward of each prompt's greedy response, repeated for its n samples.  # (b * n,)"""
    r = plan.rollout
    generated = h.engine.generate(prompts, r.greedy())
    batch, _ = score_step(h.scorer, generated, tokenizer=h.tokenizer, overlong=r.overlong, judge=h.judge,
                          given=given_rewards(generated, r))  # fmt: skip
    return batch["token_scores"].sum(-1).repeat_interleave(r.sampling.n)


def staleness(batch: Batch, version: int) -> dict[str, float]:
    """`pipeline/staleness_mean` / `_max`: versions between the trainer's policy and the one that
    generated each response token."""
    mask = batch["response_mask"] != 0
    behind = (version - batch["rollout_versions"]).to(torch.float32)  # (b, t)
    count = mask.sum().clamp(min=1)
    top = behind[mask].max() if mask.any() else behind.new_zeros(())
    return {
        "pipeline/staleness_mean": float((behind * mask).sum() / count),
        "pipeline/staleness_max": float(top),
    }
