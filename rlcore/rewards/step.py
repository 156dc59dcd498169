"""score_step: decode the responses, score them, and put each scalar on its last response token.

    batch, metrics = score_step(scorer, batch, tokenizer=tokenizer)
    batch, metrics = score_step(scorer, batch, tokenizer=tokenizer, reward_model=rm, rule_weight=1.0,
                                rm_weight=0.5, overlong=OverlongPenalty(max_length=1024, buffer_length=256))

The sequence score is `rule_weight * rule + rm_weight * rm + overlong_penalty` (each term only when
configured). It lands on the LAST token where `response_mask` is 1 of `token_scores` (b, t), zero
elsewhere; a row with no response token gets nothing. Metrics (0-dim tensors): `reward/score_mean`,
`reward/errors`, `reward/timeouts` (sample counts), `reward/<key>` (mean of each extra a dict
reward returned), `reward/rule_mean` and `reward/rm_mean` when a reward model is mixed in,
`reward/overlong_penalty_mean` and `reward/overlong_frac` with the overlong penalty; with a generative
judge (`rlcore.rewards.judge`), `reward/judge_mean`, `reward/judge_failures` and `reward/judge_s`.
The batch gains `token_scores` and `reward_extras` (the per-row extras dicts).
The text scored is every real response token (`response_attention` where the batch has it): a
multi-turn response is scored with its tool results, which the policy saw but is not trained on.
An environment's episodes (`env_rewards` in the batch, `rlcore.rollout.agent.loop`) add their summed step
rewards; there the reward function scores only the rows whose data_source it covers
(`RewardScorer.covers`), and an episode whose environment failed scores its `env_rewards` (the failure
score) alone. Metrics: `reward/env_mean` besides the above. Rewards an agent returned (`given`) replace
the reward functions' on their rows; metrics `reward/agent_mean` and `reward/agent_given_frac`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.rewards.judge import Judge
from rlcore.rewards.pool import RewardScorer


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13; verl `DAPORewardManager`)."""

    max_length: int
    """L_max: the rollout's maximum response length in tokens."""
    buffer_length: int
    """L_cache: the penalty ramps from 0 to -penalty_factor over the last `buffer_length` tokens."""
    penalty_factor: float = 1.0
    """Penalty at L = L_max."""

    def __post_init__(self) -> None:
        if not 0 < self.buffer_length <= self.max_length:
            raise ValueError(
                f"--reward.overlong-buffer-length={self.buffer_length}: expected 1..max_length ({self.max_length})"
            )


def overlong_penalty(
    lengths: Tensor, *, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """Soft overlong penalty per response, (b,) -> (b,) float.

    min(0, -(L - (L_max - L_cache)) / L_cache * factor): 0 up to L_max - L_cache, then linear down to
    -factor at L = L_max (verl's form; it keeps falling past L_max, which a rollout capped at L_max
    never reaches). DAPO, arXiv:2503.14476, eq. 13.
    """
    exceed = lengths.to(torch.float64) - (max_length - buffer_length)  # (b,)
    return torch.clamp(-exceed / buffer_length * penalty_factor, max=0.0)


def last_token_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """(b,) scores placed on the last position where response_mask is 1 of a (b, t) zero tensor."""
    mask = response_mask.bool()  # (b, t)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # (b, t)
    last = torch.where(mask, positions, -1).max(dim=1).values  # (b,); -1: no response token
    hit = positions == last[:, None]  # (b, t); all False on a row without response tokens
    return torch.where(hit, scores[:, None].to(torch.float32), 0.0)


def decode_responses(tokenizer: Any, responses: Tensor, response_mask: Tensor) -> list[str]:
    """The text of each row's response tokens (where the mask is 1), special tokens skipped."""
    mask = response_mask.bool().cpu()
    rows = [ids[m].tolist() for ids, m in zip(responses.cpu(), mask, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def score_step(
    scorer: RewardScorer | None,
    batch: Batch,
    *,
    tokenizer: Any,
    reward_model: Any = None,
    rule_weight: float = 1.0,
    rm_weight: float = 1.0,
    overlong: OverlongPenalty | None = None,
    judge: Judge | None = None,
    given: Tensor | None = None,
) -> tuple[Batch, dict[str, Tensor]]:
    """Batch + `token_scores` (b, t) and `reward_extras`, and the step's reward metrics; with a `judge`,
    its rows' scores come from its verdicts (`judge_verdicts` in the batch, None on other rows). `given`:
    (b,) rewards the rollout gave itself (an openai-client agent's, `rlcore.gateway.agents`); a row with a
    number scores it (no reward function or judge runs on it), a NaN row is scored as usual."""
    if scorer is None and reward_model is None and judge is None:
        raise ValueError("score_step needs a rule scorer, a reward model, a judge, or some of them")
    responses, response_mask = batch["responses"], batch["response_mask"]
    # the whole response as the policy saw it: multi-turn tool results (attended, not trained) included
    visible = batch["response_attention"]
    texts = decode_responses(tokenizer, responses, visible)
    metrics: dict[str, Tensor] = {}
    total = torch.zeros(len(batch), dtype=torch.float64)  # (b,)
    extras: list[dict[str, float]] = [{} for _ in texts]
    episodes = "env_rewards" in batch
    judged = [i for i, s in enumerate(batch["data_source"]) if judge is not None and judge.covers(s)]
    ruled = (
        (i for i, s in enumerate(batch["data_source"]) if not episodes or scorer.covers(s)) if scorer else ()
    )
    own = set() if given is None else set(torch.isfinite(given).nonzero().flatten().tolist())
    judged = [i for i in judged if i not in own]
    scored = sorted(set(ruled) - set(judged) - own)
    if judged:
        total, verdicts, judge_metrics = _judged(
            judge, batch, texts, judged, _prompts(batch, tokenizer), total
        )
        metrics |= judge_metrics
        batch = batch.with_(judge_verdicts=verdicts, overwrite=True)
    if scored:
        rule = _ruled(scorer, batch, texts, scored, extras, metrics)  # (b,); 0 where no reward function covers
        total = total + rule_weight * rule
        if reward_model is not None:
            metrics["reward/rule_mean"] = rule.mean()
    if reward_model is not None:
        rm = reward_model.score(_prompts(batch, tokenizer), texts).to(torch.float64).cpu()  # (b,)
        total = total + rm_weight * rm
        metrics["reward/rm_mean"] = rm.mean()
    if given is not None:
        total = _given(total, given.to(torch.float64).cpu(), metrics)
    if overlong is not None:  # its budget, max_length, counts tool results too
        total = total + _overlong(overlong, visible.sum(dim=1).cpu(), metrics)
    if episodes:
        env = batch["env_rewards"].to(torch.float64).cpu()  # (b,)
        failed = (batch["env_errors"] | batch["env_timeouts"]).cpu()  # (b,) bool
        total = torch.where(failed, env, total + env)
        metrics["reward/env_mean"] = env.mean()
    metrics["reward/score_mean"] = total.mean()
    token_scores = last_token_scores(total.to(response_mask.device), response_mask)  # (b, t)
    metrics = {k: v.to(torch.float32) for k, v in metrics.items()}
    return batch.with_(token_scores=token_scores, reward_extras=extras), metrics


def _ruled(scorer: RewardScorer, batch: Batch, texts: list[str], rows: list[int], extras: list[dict[str, float]],
           metrics: dict[str, Tensor]) -> Tensor:  # fmt: skip
    """(b,) the reward functions' scores of `rows` (0 elsewhere); their extras into `extras`, and the metrics
    `reward/<extra>`, `reward/errors`, `reward/timeouts` into `metrics`."""
    pick = lambda key: [batch[key][i] for i in rows]  # noqa: E731
    result = scorer.score(pick("data_source"), [texts[i] for i in rows], pick("ground_truth"), pick("extra_info"))
    rule = torch.zeros(len(batch), dtype=torch.float64)  # (b,)
    rule[rows] = torch.tensor(result.scores, dtype=torch.float64)
    for i, e in zip(rows, result.extras, strict=True):
        extras[i] = dict(e)
    metrics.update({f"reward/{k}": torch.tensor(v) for k, v in result.extra_means().items()})
    metrics["reward/errors"] = torch.tensor(float(result.errors))  # after the extras: ours win a clash
    metrics["reward/timeouts"] = torch.tensor(float(result.timeouts))
    return rule


def _overlong(overlong: OverlongPenalty, lengths: Tensor, metrics: dict[str, Tensor]) -> Tensor:
    """(b,) DAPO's soft overlong penalty of responses `lengths` long, with its two metrics."""
    penalty = overlong_penalty(lengths, max_length=overlong.max_length, buffer_length=overlong.buffer_length,
                               penalty_factor=overlong.penalty_factor)  # fmt: skip
    metrics["reward/overlong_penalty_mean"] = penalty.mean()
    metrics["reward/overlong_frac"] = (penalty < 0).to(torch.float64).mean()
    return penalty


def _given(total: Tensor, given: Tensor, metrics: dict[str, Tensor]) -> Tensor:
    """`total` with the given rewards where they are numbers; `reward/agent_mean` over those rows and
    `reward/agent_given_frac`, the share of rows that had one."""
    own = torch.isfinite(given)  # (b,)
    metrics["reward/agent_mean"] = given[own].mean() if own.any() else torch.tensor(0.0)
    metrics["reward/agent_given_frac"] = own.to(torch.float64).mean()
    return torch.where(own, given, total)


def _judged(judge: Judge, batch: Batch, texts: list[str], rows: list[int], prompts: list[Any],
            total: Tensor) -> tuple[Tensor, list[str | None], dict[str, Tensor]]:  # fmt: skip
    """The judge's scores added to `total` at `rows`, each row's verdict (None: not judged) and the
    metrics `reward/judge_mean`, `reward/judge_failures` (verdicts not read) and `reward/judge_s`."""
    v = judge.judge(
        [prompts[i] for i in rows], [texts[i] for i in rows], [batch["ground_truth"][i] for i in rows]
    )
    scores = torch.zeros_like(total)
    scores[rows] = torch.tensor(v.scores, dtype=total.dtype)
    verdicts: list[str | None] = [None] * len(batch)
    for i, text in zip(rows, v.texts, strict=True):
        verdicts[i] = text
    metrics = {"reward/judge_mean": scores[rows].mean(), "reward/judge_failures": torch.tensor(float(v.failures)),
               "reward/judge_s": torch.tensor(v.seconds)}  # fmt: skip
    return total + scores, verdicts, metrics


def _prompts(batch: Batch, tokenizer: Any) -> list[Any]:
    """The rows' prompts as chat messages (`raw_prompt`), else the decoded prompt tokens as text."""
    if "raw_prompt" in batch:
        return list(batch["raw_prompt"])
    return decode_responses(tokenizer, batch["input_ids"], batch["attention_mask"])
