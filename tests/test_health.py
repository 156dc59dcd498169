"""Run-health checks (issue 18, item 7): each condition by hand, a warning only when it starts."""

from __future__ import annotations

import pytest

from rlcore.state import Health
from rlcore.trainer.health import NO_SIGNAL_STEPS, ExactnessLost, check_exact, check_health

KW = {"engine": "native", "dtype": "float32", "max_tokens": 16}
OK = {"train/equal_reward_group_frac": 0.5, "actor/entropy": 1.0, "rollout/logprob_diff_max": 1e-6,
      "response/clip_ratio": 0.1}  # fmt: skip


def run(steps: list[dict]) -> list[tuple[dict, list[str]]]:
    health, out = Health(), []
    for step, metrics in enumerate(steps, start=1):
        health, checked, lines = check_health(health, metrics, step=step, **KW)
        out.append((checked, lines))
    return out


def test_a_healthy_run_warns_nothing_and_reports_every_metric():
    (checked, lines), *_ = run([OK])
    assert lines == []
    assert checked == {"health/no_signal_streak": 0.0, "health/entropy_ratio": 1.0,
                       "health/logprob_gap_high": 0.0, "health/length_pinned": 0.0}  # fmt: skip


def test_no_signal_warns_once_at_the_third_equal_step_and_again_after_a_break():
    flat = OK | {"train/equal_reward_group_frac": 1.0}
    steps = [flat] * (NO_SIGNAL_STEPS + 1) + [OK] + [flat] * NO_SIGNAL_STEPS
    out = run(steps)
    assert [c["health/no_signal_streak"] for c, _ in out] == [1, 2, 3, 4, 0, 1, 2, 3]
    warned = [i + 1 for i, (_, lines) in enumerate(out) if lines]
    assert warned == [3, 8]
    assert out[2][1][0].startswith(
        "warning: step 3: every prompt group's samples have scored the same for 3 steps"
    )


def test_entropy_collapse_is_relative_to_the_first_step():
    out = run([OK | {"actor/entropy": 2.0}, OK | {"actor/entropy": 0.5}, OK | {"actor/entropy": 0.19},
               OK | {"actor/entropy": 0.1}])  # fmt: skip
    assert [c["health/entropy_ratio"] for c, _ in out] == pytest.approx([1.0, 0.25, 0.095, 0.05])
    assert [bool(lines) for _, lines in out] == [False, False, True, False]
    assert "the policy's entropy fell to 0.19, 9.5% of its first value" in out[2][1][0]


def test_the_gap_warns_on_fresh_batches_only_and_the_bound_follows_the_dtype():
    high = OK | {"rollout/logprob_diff_max": 0.05}
    ((checked, lines),) = run([high])
    assert checked["health/logprob_gap_high"] == 1.0 and "differ from the trainer's by up to 0.05" in lines[0]
    ((checked, lines),) = run([high | {"pipeline/staleness_max": 1.0}])  # lagged: differs by design
    assert lines == [] and "health/logprob_gap_high" not in checked
    _, checked, lines = check_health(Health(), high, step=1, **KW | {"dtype": "bfloat16"})
    assert lines == [] and checked["health/logprob_gap_high"] == 0.0


def test_exact_mode_stops_at_any_gap_but_not_on_a_lagged_batch():
    """--rollout.exact: a gap of one ulp stops the run in one line; 0.0, an unmeasured step and a batch an
    older policy generated (lag mode) pass."""
    with pytest.raises(ExactnessLost, match=r"^step 3: --rollout.exact, yet .* by up to 1.19e-07 "):
        check_exact({"rollout/logprob_diff_max": 2.0**-23}, step=3)
    check_exact({"rollout/logprob_diff_max": 0.0}, step=1)
    check_exact({}, step=1)
    check_exact({"rollout/logprob_diff_max": 0.5, "pipeline/staleness_max": 1.0}, step=1)


def test_pinned_lengths_warn_with_the_flag_to_raise():
    ((checked, lines),) = run([OK | {"response/clip_ratio": 0.95}])
    assert checked["health/length_pinned"] == 1.0
    assert lines == [
        "warning: step 1: 95% of the responses were cut at --rollout.max-tokens 16 (response/clip_ratio): "
        "lengths are pinned at the maximum; raise --rollout.max-tokens or penalise overlong responses "
        "(--reward.overlong-buffer-length)"
    ]
