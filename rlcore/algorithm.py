"""The algorithm of a run as data: frozen pure callables, bound once by the shell.

    algorithm = Algorithm(
        advantage_fn=partial(ESTIMATORS["grpo"], norm_by_std=True),            # (adv, returns)
        policy_loss_fn=partial(POLICY_LOSSES["ppo_clip"], clip_low=0.2, clip_high=0.28, agg="token-mean"),
        loss_agg="token-mean",
    )
    batch, metrics = advantage_step(batch, algorithm, kl_coef=state.kl_coef)   # rlcore.step.steps
    actor, metrics = update_step(actor, batch, algorithm, plan, horizon=64)     # rlcore.step.update
    state, metrics, batch = learn(state, handles, algorithm, plan, batch)      # its `stages` in order

What an advantage estimator reads from the batch is named by its parameters (`ESTIMATOR_INPUTS`):
`token_rewards` (scores minus the KL penalty), `response_mask`, `group_ids` (a label per prompt:
the estimator compares a prompt's samples), `values` (the critic's V(s_t): a critic is built for it),
`baseline_rewards` (the greedy response's reward: ReMax's extra rollout). Its other parameters are
hyper-parameters, bound before it gets here (the shell binds those named like an `--algo` flag).
The same holds for a policy loss: the tensors positional, the rest keywords
(`rlcore.pure.losses.POLICY_LOSSES`); `generator` is given by the update when the loss takes one.

Like optax's `GradientTransformation`, an `Algorithm` holds no state: the live KL coefficient, the
weights and the counters are in `rlcore.state.TrainState`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torch import Tensor

ESTIMATOR_INPUTS = ("token_rewards", "response_mask", "group_ids", "values", "baseline_rewards")
"""Batch inputs an advantage estimator may take, by parameter name (the contract of ESTIMATORS)."""


def parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of `fn` (of a `functools.partial`'s function too)."""
    return frozenset(inspect.signature(fn).parameters)


def estimator_inputs(fn: Callable[..., Any]) -> frozenset[str]:
    """Which of `ESTIMATOR_INPUTS` the estimator `fn` reads."""
    return parameters(fn) & frozenset(ESTIMATOR_INPUTS)


def missing_inputs(fn: Callable[..., Any]) -> list[str]:
    """Required parameters of `fn` that are neither batch inputs nor bound (a user's estimator that the
    trainer could not call)."""
    return [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and name not in ESTIMATOR_INPUTS
    ]


C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class Stage(Generic[C]):
    """One stage of the learn chain: `run(ctx) -> ctx`, with the batch keys and state parts it reads
    (`needs`) and writes (`makes`); the library's context and chain are `rlcore.step.stages`'."""

    name: str
    needs: frozenset[str]
    makes: frozenset[str]
    run: Callable[[C], C]



@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm:
    """The pure callables and switches of one RL algorithm (no state; see the module docstring)."""

    advantage_fn: Callable[..., tuple[Tensor, Tensor]]
    """An advantage estimator, hyper-parameters bound: (advantages, returns), each (b, t)."""
    policy_loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    """A policy loss, hyper-parameters bound (clip range, aggregation): (loss, metrics)."""
    loss_agg: str = "token-mean"
    """How per-token terms (entropy, KL loss) are aggregated, as the policy loss does."""
    kl_kind: str = "k1"
    """KL estimator of the in-reward penalty (its coefficient lives in the TrainState)."""
    kl_loss_coef: float = 0.0
    """Coefficient of the KL-to-reference loss term (0: off)."""
    kl_loss_kind: str = "k3"
    """KL estimator of the loss term."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss; 0: entropy only measured)."""
    tis_cap: float | None = None
    """Truncated importance sampling of trainer vs rollout probabilities (None: off)."""
    correction_weights: bool = False
    """The learn chain's off-policy correction stage writes `is_weights` (`rlcore.step.steps.correction_step`
    with an importance-sampling level): the policy loss multiplies each token's term by them (decoupled PPO)."""
    bypass: bool = False
    """The rollout's log-probs are the old policy (no recompute pass)."""
    value_loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]] | None = None
    """The critic's loss, clip bound (None: no critic)."""
    router_aux_coef: float = 0.0
    """A mixture of experts' load-balancing loss coefficient (`rlcore.pure.routing.load_balancing_loss`;
    0: only measured)."""
    distill: Callable[..., Tensor] | None = None
    """On-policy distillation: `rlcore.pure.distill.distill_advantages` with its coefficient and clip
    bound, (advantages, student log-probs, teacher log-probs, mask) -> advantages; the step then needs
    the batch's `teacher_logprobs` (a frozen teacher's pass). None: off."""
    on_policy: bool = False
    """One update per step and no KL in the reward: the update's own forward gives the old log-probs
    (ratio 1), so the separate no-grad pass is skipped."""
    stages: tuple[Stage[Any], ...] = ()
    """The learn phase's chain, bound once (`rlcore.step.stages.stages_of`, a stage of your own with
    `rlcore.step.stages.with_stage`); empty: `learn` runs `stages_of(algorithm, plan)`."""

    @property
    def inputs(self) -> frozenset[str]:
        """What the advantage estimator reads from the batch."""
        return estimator_inputs(self.advantage_fn)

    @property
    def needs_critic(self) -> bool:
        return "values" in self.inputs

    @property
    def needs_greedy_baseline(self) -> bool:
        return "baseline_rewards" in self.inputs

    @property
    def compares_samples(self) -> bool:
        """The estimator normalises within a prompt's group (needs n >= 2)."""
        return "group_ids" in self.inputs


__all__ = ["ESTIMATOR_INPUTS", "Algorithm", "estimator_inputs", "missing_inputs", "parameters"]
