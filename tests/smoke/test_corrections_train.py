"""train.py with the off-policy corrections (issue 16, item 5): decoupled IS, rejection, veto, bypass."""

from __future__ import annotations

import pytest

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import SMALL, ok, train

STEPS = ["--trainer.steps", "2", "--trainer.val-every", "0"]


def test_decoupled_ppo_with_rejection_and_veto_logs_the_corrections(tmp_path) -> None:
    ok(train("grpo", *SMALL, *STEPS, "--algo.rollout-is", "sequence", "--algo.rollout-rs", "token",
             "--algo.rollout-veto", "1e-4", out=tmp_path))  # fmt: skip
    for r in read_metrics(tmp_path / "metrics.jsonl"):
        # native fp32 engine: old and rollout policies agree to ~1e-6, so every weight is ~1, nothing rejected
        assert r["rollout_corr/is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r["rollout_corr/rs_masked_fraction"] == 0.0 and r["rollout_corr/veto_fraction"] == 0.0
        assert abs(r["rollout_corr/kl"]) < 1e-4 and "rollout/logprob_diff_max" in r  # the recompute ran


def test_bypass_uses_the_rollout_logprobs_as_the_old_policy(tmp_path) -> None:
    ok(train("grpo", *SMALL, *STEPS, "--algo.bypass", out=tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 and "timing/old_logprobs_s" not in r for r in records)  # no old pass
    assert all(0 < r["rollout/logprob_diff_max"] < 1e-3 for r in records)  # measured by the first update's forward


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--algo.tis-cap", "2", "--algo.rollout-is", "token"],
         "error: --algo.tis-cap 2.0 and --algo.rollout-is token: both weight by old/rollout; use one"),
        (["--algo.bypass", "--algo.rollout-rs", "token"],
         "error: --algo.bypass: the old policy is then the rollout's, so --algo.rollout-is / -rs / -veto would "
         "see ratios of 1; drop them or drop --algo.bypass"),
        (["--algo.rollout-rs-upper", "0"], "error: --algo.rollout-rs-upper 0.0: must be > 0"),
        (["--algo.rollout-veto", "-1"], "error: --algo.rollout-veto -1.0: must be > 0"),
    ],
)  # fmt: skip
def test_bad_correction_flags_are_one_line(flags, line, tmp_path) -> None:
    proc = train("grpo", *SMALL, *flags, out=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == line
