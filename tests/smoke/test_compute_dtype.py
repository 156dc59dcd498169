"""--model.compute-dtype (issue 17, item 3): the trainer's forward passes under bf16 autocast."""

from __future__ import annotations

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import SMALL, ok, train

FLAGS = [*SMALL, "--trainer.steps", "2", "--trainer.val-every", "0", "--algo.rollout-is", "token"]


def test_bf16_compute_runs_the_trainer_passes_in_bf16_and_the_rollout_in_fp32(tmp_path) -> None:
    """The recomputed old log-probs (a trainer pass) differ from the fp32 rollout's by bf16 rounding,
    not by fp32's; the run learns (finite, non-zero gradients) and no gap warning fires."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        proc = train("grpo", *FLAGS, "--model.compute-dtype", dtype, out=tmp_path / dtype)
        ok(proc)
        assert "log-probs differ" not in proc.stderr, proc.stderr[-2000:]  # no gap warning
        runs[dtype] = read_metrics(tmp_path / dtype / "metrics.jsonl")
    for r in runs["float32"]:
        assert r["rollout/logprob_diff_max"] < 1e-4
    for r in runs["bfloat16"]:
        assert r["rollout/logprob_diff_mean"] > 1e-4 and r["rollout/logprob_diff_max"] < 0.15
        assert 0 < r["actor/grad_norm"] < float("inf")
