"""Validation: greedy and sampled (pass@k) reward on the validation set, overall and per data_source; with
a distillation teacher, the reverse KL of the sampled responses to it (held-out prompts)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.data.dataset import PromptDataset
from rlcore.pure.distill import reverse_kl_stats
from rlcore.rewards.judge import Judge
from rlcore.rewards.pool import RewardScorer
from rlcore.rewards.step import score_step
from rlcore.rollout.base import RolloutEngine, SamplingParams


def _scores(engine: RolloutEngine, dataset: PromptDataset, scorer: RewardScorer, tokenizer: Any, sampling,
            see: Callable[[int, Batch], None] | None = None, judge: Judge | None = None,
            given: str | None = None):  # fmt: skip
    """(data_source, uid, score) for every generated sample of the validation set; `see` sees each
    scored batch with its index."""
    out = []
    for j, prompts in enumerate(dataset.iter_batches(256)):
        batch = engine.generate(prompts, sampling)
        batch, _ = score_step(scorer, batch, tokenizer=tokenizer, judge=judge,
                              given=None if given is None else batch[given])  # fmt: skip
        if see is not None:
            see(j, batch)
        scores = batch["token_scores"].sum(-1).tolist()
        out += list(zip(batch["data_source"], batch["uid"], scores, strict=True))
    return out


def validate_policy(
    engine: RolloutEngine,
    dataset: PromptDataset,
    scorer: RewardScorer,
    tokenizer: Any,
    *,
    max_tokens: int,
    k: int,
    seed: int,
    samples: Callable[[Batch], None] | None = None,
    teacher: Callable[[Batch], Tensor] | None = None,
    judge: Judge | None = None,
    given: str | None = None,
) -> dict[str, float]:
    """`val/reward_mean` (greedy), `val/pass@k` (best of k samples at temperature 1), per data_source too;
    `samples` sees the first scored batch of greedy samples (what val_samples.jsonl shows). `teacher`
    (a distillation run's): a sampled batch's teacher log-probs (b, t) at temperature 1, for
    `val/teacher/*`, the reverse KL of the k samples to the teacher (`rlcore.pure.distill`)."""
    metrics: dict[str, float] = {}
    first = (lambda j, batch: samples(batch) if j == 0 else None) if samples is not None else None
    greedy = _scores(
        engine,
        dataset,
        scorer,
        tokenizer,
        SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0),
        first,
        judge,
        given,
    )
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, _, score in greedy:
        by_source[source].append(score)
    metrics["val/reward_mean"] = sum(s for _, _, s in greedy) / len(greedy)
    for source, values in by_source.items():
        metrics[f"val/{source}/reward_mean"] = sum(values) / len(values)
    if k > 1:
        sampling = SamplingParams(n=k, max_tokens=max_tokens, temperature=1.0, seed=seed)
        best: dict[str, float] = {}
        tokens: list[tuple[Tensor, Tensor]] = []  # (student, teacher) log-probs of the response tokens
        see = (lambda _, batch: tokens.append(_response_logprobs(batch, teacher))) if teacher else None
        for _, uid, score in _scores(engine, dataset, scorer, tokenizer, sampling, see, judge, given):
            best[uid] = max(best.get(uid, -torch.inf), score)
        metrics["val/pass@k"] = sum(best.values()) / len(best)
        if tokens:
            student, taught = (torch.cat(side)[None] for side in zip(*tokens, strict=True))
            stats = reverse_kl_stats(student, taught, torch.ones_like(student))
            metrics |= {f"val/{k}": float(v) for k, v in stats.items()}
    return metrics


def _response_logprobs(batch: Batch, teacher: Callable[[Batch], Tensor]) -> tuple[Tensor, Tensor]:
    """The engine's (the student's) and the teacher's log-probs of a batch's response tokens, flat."""
    mask = batch["response_mask"] != 0
    return batch["rollout_logprobs"][mask], teacher(batch)[mask]
