"""Forward layouts as values (`rlcore.models.layouts`): which positions each layout reads, by hand; the
adapters table; and the router tap living on its model, not in a module-level table."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch

from rlcore.models import layouts
from rlcore.models.forward import ModelInputs
from rlcore.models.layouts import Packed, Rows, adapted, layout_of
from rlcore.models.moe import router_tap
from tests.models.test_moe import family_model


def _rows(m: int, s: int, r: int) -> ModelInputs:
    ids = torch.arange(m * s).view(m, s)
    return ModelInputs(input_ids=ids, attention_mask=torch.ones(m, s, dtype=torch.long),
                       position_ids=torch.arange(s).expand(m, s), labels=ids[:, s - r :])  # fmt: skip


def test_rows_read_the_r_positions_before_each_response_token_by_hand() -> None:
    inputs = _rows(2, 6, 3)  # [p p p | r r r]: positions 2, 3, 4 predict the response
    layout = layout_of(torch.nn.Identity(), inputs)
    assert isinstance(layout, Rows) and layout.feed(torch.nn.Identity()).keep == 4
    out = torch.arange(12.0).view(2, 6)  # a critic's values at every position
    assert layout.per_token(out, lambda v, _: v).tolist() == [[2.0, 3.0, 4.0], [8.0, 9.0, 10.0]]
    kept = out[:, 2:]  # an actor's logits with logits_to_keep = r + 1: the same positions
    assert layout.per_token(kept, lambda v, _: v).tolist() == [[2.0, 3.0, 4.0], [8.0, 9.0, 10.0]]
    labels = layout.per_token(out, lambda _, labels: labels)
    assert torch.equal(labels, inputs.labels)


def test_packed_reads_the_gathered_positions_of_the_kept_tail_by_hand() -> None:
    ids = torch.arange(10).view(1, 10)  # one packed row: [prompt | response a | response b]
    gather = torch.tensor([[1, 2], [4, 5]])  # flat indices into the kept 6 positions
    inputs = ModelInputs(input_ids=ids, attention_mask=torch.ones(1, 1, 10, 10, dtype=torch.bool),
                         position_ids=ids, labels=torch.zeros(2, 2, dtype=torch.long), gather=gather, keep=6)  # fmt: skip
    layout = layout_of(torch.nn.Identity(), inputs)
    assert isinstance(layout, Packed) and inputs.packed
    out = torch.arange(10.0).view(1, 10, 1) * torch.ones(1, 1, 3)  # (G, L, v): position i holds i
    picked = layout.per_token(out, lambda z, _: z)  # (m, r, v)
    assert picked[..., 0].tolist() == [[5.0, 6.0], [8.0, 9.0]]  # kept = positions 4..9


def test_a_layouts_routes_are_replayed_and_a_new_adapter_is_one_table_row(monkeypatch) -> None:
    model = family_model("qwen3_moe")
    inputs = _rows(1, 4, 2)
    routes = torch.zeros(4, 2, 2, dtype=torch.long)
    inputs = ModelInputs(**{f: getattr(inputs, f) for f in ("input_ids", "attention_mask", "position_ids", "labels")},
                         routes=routes)  # fmt: skip
    seen = []

    @contextlib.contextmanager
    def extra(model, layout):
        seen.append(layout)
        yield {"marker": torch.ones(1)}

    monkeypatch.setattr(layouts, "ADAPTERS", (*layouts.ADAPTERS, extra))
    layout = layout_of(model, inputs)
    with adapted(model, layout) as keywords:
        assert router_tap(model).replay is routes  # the MoE adapter set the layout's routes
        assert set(keywords) == {"marker"}  # a text model's images adapter adds nothing
    assert seen == [layout]


def test_the_router_tap_is_the_models_own_and_goes_with_it() -> None:
    model, other = family_model("qwen3_moe"), family_model("qwen3_moe")
    tap = router_tap(model)
    assert tap is router_tap(model) and tap is not router_tap(other)  # made once, one per model
    assert router_tap(torch.nn.Linear(2, 2)) is None  # a dense model has none
    gone = weakref.ref(tap)
    del model, tap
    gc.collect()
    assert gone() is None  # nothing outside the model keeps it (no module-level table)
