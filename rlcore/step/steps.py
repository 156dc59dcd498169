"""One RL step as composable functions over Batches: rollout → score → log-probs → advantages → update.

Each returns a new Batch (or state) and a dict of 0-dim metric tensors; `train.py` composes them,
and a research script can call them directly (see examples/custom_advantage.py):

    batch, m1 = rollout_step(engine, prompts, sampling)
    batch, m2 = score_step(scorer, batch, tokenizer=tokenizer)
    batch = logprob_step(model, batch, temperature=1.0)                    # + old_logprobs
    batch, m3 = advantage_step(batch, algorithm, kl_coef=0.0)              # + advantages, returns
    actor, m4 = update_step(actor, batch, algorithm, plan, horizon=64)     # rlcore.step.update
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch, group_ids
from rlcore.columns import pad_columns
from rlcore.pure import corrections
from rlcore.pure.corrections import is_weights, offpolicy_metrics, rejection_mask, veto_mask
from rlcore.pure.distill import reverse_kl_stats
from rlcore.pure.kl import apply_kl_penalty
from rlcore.pure.masks import masked_mean
from rlcore.rewards.step import score_step
from rlcore.rollout.base import RolloutEngine, SamplingParams

__all__ = [
    "advantage_step",
    "concat_rollouts",
    "correction_step",
    "estimator_kwargs",
    "filter_groups",
    "group_ids",
    "logprob_gap",
    "logprob_step",
    "rollout_step",
    "score_step",
]


AGENT_METRICS: dict[str, tuple[str, str]] = {
    "num_turns": ("agent/turns_mean", "mean"),
    "num_tool_calls": ("agent/tool_calls_mean", "mean"),
    "num_tool_errors": ("agent/tool_errors_mean", "mean"),
    "num_observation_tokens": ("agent/observation_tokens_mean", "mean"),
    "env_rewards": ("agent/env_reward_mean", "mean"),
    "env_errors": ("agent/env_errors", "sum"),
    "env_timeouts": ("agent/env_timeouts", "sum"),
    "retokenize_mismatch": ("agent/retokenize_mismatch", "mean"),
    "agent_failed": ("agent/failures", "sum"),
    "agent_split": ("agent/splits", "sum"),
    "agent_metrics": ("agent", "keys"),
}
"""Per-sample fields of the agent loop (`rlcore.rollout.agent.loop`) and of openai-client agents
(`rlcore.gateway.agents`) -> (metric, mean over samples, count, or "keys": per-row dicts, each key's mean)."""


def rollout_step(
    engine: RolloutEngine, prompts: Batch, sampling: SamplingParams
) -> tuple[Batch, dict[str, Tensor]]:
    """Generate `sampling.n` responses per prompt; metrics on lengths and time."""
    start = time.perf_counter()
    batch = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    lengths = batch["response_mask"].sum(-1)  # (b,)
    truncated = torch.tensor([r == "length" for r in batch["finish_reason"]], dtype=torch.float32)
    metrics = {
        "response/length_mean": lengths.mean(),
        "response/length_max": lengths.max(),
        "response/clip_ratio": truncated.mean(),
        "timing/rollout_s": torch.tensor(seconds),
    }
    for key, (name, reduce) in AGENT_METRICS.items():
        if key in batch and reduce == "keys":  # per-row dicts of numbers: each key's mean, `agent/<key>`
            metrics |= _key_means(batch[key], name)
        elif key in batch:  # the multi-turn agent loop's fields
            values = batch[key].float()
            metrics[name] = values.mean() if reduce == "mean" else values.sum()
    return batch, metrics


def _key_means(rows: list[dict[str, float]], prefix: str) -> dict[str, Tensor]:
    """`prefix/<key>`: the mean of each key over the rows that have it."""
    keys = sorted({k for row in rows for k in row})
    return {f"{prefix}/{k}": torch.tensor([row[k] for row in rows if k in row]).float().mean() for k in keys}


def logprob_step(model: Any, batch: Batch, *, key: str = "old_logprobs", **forward_kw: Any) -> Batch:
    """Batch + `key` (b, t): the model's log-probs of the responses (no grad, micro-batched)."""
    from rlcore.models.forward import compute_logprobs

    logprobs, _ = compute_logprobs(model, batch, **forward_kw)
    return batch.with_(**{key: logprobs}, overwrite=True)


def logprob_gap(batch: Batch, trainer_logprobs: Tensor) -> dict[str, Tensor]:
    """How far the engine's log-probs are from the trainer's on the same tokens (0-dim tensors):
    `rlcore.pure.corrections.logprob_gap` of `batch["rollout_logprobs"]` and `trainer_logprobs`, both
    (b, t), on `batch["response_mask"]`, logged as `rollout/logprob_diff_mean` and `_max`."""
    rollout = batch["rollout_logprobs"]
    if trainer_logprobs.shape != rollout.shape:
        raise ValueError(
            f"trainer_logprobs shape {tuple(trainer_logprobs.shape)} != rollout_logprobs {tuple(rollout.shape)}"
        )
    gap = corrections.logprob_gap(rollout, trainer_logprobs, batch["response_mask"])
    return {f"rollout/logprob_diff_{k}": v for k, v in gap.items()}


def estimator_kwargs(algorithm: Algorithm, batch: Batch, rewards: Tensor) -> dict[str, Tensor]:
    """The batch inputs the estimator names in its signature (rlcore.algorithm.ESTIMATOR_INPUTS)."""
    wanted = algorithm.inputs
    available = {
        "token_rewards": lambda: rewards,
        "response_mask": lambda: batch["response_mask"],
        "group_ids": lambda: group_ids(batch),
        "values": lambda: batch["values"],
        "baseline_rewards": lambda: batch["baseline_rewards"],
    }
    return {name: get() for name, get in available.items() if name in wanted}


def advantage_step(
    batch: Batch, algorithm: Algorithm, *, kl_coef: float = 0.0
) -> tuple[Batch, dict[str, Tensor]]:
    """Batch + `token_rewards` (scores minus the KL penalty when kl_coef > 0), `advantages`, `returns`.
    With a teacher (`algorithm.distill`), its term over `teacher_logprobs` and `old_logprobs` is added to
    the advantages (the returns, a critic's targets, stay the task's) and `teacher/*` metrics logged."""
    scores, mask = batch["token_scores"], batch["response_mask"]
    metrics: dict[str, Tensor] = {}
    rewards = scores
    if kl_coef > 0:
        rewards, kl_metrics = apply_kl_penalty(
            scores, batch["old_logprobs"], batch["ref_logprobs"], mask, coef=kl_coef, kind=algorithm.kl_kind
        )
        metrics |= {f"actor/{k}": v for k, v in kl_metrics.items()}
    advantages, returns = algorithm.advantage_fn(**estimator_kwargs(algorithm, batch, rewards))
    if algorithm.distill is not None:  # the teacher's per-token term joins the task's advantages
        student, teacher = batch["old_logprobs"], batch["teacher_logprobs"]
        advantages = algorithm.distill(advantages, student, teacher, mask)
        metrics |= reverse_kl_stats(student, teacher, mask)
    metrics |= {
        "critic/score/mean": scores.sum(-1).mean(),
        "critic/rewards/mean": rewards.sum(-1).mean(),
        "critic/advantages/mean": masked_mean(advantages, mask),
        "critic/advantages/max": torch.where(mask > 0, advantages, -torch.inf).max(),
        "critic/advantages/min": torch.where(mask > 0, advantages, torch.inf).min(),
        "critic/returns/mean": masked_mean(returns, mask),
    }
    batch = batch.with_(token_rewards=rewards, advantages=advantages, returns=returns, overwrite=True)
    return batch, metrics


def correction_step(
    batch: Batch,
    *,
    is_level: str | None = None,
    is_cap: float = 2.0,
    rs_level: str | None = None,
    rs_upper: float = 2.0,
    rs_lower: float | None = None,
    veto: float | None = None,
) -> tuple[Batch, dict[str, Tensor]]:
    """Off-policy corrections of old (`old_logprobs`) vs behaviour (`rollout_logprobs`) policy, as verl
    applies them before the advantages: `is_weights` (b, t) when `is_level` is set; the rejection and
    the veto remove units from `response_mask`. Metrics under `rollout_corr/` (rlcore.pure.corrections)."""
    old, rollout, mask = batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    metrics = offpolicy_metrics(old, rollout, mask)
    fields: dict[str, Tensor] = {}
    if is_level is not None:
        fields["is_weights"], m = is_weights(old, rollout, mask, level=is_level, cap=is_cap)
        metrics |= m
    kept = mask
    if rs_level is not None:
        kept, m = rejection_mask(old, rollout, kept, level=rs_level, upper=rs_upper, lower=rs_lower)
        metrics |= m
    if veto is not None:
        kept, m = veto_mask(old, rollout, kept, threshold=veto)
        metrics |= m
    if kept is not mask:
        fields["response_mask"] = kept
    batch = batch.with_(**fields, overwrite=True) if fields else batch
    return batch, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def concat_rollouts(batches: list[Batch], pad_token_id: int) -> Batch:
    """Rolled-out batches of different prompt and response widths as one: prompts left-padded, responses
    right-padded to the widest (as the batch schema pads each field, `rlcore.columns`), then concatenated."""
    p = max(b["input_ids"].shape[1] for b in batches)
    t = max(b["responses"].shape[1] for b in batches)
    return Batch.concat([pad_columns(b, p, t, pad_token_id) for b in batches])


def group_signal(batch: Batch, key: str = "token_scores") -> tuple[Tensor, Tensor]:
    """(group id of each row (b,), whether each prompt group's scores differ (groups,) bool)."""
    scores = batch[key].sum(-1)  # (b,)
    ids = group_ids(batch)
    n_groups = int(ids.max()) + 1 if len(ids) else 0
    lo = torch.full((n_groups,), torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amin")
    hi = torch.full((n_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amax")
    return ids, hi > lo


def filter_groups(batch: Batch, key: str = "token_scores") -> tuple[Batch, int, int]:
    """DAPO dynamic sampling: drop prompt groups whose scores are all equal (no learning signal).

    Returns the kept rows, the number of groups kept and the number of groups seen.
    """
    ids, varied = group_signal(batch, key)
    keep = varied[ids]
    return batch[keep.nonzero().squeeze(-1)], int(varied.sum()), len(varied)
