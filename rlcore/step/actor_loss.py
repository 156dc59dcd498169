"""The actor's micro-batch loss: the policy loss, then a table of loss terms, from one forward.

    loss, metrics = actor_micro_loss(model, micro, norms, algorithm=algorithm, temperature=1.0)

`actor_micro_loss` runs the micro-batch's forward (`rlcore.models.forward`), takes the policy loss of
`algorithm` on its log-probs (with its importance weights where the algorithm asks for them), then adds each
of `LOSS_TERMS` in order: the entropy bonus, the rollout gap (no loss: a metric), a mixture of experts'
router terms, the KL-to-reference loss. Each term reads the pass (`MicroPass`) and returns what it adds, or
None, and its metrics; a new term is a new row. `needed_fields` says which batch fields an update reads,
refusing a batch that lacks one in one line naming the flag that needs it. `rlcore.step.update.run_updates` plugs
the loss into the shared update loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch
from rlcore.models.forward import SEQUENCE_FIELDS, model_fields, model_inputs, response_logprobs
from rlcore.models.moe import router_tap, router_terms, tracing
from rlcore.pure.corrections import is_weights, logprob_gap
from rlcore.pure.kl import kl_estimate
from rlcore.pure.losses import aggregate
from rlcore.pure.masks import masked_sum

NORMS = ("num_tokens", "num_seqs", "horizon")
"""The keys of `norms` a loss aggregation takes (`rlcore.pure.losses.aggregate`'s normalisers)."""


def needed_fields(model: nn.Module, batch: Batch, algorithm: Algorithm) -> tuple[str, ...]:
    fields = [*SEQUENCE_FIELDS, "advantages"]
    if not algorithm.on_policy:
        fields.append("old_logprobs")
    measured = (algorithm.on_policy or algorithm.bypass) and "rollout_logprobs" in batch
    if algorithm.tis_cap is not None or measured:
        fields.append(
            "rollout_logprobs"
        )  # tis_cap needs it; on-policy or bypassed, the rollout gap is measured here
    if algorithm.kl_loss_coef > 0:
        fields.append("ref_logprobs")
    if algorithm.correction_weights:  # decoupled PPO: the correction step's weights for the behaviour gap
        fields.append("is_weights")
    fields.extend(k for k in model_fields(model, batch) if k not in fields)  # routes, images (forward.py)
    why = {
        "ref_logprobs": "--algo.use-kl-loss",
        "rollout_logprobs": "--algo.tis-cap",
        "old_logprobs": "an off-policy update (Algorithm.on_policy is False)",
        "is_weights": "Algorithm.correction_weights (rlcore.step.steps.correction_step with an is_level)",
    }
    for key in fields:
        if key not in batch:
            reason = f" (needed by {why[key]})" if key in why else ""
            raise ValueError(f"update_step: the batch has no field {key!r}{reason}")
    return (*fields, "uid") if "uid" in batch else tuple(fields)


@dataclasses.dataclass(frozen=True)
class MicroPass:
    """What one micro-batch's forward gave the loss terms: (m, r) tensors cut to the r response columns."""

    micro: Batch
    logprob: Tensor
    """The policy's log-probs, with grad."""
    entropy: Tensor
    """Per-token entropies (with grad only when an entropy bonus trains on them)."""
    old: Tensor
    mask: Tensor
    share: Tensor
    """This micro-batch's share of the mini-batch's tokens."""
    norms: dict[str, Any]
    """The mini-batch's global counts (`MicroLoss`'s `norms`)."""
    inputs: Any
    """The `ModelInputs` it ran (their token kinds and routes)."""
    tap: Any
    """A mixture of experts' router tap, or None."""
    trace: Any
    """What the tap traced during the forward."""

    @property
    def r(self) -> int:
        return self.logprob.shape[1]

    @property
    def agg(self) -> dict[str, Any]:
        """The aggregation's global normalisers (the `NORMS` of `norms`)."""
        return {k: self.norms[k] for k in NORMS}


def actor_micro_loss(
    model: nn.Module,
    micro: Batch,
    norms: dict[str, Any],
    *,
    algorithm: Algorithm,
    temperature: float,
    share_prompts: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy's micro-batch loss (a `MicroLoss` once the keywords are bound): the policy loss, then each
    of `LOSS_TERMS` (the entropy bonus, the rollout gap, a mixture of experts' router terms, the KL-to-reference
    loss); metrics under `actor/` (and `rollout/` gaps)."""
    inputs = model_inputs(model, micro, share_prompts=share_prompts)
    tap = router_tap(model)
    with tracing(tap) as trace:
        logprob, ent = response_logprobs(
            model, inputs, temperature=temperature, entropy=True, entropy_grad=algorithm.entropy_coef > 0
        )
    r = logprob.shape[1]  # (m, r) float32
    mask = micro["response_mask"][:, :r]  # (m, r)
    old = logprob.detach() if algorithm.on_policy else micro["old_logprobs"][:, :r]
    share = (mask != 0).sum() / norms["num_tokens"]
    step = MicroPass(micro, logprob, ent, old, mask, share, norms, inputs, tap, trace)
    extra = _policy_extras(algorithm, step, generator)
    pg_loss, pg_metrics = algorithm.policy_loss_fn(
        logprob, old, micro["advantages"][:, :r], mask, **extra, **step.agg
    )
    loss = pg_loss
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/entropy": masked_sum(ent.detach(), mask) / norms["num_tokens"],
        "actor/shared_prompt_frac": share * float(inputs.gather is not None),  # tokens in packed forwards
    }
    metrics |= {f"actor/{k}": v.detach() * share for k, v in pg_metrics.items()}
    for term in LOSS_TERMS:
        added, term_metrics = term(algorithm, step)
        loss = loss if added is None else loss + added
        metrics |= term_metrics
    return loss, metrics


def _policy_extras(
    algorithm: Algorithm, step: MicroPass, generator: torch.Generator | None
) -> dict[str, Any]:
    """The policy loss's optional keywords: importance weights (truncated IS of trainer vs rollout, or the
    correction step's), and clip_cov's generator (new token draws every step, the same on a resume)."""
    extra: dict[str, Any] = {}
    if algorithm.tis_cap is not None:
        rollout = step.micro["rollout_logprobs"][:, : step.r]
        extra["is_weights"], _ = is_weights(step.old, rollout, step.mask, cap=algorithm.tis_cap)
    elif algorithm.correction_weights:
        extra["is_weights"] = step.micro["is_weights"][:, : step.r]  # (m, r)
    if generator is not None:
        extra["generator"] = generator
    return extra


def _entropy_bonus(algorithm: Algorithm, step: MicroPass) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Minus the entropy coefficient times the aggregated entropy (None without a bonus)."""
    if algorithm.entropy_coef <= 0:
        return None, {}
    return -(algorithm.entropy_coef * aggregate(step.entropy, step.mask, algorithm.loss_agg, **step.agg)), {}


def _rollout_gap(algorithm: Algorithm, step: MicroPass) -> tuple[Tensor | None, dict[str, Tensor]]:
    """No loss: the engine's log-probs against these, where no old-log-prob pass measured them (on-policy:
    every micro-batch, as `logprob_gap`; bypassed: the first update's forward, a max)."""
    if "rollout_logprobs" not in step.micro:  # a batch without the engine's log-probs (SFT rows, a user's)
        return None, {}
    rollout = step.micro["rollout_logprobs"][:, : step.r]
    if algorithm.on_policy:
        gap = logprob_gap(rollout, step.old, step.mask, num_tokens=step.norms["num_tokens"])
        return None, {f"rollout/logprob_diff_{k}": v for k, v in gap.items()}
    if algorithm.bypass and step.norms.get("fresh"):
        return None, {
            "rollout/logprob_diff_max": logprob_gap(rollout, step.logprob.detach(), step.mask)["max"]
        }
    return None, {}


def _router(algorithm: Algorithm, step: MicroPass) -> tuple[Tensor | None, dict[str, Tensor]]:
    """A mixture of experts' load-balancing loss (when its coefficient is set) and router metrics."""
    if step.tap is None:
        return None, {}
    aux, router_metrics = router_terms(step.tap, step.trace, step.inputs.token_kind, step.inputs.routes)
    metrics = {k: v.detach() * step.share for k, v in router_metrics.items()}
    return (algorithm.router_aux_coef * aux * step.share if algorithm.router_aux_coef > 0 else None), metrics


def _kl_loss(algorithm: Algorithm, step: MicroPass) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The KL-to-reference loss term (when its coefficient is set)."""
    if algorithm.kl_loss_coef <= 0:
        return None, {}
    kl = kl_estimate(step.logprob, step.micro["ref_logprobs"][:, : step.r], algorithm.kl_loss_kind)  # (m, r)
    kl_loss = aggregate(kl, step.mask, algorithm.loss_agg, **step.agg)
    return algorithm.kl_loss_coef * kl_loss, {"actor/kl_loss": kl_loss.detach()}


LOSS_TERMS = (_entropy_bonus, _rollout_gap, _router, _kl_loss)
"""The terms after the policy loss, in the order they are added: each (algorithm, the micro-batch's pass) ->
(what it adds to the loss, or None; its metrics). A new term is a new row."""
