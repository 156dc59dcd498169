"""PromptDataset: seeded per-epoch shuffle, cursor resume, overlong filtering, empty datasets."""

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.data import Cursor, DataError, PromptDataset, Row, epoch_seed


def rows(n: int) -> list[Row]:
    """Row i has content 'q{i}' and ground truth i, so a batch says which rows it holds."""
    return [Row("d", [{"role": "user", "content": f"q{i}"}], ground_truth=i) for i in range(n)]


def seen(batch) -> list[int]:
    return list(batch["ground_truth"])


@pytest.fixture(scope="module")
def dataset(chat_tokenizer):
    return PromptDataset(rows(7), chat_tokenizer, seed=5)


def test_each_epoch_is_a_seeded_permutation(dataset, chat_tokenizer):
    for epoch in range(3):
        generator = torch.Generator().manual_seed(epoch_seed(5, epoch))
        assert dataset.order(epoch) == torch.randperm(7, generator=generator).tolist()
    assert sorted(dataset.order(0)) == list(range(7))
    assert dataset.order(0) != dataset.order(1)  # a fresh shuffle each epoch
    assert PromptDataset(rows(7), chat_tokenizer, seed=6).order(0) != dataset.order(0)
    assert PromptDataset(rows(7), chat_tokenizer, seed=5, shuffle=False).order(3) == list(range(7))


def test_take_spans_epochs_without_skipping(dataset):
    batch, cursor = dataset.take(Cursor(), 10)  # 7 rows of epoch 0, then 3 of epoch 1
    assert seen(batch) == dataset.order(0) + dataset.order(1)[:3]
    assert cursor == Cursor(epoch=1, position=3)
    assert batch["uid"][6:8] == ["e0.6", "e1.0"] and len(set(batch["uid"])) == 10
    big, cursor = dataset.take(Cursor(), 15)  # more than two epochs in one batch
    assert seen(big) == dataset.order(0) + dataset.order(1) + dataset.order(2)[:1]
    assert cursor == Cursor(2, 1)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        dataset.take(Cursor(), 0)


def test_resume_yields_exactly_the_uninterrupted_rows(chat_tokenizer):
    straight = PromptDataset(rows(7), chat_tokenizer, seed=1)
    expected = [straight.next_batch(3) for _ in range(6)]  # 18 rows: crosses two epoch boundaries

    first = PromptDataset(rows(7), chat_tokenizer, seed=1)
    got = [first.next_batch(3) for _ in range(2)]
    state = orjson.loads(orjson.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptDataset(rows(7), chat_tokenizer, seed=1)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(3) for _ in range(4)]

    for a, b in zip(got, expected, strict=True):
        assert seen(a) == seen(b) and a["uid"] == b["uid"]
        assert torch.equal(a["input_ids"], b["input_ids"])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), batch_size=st.integers(1, 11), stop=st.integers(0, 6), total=st.integers(1, 8))
def test_resume_property(chat_tokenizer, n, batch_size, stop, total):
    data = PromptDataset(rows(n), chat_tokenizer, seed=n)
    cursor, expected = Cursor(), []
    for _ in range(total):
        batch, cursor = data.take(cursor, batch_size)
        expected += seen(batch)
    current, got = PromptDataset(rows(n), chat_tokenizer, seed=n), []
    for step in range(total):
        if step == stop:  # save, then continue in a new dataset restored from the state dict
            fresh = PromptDataset(rows(n), chat_tokenizer, seed=n)
            fresh.load_state_dict(current.state_dict())
            current = fresh
        got += seen(current.next_batch(batch_size))
    assert got == expected
    # and the rows of every complete epoch are each row exactly once
    for e in range(len(expected) // n):
        assert sorted(expected[e * n : (e + 1) * n]) == list(range(n))


def test_state_dict_mismatch_refused(dataset, chat_tokenizer):
    state = dataset.state_dict()
    assert set(state) == {"epoch", "position", "seed", "num_rows"}
    with pytest.raises(ValueError, match="saved data state has seed=5 but this dataset has 6"):
        PromptDataset(rows(7), chat_tokenizer, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="saved data state has num_rows=7 but this dataset has 8"):
        PromptDataset(rows(8), chat_tokenizer, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptDataset(rows(7), chat_tokenizer, seed=5).load_state_dict(state | {"position": 8})


def test_iter_batches_one_ordered_pass(dataset):
    batches = list(dataset.iter_batches(3))
    assert [seen(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert batches[2]["uid"] == ["r6"]


def test_overlong_drop_and_count(chat_tokenizer):
    # rendered length = len("q{i}") + 4: rows 0-9 are 6 tokens, rows 10-11 are 7
    data = PromptDataset(rows(12), chat_tokenizer, max_prompt_length=6, overlong="drop")
    assert len(data) == 10 and data.n_dropped == 2
    assert sorted(seen(data.take(Cursor(), 10)[0])) == list(range(10))


def test_overlong_error(tmp_path, chat_tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps({"data_source": "d", "prompt": "x" * k}) for k in (1, 9)))
    with pytest.raises(
        DataError, match=r"long\.jsonl line 2: field 'prompt' is 13 tokens, longer than max_prompt_length=12"
    ):
        PromptDataset.from_files([path], chat_tokenizer, max_prompt_length=12, overlong="error")


def test_empty_after_filtering_and_empty_files(tmp_path, chat_tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_bytes(orjson.dumps({"data_source": "d", "prompt": "long prompt"}) + b"\n")
    with pytest.raises(
        DataError,
        match=r"train\.jsonl: no rows left after dropping 1 prompts longer than max_prompt_length=3$",
    ):
        PromptDataset.from_files(str(path), chat_tokenizer, max_prompt_length=3, overlong="drop")
    (tmp_path / "empty.jsonl").write_bytes(b"\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no rows$"):
        PromptDataset.from_files([tmp_path / "empty.jsonl"], chat_tokenizer)


def test_report_counts_drops_and_prompt_length_percentiles(chat_tokenizer):
    """Prompt content 'x' * k renders to k + 4 tokens: lengths 5..24, the 4 over 20 dropped."""
    rows = [Row("d", [{"role": "user", "content": "x" * k}]) for k in range(20, 0, -1)]
    data = PromptDataset(rows, chat_tokenizer, max_prompt_length=20, overlong="drop")
    assert data.n_dropped == 4 and data.dropped_lengths == [24, 23, 22, 21]
    # nearest rank over all 20 rows read: p50 = 10th value (14), p90 = 18th (22), p99 = 20th (24)
    assert data.report() == (
        "20 rows, 4 dropped as too long (max prompt length 20), longest kept 20 tokens, longest dropped 24; "
        "prompt tokens p50 14, p90 22, p99 24, max 24"
    )
    kept = PromptDataset(rows[4:], chat_tokenizer)
    assert kept.report() == "16 rows, 0 dropped as too long; prompt tokens p50 12, p90 19, p99 20, max 20"
