"""Delta weight pushes under split placement (issue 62, part 3): `--pipeline.push delta` trains exactly as
full pushes do (metrics and final weights), sends fewer bytes than a full push after the engine's start,
and a corrupted delta (RLCORE_TEST_CORRUPT_DELTA) is caught by the rollout rank's checksums and replaced by
a full push, counted in `sync/delta_fallbacks`, with the run still the same."""

from __future__ import annotations

import pytest

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_split import assert_same_metrics, assert_same_weights, ok, split

STEPS = ("--trainer.steps", "3")


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The split run with full pushes (the oracle)."""
    out = tmp_path_factory.mktemp("full")
    ok(split(*STEPS, out=out))
    return out


def records(out) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]


def test_delta_pushes_train_as_full_pushes_with_fewer_bytes(full, tmp_path) -> None:
    ok(split(*STEPS, "--pipeline.push", "delta", out=tmp_path))
    assert_same_metrics(full, tmp_path)
    assert_same_weights(full, tmp_path)
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0 < r["sync/bytes"] < r["sync/full_bytes"] for r in steps), [
        (r["sync/bytes"], r["sync/full_bytes"]) for r in steps
    ]
    assert all(r["sync/delta_fallbacks"] == 0 for r in steps)
    assert [r["sync/full_bytes"] for r in steps] == [r["sync/bytes"] for r in records(full)]


def test_a_corrupted_delta_falls_back_to_a_full_push(full, tmp_path) -> None:
    ok(split(*STEPS, "--pipeline.push", "delta", out=tmp_path, env={"RLCORE_TEST_CORRUPT_DELTA": "2"}))
    assert_same_metrics(full, tmp_path)
    assert_same_weights(full, tmp_path)
    steps = records(tmp_path)
    assert [r["sync/delta_fallbacks"] for r in steps] == [0, 1, 0]
    assert steps[1]["sync/bytes"] > steps[1]["sync/full_bytes"]  # the delta, then everything
