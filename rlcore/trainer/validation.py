"""Validation: greedy and sampled (pass@k) reward on the validation set, overall and per data_source."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from rlcore.batch import Batch
from rlcore.data.dataset import PromptDataset
from rlcore.rewards.pool import RewardScorer
from rlcore.rewards.step import score_step
from rlcore.rollout.base import RolloutEngine, SamplingParams


def _scores(engine: RolloutEngine, dataset: PromptDataset, scorer: RewardScorer, tokenizer: Any, sampling,
            first: Callable[[Batch], None] | None = None):  # fmt: skip
    """(data_source, uid, score) for every generated sample of the validation set; `first` sees the
    first scored batch."""
    out = []
    for j, prompts in enumerate(dataset.iter_batches(256)):
        batch = engine.generate(prompts, sampling)
        batch, _ = score_step(scorer, batch, tokenizer=tokenizer)
        if first is not None and j == 0:
            first(batch)
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
) -> dict[str, float]:
    """`val/reward_mean` (greedy), `val/pass@k` (best of k samples at temperature 1), per data_source too;
    `samples` sees the first scored batch of greedy samples (what val_samples.jsonl shows)."""
    metrics: dict[str, float] = {}
    greedy = _scores(
        engine,
        dataset,
        scorer,
        tokenizer,
        SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0),
        samples,
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
        for _, uid, score in _scores(engine, dataset, scorer, tokenizer, sampling):
            best[uid] = max(best.get(uid, -torch.inf), score)
        metrics["val/pass@k"] = sum(best.values()) / len(best)
    return metrics
