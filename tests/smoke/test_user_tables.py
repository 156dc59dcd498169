"""A user's script adds an estimator and a policy loss to the public tables and selects them with
train.py's flags (issue 15): nothing else is needed, and validation treats them like built-ins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ROOT, SMALL

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from rlcore.pure.advantages import ESTIMATORS
    from rlcore.pure.losses import POLICY_LOSSES

    def quarter(token_rewards, response_mask, group_ids, *, gamma=0.0):  # gamma: bound to --algo.gamma
        adv = response_mask * 0.25 * (1.0 + gamma)  # (b, t)
        return adv, adv

    def seven(logprob, old_logprob, advantages, response_mask, *, clip_high=0.0, **kw):
        loss = (logprob * response_mask).sum() * 0.0 + 7.0 + clip_high  # --algo.clip-high reaches it
        return loss, {{}}

    def needs_beta(token_rewards, response_mask, beta):
        return token_rewards, token_rewards

    ESTIMATORS["quarter"] = quarter
    ESTIMATORS["needs_beta"] = needs_beta
    POLICY_LOSSES["seven"] = seven
    import train
    sys.exit(train.main(sys.argv[1:]))
    """
)


def run_script(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "my_algo.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, str(script), "grpo", *SMALL, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


def test_a_users_estimator_and_loss_run_through_the_flags(tmp_path) -> None:
    proc = run_script(tmp_path, "--algo.adv-estimator", "quarter", "--algo.policy-loss", "seven",
                      "--algo.gamma", "1.0", "--algo.clip-high", "0.5", "--trainer.steps", "2",
                      "--trainer.val-every", "0", "--out-dir", str(tmp_path / "run"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["critic/advantages/mean"] == 0.5  # 0.25 * (1 + gamma): the user's estimator, flag bound
        assert r["actor/pg_loss"] == 7.5  # 7 + clip_high: the user's loss, flag bound


def test_a_users_group_estimator_is_checked_like_a_builtin(tmp_path) -> None:
    proc = run_script(tmp_path, "--algo.adv-estimator", "quarter", "--rollout.n", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --rollout.n 1: --algo.adv-estimator quarter compares samples of a prompt; use n >= 2"
    )
    proc = run_script(tmp_path, "--algo.adv-estimator", "needs_beta")
    assert proc.returncode == 2
    assert "--algo.adv-estimator needs_beta: its parameters ['beta'] are neither batch inputs" in proc.stderr


def test_the_objective_not_the_preset_name_selects_sft(tmp_path) -> None:
    from tests.smoke.test_train import train

    proc = train("grpo", *SMALL, "--algo.objective", "sft", "--algo.policy-loss", "gpg", "--trainer.steps", "1",
                 "--trainer.val-every", "0", out=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert "sft/nll" in record and "train/reward_mean" not in record
