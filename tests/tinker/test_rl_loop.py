"""The README's loop (examples/tinker_rl.py), written the way the Tinker cookbook writes RL, run with the real SDK
against a real server, learns the default task as `python train.py` does: the greedy validation of both, run
here side by side on the same 128 validation rows, ends within 0.03 (train.py's default run: 0.233 -> 0.993)."""

from __future__ import annotations

import importlib.util

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ok, train
from tests.tinker.server import ROOT, running


def test_the_cookbook_loop_learns_the_default_task_as_train_py_does(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("tinker_rl", ROOT / "examples" / "tinker_rl.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    with running(tmp_path / "server") as url:
        monkeypatch.setenv("TINKER_BASE_URL", url)
        monkeypatch.setenv("TINKER_API_KEY", "tml-rlcore-tests")
        before, after, _ = loop.main()
    ok(train("--log.no-progress", out=tmp_path / "train"))
    vals = [r["val/reward_mean"] for r in read_metrics(tmp_path / "train" / "metrics.jsonl") if "val/reward_mean" in r]
    assert abs(before - vals[0]) < 1e-6  # the same model, rows and greedy decoding: the same starting score
    assert abs(after - vals[-1]) <= 0.03 and after > 0.9, (before, after, vals)
