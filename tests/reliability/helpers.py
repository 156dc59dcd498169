"""Shared pieces of the reliability tests: the small deterministic run, and comparing two runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import SMALL, ok  # noqa: F401  (re-exported)

STEPS = 4


def run_args(steps: int = STEPS) -> list[str]:
    """The small default-task run on CPU, a checkpoint after each step: deterministic for its seed."""
    return ["grpo", *SMALL, "--trainer.steps", str(steps), "--trainer.save-every", "1",
            "--trainer.val-every", "0"]  # fmt: skip


RUN = run_args()
KEYS = ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean")


def assert_same_run(expected: Path, got: Path) -> None:
    """Same logged steps, the same metrics of each (abs 1e-6), and bit-identical final weights."""
    a, b = read_metrics(expected / "metrics.jsonl"), read_metrics(got / "metrics.jsonl")
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a, b, strict=True):
        for key in KEYS:
            assert rb[key] == pytest.approx(ra[key], abs=1e-6, rel=0), (ra["step"], key)
    wa, wb = (load_file(run / "final" / "model.safetensors") for run in (expected, got))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
