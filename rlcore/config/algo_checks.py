"""The algorithm's pre-flight checks: --algo's table entries (estimator, policy loss, KL kinds), their
parameters, the corrections and distillation's flags, each refused in one line (`ConfigError`) before
anything is built."""

from __future__ import annotations

import dataclasses
import math

from configs import AlgoConfig, Config, ConfigError
from rlcore.algorithm import estimator_inputs, missing_inputs, parameters
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.kl import KL_KINDS
from rlcore.pure.losses import POLICY_LOSSES

ALGO_FIELDS = frozenset(f.name for f in dataclasses.fields(AlgoConfig))
"""The --algo field names: a table entry's keyword parameter of one of these names is bound to its flag."""


def corrects(a: AlgoConfig) -> bool:
    """Whether an off-policy correction of old vs rollout log-probs is on (--algo.rollout-is/-rs/-veto)."""
    return a.rollout_is is not None or a.rollout_rs is not None or a.rollout_veto is not None


def need(ok: bool, message: str) -> None:
    """A pre-flight check: ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def check_algorithm(cfg: Config) -> None:
    """--algo's table entries, their parameters and the corrections, before anything is built."""
    a = cfg.algo
    need(
        a.adv_estimator in ESTIMATORS,
        f"--algo.adv-estimator {a.adv_estimator!r}: choose one of {sorted(ESTIMATORS)}",
    )
    need(
        a.policy_loss in POLICY_LOSSES,
        f"--algo.policy-loss {a.policy_loss!r}: choose one of {sorted(POLICY_LOSSES)}",
    )
    for flag, kind in (("--algo.kl-kind", a.kl_kind), ("--algo.kl-loss-kind", a.kl_loss_kind)):
        need(kind in KL_KINDS, f"{flag} {kind!r}: choose one of {list(KL_KINDS)}")
    _check_estimator(cfg)
    need(
        {"logprob", "old_logprob", "advantages", "response_mask"} <= parameters(POLICY_LOSSES[a.policy_loss]),
        f"--algo.policy-loss {a.policy_loss}: a policy loss takes (logprob, old_logprob, advantages, response_mask, ...)",
    )
    _check_corrections(a)
    _check_teacher(cfg)


def _check_teacher(cfg: Config) -> None:
    """On-policy distillation's flags: a teacher where the advantages need one, a usable coefficient and clip."""
    a = cfg.algo
    if a.teacher is None:
        fix = (
            "give --algo.teacher PATH"
            if cfg.preset == "distill"
            else "choose another estimator or give --algo.teacher"
        )
        need(
            a.adv_estimator != "none",
            f"--algo.adv-estimator none: without a teacher no advantage is left to learn from; {fix}",
        )
        return
    need(
        a.objective == "rl",
        f"--algo.teacher {a.teacher}: distillation scores sampled tokens; --algo.objective sft samples none",
    )
    need(
        math.isfinite(a.teacher_coef) and a.teacher_coef > 0,
        f"--algo.teacher-coef {a.teacher_coef}: must be > 0",
    )
    need(
        a.teacher_clip is None or a.teacher_clip > 0,
        f"--algo.teacher-clip {a.teacher_clip}: must be > 0 (or unset)",
    )


def _check_estimator(cfg: Config) -> None:
    """The estimator's parameters are batch inputs or --algo flags; group estimators need n >= 2."""
    a, n = cfg.algo, cfg.rollout.n
    estimator = ESTIMATORS[a.adv_estimator]
    unknown = [p for p in missing_inputs(estimator) if p not in ALGO_FIELDS]
    need(
        not unknown,
        f"--algo.adv-estimator {a.adv_estimator}: its parameters {unknown} are neither batch inputs "
        f"(token_rewards, response_mask, group_ids, values, baseline_rewards) nor --algo flags; give them defaults",
    )
    inputs = estimator_inputs(estimator)
    need(
        "token_rewards" in inputs and "response_mask" in inputs,
        f"--algo.adv-estimator {a.adv_estimator}: an estimator takes (token_rewards, response_mask, ...)",
    )
    need(
        "group_ids" not in inputs or n >= 2 or a.objective == "sft",
        f"--rollout.n {n}: --algo.adv-estimator {a.adv_estimator} compares samples of a prompt; use n >= 2",
    )


def _check_corrections(a: AlgoConfig) -> None:
    """--algo.tis-cap, --algo.bypass and the --algo.rollout-* corrections fit together."""
    need(
        a.tis_cap is None or a.rollout_is is None,
        f"--algo.tis-cap {a.tis_cap} and --algo.rollout-is {a.rollout_is}: both weight by old/rollout; use one",
    )
    need(
        not (a.bypass and corrects(a)),
        "--algo.bypass: the old policy is then the rollout's, so --algo.rollout-is / -rs / -veto would see "
        "ratios of 1; drop them or drop --algo.bypass",
    )
    for flag, value in (
        ("--algo.rollout-is-cap", a.rollout_is_cap),
        ("--algo.rollout-rs-upper", a.rollout_rs_upper),
    ):
        need(value > 0, f"{flag} {value}: must be > 0")
    need(
        a.rollout_rs_lower is None or 0 <= a.rollout_rs_lower <= a.rollout_rs_upper,
        f"--algo.rollout-rs-lower {a.rollout_rs_lower}: must be in [0, --algo.rollout-rs-upper {a.rollout_rs_upper}]",
    )
    need(a.rollout_veto is None or a.rollout_veto > 0, f"--algo.rollout-veto {a.rollout_veto}: must be > 0")
