"""reduce_metrics on 2 gloo ranks: the logged metrics are the global ones, identical on every rank; the\nstart-up context check and exact mode's row layouts decided alike on every rank."""

from __future__ import annotations

import json

import pytest

from tests.dist import workers


def test_metrics_are_reduced_as_named_over_ranks(tmp_path) -> None:
    workers.spawn("reduce_metrics_worker", tmp_path)
    got = [json.loads((tmp_path / f"reduced{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]
    # rank 0: a 1, b_max 0, c/min 5, d/max -1, only_rank0 7; rank 1: a 2, b_max 10, c/min 4, d/max -2
    assert got[0] == {"a": 1.5, "b_max": 10.0, "c/min": 4.0, "d/max": -1.0, "only_rank0": 7.0}


def test_the_context_check_is_decided_alike_on_every_rank(tmp_path) -> None:
    """A prompt only rank 1 holds (200 tokens, beside 1900 of 2048 positions) stops both ranks, with the
    same line (without the reduction rank 0 would go on and wait for rank 1 forever)."""
    workers.spawn("context_worker", tmp_path)
    said = [(tmp_path / f"context{r}.txt").read_text() for r in (0, 1)]
    assert said[0] == said[1], said
    assert "too few for 1 prompt (1 of --data.train-files) beside --rollout.max-tokens 1900: the longest is 200" in said[0]


@pytest.mark.parametrize("differ", [False, True])
def test_exact_row_layouts_are_agreed_on_every_rank(tmp_path, differ) -> None:
    """--rollout.exact: ranks whose CPUs chose different row layouts for their products (rank 1 in tiles of
    64 rows) stop alike, with the same line naming the layouts; ranks that chose the same go on."""
    workers.spawn("exact_rows_worker", tmp_path, differ)
    said = [(tmp_path / f"exact_rows{r}.txt").read_text() for r in (0, 1)]
    assert said[0] == said[1], said
    if differ:
        assert "float32: at least 16 rows and tiles of 64 rows" in said[0]
    else:
        assert said[0] == "agree"


@pytest.mark.parametrize("shared", [True, False])
def test_resume_auto_takes_the_same_checkpoint_on_every_rank(tmp_path, shared) -> None:
    """--resume auto (issue 62): every rank lists checkpoints/ itself. Ranks that see the same newest
    checkpoint take it; ranks that see different ones (an --out-dir on each node's local disk) stop alike
    with one line naming both steps, rather than loading different steps."""
    workers.spawn("agreed_checkpoint_worker", tmp_path, shared)
    said = [(tmp_path / f"agreed{r}.txt").read_text() for r in (0, 1)]
    if shared:
        assert said == ["step_2", "step_2"], said
    else:
        assert said[0] == said[1] and "(step 2 on some, 1 on others; -1: none)" in said[0], said
