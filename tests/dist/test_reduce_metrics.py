"""reduce_metrics on 2 gloo ranks: the logged metrics are the global ones, identical on every rank."""

from __future__ import annotations

import json

from tests.dist import workers


def test_metrics_are_reduced_as_named_over_ranks(tmp_path) -> None:
    workers.spawn("reduce_metrics_worker", tmp_path)
    got = [json.loads((tmp_path / f"reduced{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]
    # rank 0: a 1, b_max 0, c/min 5, d/max -1, only_rank0 7; rank 1: a 2, b_max 10, c/min 4, d/max -2
    assert got[0] == {"a": 1.5, "b_max": 10.0, "c/min": 4.0, "d/max": -1.0, "only_rank0": 7.0}
