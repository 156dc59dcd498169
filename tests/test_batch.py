"""Batch: construction checks, every operation, and the errors that name the offending field."""

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.batch import Batch


def make(n: int = 4, t: int = 3) -> Batch:
    """Rows are recognisable: input_ids row i is [10 i, 10 i + 1, ...], uid row i is 'u{i}'."""
    ids = torch.arange(n)[:, None] * 10 + torch.arange(t)[None, :]  # (n, t)
    return Batch.from_dict(
        {
            "input_ids": ids,
            "score": torch.arange(n, dtype=torch.float32),
            "uid": [f"u{i}" for i in range(n)],
            "extra": [{"i": i} for i in range(n)],
        },
        meta={"split": "train"},
    )


def rows_of(b: Batch) -> list[int]:
    """Original row numbers, read back from the uid strings."""
    return [int(u[1:]) for u in b["uid"]]


# -- construction --------------------------------------------------------------------------------


def test_from_dict_sorts_fields():
    b = make()
    assert set(b.tensors) == {"input_ids", "score"}
    assert set(b.non_tensors) == {"uid", "extra"}
    assert b.keys() == ("input_ids", "score", "uid", "extra")
    assert len(b) == 4 and "uid" in b and "input_ids" in b and "nope" not in b
    assert b.meta["split"] == "train"
    assert torch.equal(b["input_ids"][2], torch.tensor([20, 21, 22]))


def test_from_dict_numpy_and_tuple_become_lists():
    b = Batch.from_dict({"a": np.array(["x", "y"], dtype=object), "b": ("p", "q")})
    assert b["a"] == ["x", "y"] and b["b"] == ["p", "q"]


def test_empty_batch_has_length_zero():
    assert len(Batch()) == 0


def test_tensor_length_mismatch_names_both_fields():
    with pytest.raises(ValueError, match=r"'mask' has 3 rows but 'ids' has 4"):
        Batch.from_dict({"ids": torch.zeros(4, 2), "mask": torch.zeros(3, 2)})


def test_list_length_mismatch_names_both_fields():
    with pytest.raises(ValueError, match=r"'uid' has 2 rows but 'ids' has 4"):
        Batch(tensors={"ids": torch.zeros(4)}, non_tensors={"uid": ["a", "b"]})


def test_scalar_tensor_and_plain_value_rejected():
    with pytest.raises(ValueError, match="'x' is 0-dimensional"):
        Batch(tensors={"x": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'temp' is a float"):
        Batch.from_dict({"temp": 0.7})
    with pytest.raises(TypeError, match=r"'x' is a list, not a torch\.Tensor"):
        Batch(tensors={"x": [1, 2]})


def test_same_key_tensor_and_list_rejected():
    with pytest.raises(ValueError, match="'x' is both"):
        Batch(tensors={"x": torch.zeros(2)}, non_tensors={"x": [1, 2]})


def test_frozen_and_inputs_not_aliased():
    uid = ["a", "b"]
    fields = {"uid": uid}
    b = Batch.from_dict(fields)
    uid.append("c")
    fields["other"] = [1, 2]
    assert b["uid"] == ["a", "b"] and "other" not in b
    with pytest.raises(AttributeError):
        b.tensors = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        b.tensors["new"] = torch.zeros(2)  # type: ignore[index]


# -- field access and select / with_ --------------------------------------------------------------


def test_getitem_unknown_key():
    with pytest.raises(KeyError, match="no field 'nope'"):
        make()["nope"]


def test_select_keeps_only_named_fields_and_meta():
    b = make().select("input_ids", "uid")
    assert b.keys() == ("input_ids", "uid") and b.meta["split"] == "train"
    with pytest.raises(KeyError, match="no field 'missing'"):
        make().select("uid", "missing")


def test_with_adds_fields_without_mutating():
    b = make()
    c = b.with_(responses=torch.ones(4, 2), reward=[1.0, 0.0, 1.0, 0.0])
    assert "responses" in c and c["reward"] == [1.0, 0.0, 1.0, 0.0]
    assert "responses" not in b and "reward" not in b


def test_with_other_batch_union():
    b = make()
    other = Batch.from_dict({"values": torch.zeros(4, 3)}, meta={"step": 1})
    c = b.with_(other, adv=torch.ones(4))
    assert set(c.keys()) == {"input_ids", "score", "uid", "extra", "values", "adv"}
    assert c.meta == {"split": "train", "step": 1}


def test_with_refuses_existing_key_unless_overwrite():
    b = make()
    with pytest.raises(ValueError, match="field 'score' already exists"):
        b.with_(score=torch.zeros(4))
    with pytest.raises(ValueError, match="field 'uid' already exists"):
        b.with_(Batch.from_dict({"uid": list("abcd")}))
    c = b.with_(score=torch.zeros(4), overwrite=True)
    assert torch.equal(c["score"], torch.zeros(4)) and torch.equal(b["score"], torch.arange(4.0))


def test_with_overwrite_can_change_kind():
    c = make().with_(score=["a", "b", "c", "d"], overwrite=True)
    assert "score" in c.non_tensors and "score" not in c.tensors


def test_with_length_mismatch():
    with pytest.raises(ValueError, match=r"'x' has 3 rows"):
        make().with_(x=torch.zeros(3))


def test_with_meta_conflict():
    b = make()
    with pytest.raises(ValueError, match="meta 'split'"):
        b.with_(Batch(meta={"split": "val"}))
    assert b.with_(Batch(meta={"split": "train"})).meta["split"] == "train"  # same value is fine
    assert b.with_meta(split="val").meta["split"] == "val" and b.meta["split"] == "train"


# -- row indexing ---------------------------------------------------------------------------------


def test_slice_rows():
    b = make(5)[1:4]
    assert len(b) == 3 and rows_of(b) == [1, 2, 3]
    assert torch.equal(b["input_ids"][:, 0], torch.tensor([10, 20, 30]))
    assert b["extra"] == [{"i": 1}, {"i": 2}, {"i": 3}]
    assert rows_of(make(6)[::2]) == [0, 2, 4]


@pytest.mark.parametrize(
    "index",
    [torch.tensor([3, 0, 3]), [3, 0, 3], torch.tensor([-1, 0, -1]), np.array([3, 0, 3])],
    ids=["tensor", "list", "negative", "numpy"],
)
def test_integer_row_index(index):
    b = make(4)[index]
    assert rows_of(b) == [3, 0, 3]
    assert torch.equal(b["score"], torch.tensor([3.0, 0.0, 3.0]))


def test_bool_row_mask():
    b = make(4)
    for mask in (torch.tensor([True, False, True, False]), [True, False, True, False]):
        assert rows_of(b[mask]) == [0, 2]
    with pytest.raises(ValueError, match="mask has 3 entries but the batch has 4"):
        b[torch.tensor([True, False, True])]


def test_bad_row_indices():
    b = make(4)
    with pytest.raises(IndexError, match="out of range for 4 rows"):
        b[[0, 4]]
    with pytest.raises(ValueError, match="integers or bools"):
        b[torch.tensor([0.0, 1.0])]
    with pytest.raises(TypeError, match="slice"):
        b[1]
    assert len(b[[]]) == 0 and b[[]].keys() == b.keys()


# -- split / chunk / concat -----------------------------------------------------------------------


def test_split_and_chunk():
    b = make(5)
    assert [rows_of(p) for p in b.split(2)] == [[0, 1], [2, 3], [4]]
    assert [rows_of(p) for p in make(6).chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match=r"chunk\(2\): 5 rows"):
        b.chunk(2)
    with pytest.raises(ValueError, match="size must be >= 1"):
        b.split(0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), size=st.integers(1, 13))
def test_split_then_concat_is_identity(n, size):
    b = make(n)
    c = Batch.concat(b.split(size))
    assert torch.equal(c["input_ids"], b["input_ids"]) and c["uid"] == b["uid"] and c["extra"] == b["extra"]
    assert c.meta == b.meta


def test_concat_requires_same_keys():
    a, b = make(2), make(3)
    with pytest.raises(ValueError, match="field 'uid' is in batch 0 but missing from batch 1"):
        Batch.concat([a, b.select("input_ids", "score", "extra")])
    with pytest.raises(ValueError, match="field 'new' is in batch 1 but missing from batch 0"):
        Batch.concat([a, b.with_(new=[0, 0, 0])])
    with pytest.raises(ValueError, match="no batches"):
        Batch.concat([])


def test_concat_dtype_surprise_names_key():
    a = Batch.from_dict({"x": torch.zeros(2, dtype=torch.int64)})
    b = Batch.from_dict({"x": torch.zeros(2, dtype=torch.float32)})
    with pytest.raises(ValueError, match=r"'x' is torch.int64 in batch 0 but torch.float32 in batch 1"):
        Batch.concat([a, b])


def test_concat_shape_and_kind_mismatch():
    a = Batch.from_dict({"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"'x' has row shape \(3,\) in batch 0 but \(5,\) in batch 1"):
        Batch.concat([a, Batch.from_dict({"x": torch.zeros(2, 5)})])
    with pytest.raises(ValueError, match="'x' is a tensor in batch 0 but a list in batch 1"):
        Batch.concat([a, Batch.from_dict({"x": [1, 2]})])


def test_concat_meta_conflict():
    a = Batch.from_dict({"x": [1]}, meta={"k": 1})
    with pytest.raises(ValueError, match="meta 'k' differs"):
        Batch.concat([a, Batch.from_dict({"x": [2]}, meta={"k": 2})])


# -- repeat_interleave / to -----------------------------------------------------------------------


def test_repeat_interleave_keeps_uid_per_prompt():
    b = make(3).repeat_interleave(2)
    assert b["uid"] == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert torch.equal(b["score"], torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]))
    assert torch.equal(b["input_ids"][1], torch.tensor([0, 1, 2]))  # row 1 is the second copy of prompt 0
    assert torch.equal(b["input_ids"][2], torch.tensor([10, 11, 12]))
    with pytest.raises(ValueError, match="n must be >= 1"):
        b.repeat_interleave(0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(1, 5))
def test_repeat_interleave_rows_match_their_prompt(n, k):
    b = make(n)
    r = b.repeat_interleave(k)
    assert len(r) == n * k
    for j in range(n * k):  # row j is a copy of prompt j // k, in every field
        assert r["uid"][j] == b["uid"][j // k]
        assert torch.equal(r["input_ids"][j], b["input_ids"][j // k])


def test_to_device_moves_tensors_only():
    b = make().to(torch.device("meta"))
    assert b["input_ids"].device.type == "meta" and b["uid"] == make()["uid"]
    assert b.meta["split"] == "train"


def test_repr_mentions_shapes():
    assert "input_ids: (4, 3) int64" in repr(make())


def test_pickle_and_deepcopy_round_trip():
    b = make()
    for c in (pickle.loads(pickle.dumps(b)), copy.deepcopy(b)):
        assert c.keys() == b.keys() and c.meta == b.meta and c["extra"] == b["extra"]
        assert torch.equal(c["input_ids"], b["input_ids"])
