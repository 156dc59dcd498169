"""Checks of a run's health that warn (one `warning:` line on stderr) instead of stopping it.

The rollout/trainer gap: at the first step a process trains, the largest |engine - trainer| log-prob
of a sampled token (`rollout/logprob_diff_max`, the max over ranks) is compared with a bound for the
model's dtype. Measured gaps of a correct sync: native fp32 <= 1e-5, vllm-cpu fp32 ~1e-6 (random-init
Qwen2 shapes up to 494M: 1.9e-6), native bf16 0.03-0.07. A broken sync (issue 24: a vLLM reload given
half of a stacked q/k/v or gate/up group) measured 0.36-2.3. The bounds sit between the two: 1e-3 in
fp32, 0.15 in bf16 (bf16 rounds each logit to ~3 significant digits, so kernels that sum in another
order disagree by a few hundredths).
"""

from __future__ import annotations

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
