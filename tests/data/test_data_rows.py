"""Reading verl-format rows: parquet / jsonl round trips, and one clear line per malformed input."""

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.data import DataError, Row, read_rows, row_from_dict
from tests.data.conftest import FIXTURES

GSM_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "1+2=?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "3"},
    "extra_info": {"split": "train", "index": 0},
}


def write_jsonl(path, records):
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in records) + b"\n")
    return path


def test_jsonl_fixture_rows():
    rows = read_rows(FIXTURES / "rows.jsonl")
    origin = f"{FIXTURES / 'rows.jsonl'}"
    assert rows[0] == Row(
        data_source="openai/gsm8k",
        prompt=[{"role": "user", "content": "1+2=?"}],
        ground_truth="3",
        extra_info={"split": "train", "index": 0},
        ability="math",
        origin=f"{origin} line 1",
    )
    assert rows[1] == Row(
        data_source="custom", prompt="Say hi", ground_truth=["hi", "hello"], origin=f"{origin} line 2"
    )
    assert rows[2].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "9-4=?"},
    ]


def test_parquet_round_trip_matches_jsonl(tmp_path):
    """Rows written as parquet by pyarrow (nested structs, as verl's preprocess scripts write) read back equal."""
    records = [orjson.loads(line) for line in (FIXTURES / "rows.jsonl").read_bytes().splitlines()]
    chat = [records[0], records[2]]  # a parquet column holds one type: the list-of-messages prompts
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    from_parquet = read_rows(tmp_path / "chat.parquet")
    from_jsonl = read_rows(write_jsonl(tmp_path / "chat.jsonl", chat))
    strip = [(r.data_source, r.prompt, r.ground_truth, r.extra_info, r.ability) for r in from_jsonl]
    assert [(r.data_source, r.prompt, r.ground_truth, r.extra_info, r.ability) for r in from_parquet] == strip
    assert [r.origin for r in from_parquet] == [f"{tmp_path / 'chat.parquet'} row {i}" for i in (0, 1)]


def test_parquet_string_prompts_and_null_struct_fields(tmp_path):
    """Struct columns unify keys across rows (absent -> null); null message keys are dropped."""
    table = pa.Table.from_pylist(
        [
            {"data_source": "a", "prompt": "p0", "extra_info": {"index": 0}},
            {"data_source": "b", "prompt": "p1", "extra_info": {"index": 1, "tag": "x"}},
        ]
    )
    pq.write_table(table, tmp_path / "s.parquet")
    rows = read_rows(tmp_path / "s.parquet")
    assert [r.prompt for r in rows] == ["p0", "p1"]
    assert rows[0].extra_info == {"index": 0, "tag": None} and rows[1].extra_info == {"index": 1, "tag": "x"}
    assert rows[0].ground_truth is None
    msgs = [{"role": "user", "content": "x", "name": None}]
    assert row_from_dict({"data_source": "a", "prompt": msgs}, "here").prompt == [
        {"role": "user", "content": "x"}
    ]


def test_many_files_keep_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [GSM_ROW | {"data_source": "a"}])
    b = tmp_path / "b.json"
    b.write_bytes(orjson.dumps([GSM_ROW | {"data_source": "b0"}, GSM_ROW | {"data_source": "b1"}]))
    rows = read_rows([a, str(b), a])
    assert [r.data_source for r in rows] == ["a", "b0", "b1", "a"]
    assert rows[1].origin == f"{b} row 0"


MALFORMED = [
    ({"prompt": [{"role": "user", "content": "x"}]}, r"line 1: missing field 'data_source'$"),
    ({"data_source": 3, "prompt": "x"}, r"line 1: field 'data_source' is an int, expected str$"),
    ({"data_source": "d"}, r"line 1: missing field 'prompt'$"),
    ({"data_source": "d", "prompt": None}, r"line 1: missing field 'prompt'$"),
    (
        {"data_source": "d", "prompt": 7},
        r"line 1: field 'prompt' is an int, expected a list of messages or a string$",
    ),
    ({"data_source": "d", "prompt": ""}, r"line 1: field 'prompt' is an empty string$"),
    ({"data_source": "d", "prompt": []}, r"line 1: field 'prompt' is an empty list of messages$"),
    (
        {"data_source": "d", "prompt": ["hi"]},
        r"line 1: field 'prompt\[0\]' is a string, expected a message object$",
    ),
    ({"data_source": "d", "prompt": [{"content": "x"}]}, r"line 1: field 'prompt\[0\]' has no 'role'$"),
    (
        {"data_source": "d", "prompt": [{"role": "user", "content": "a"}, {"role": "user"}]},
        r"line 1: field 'prompt\[1\]' has no 'content'$",
    ),
    (
        {"data_source": "d", "prompt": [{"role": "user", "content": ["a"]}]},
        r"line 1: field 'prompt\[0\]\.content' is a list, expected str$",
    ),
    (
        {"data_source": "d", "prompt": "x", "reward_model": "3"},
        r"field 'reward_model' is a string, expected an object$",
    ),
    (
        {"data_source": "d", "prompt": "x", "extra_info": [1]},
        r"field 'extra_info' is a list, expected an object$",
    ),
    ({"data_source": "d", "prompt": "x", "ability": 1}, r"field 'ability' is an int, expected str$"),
    (["not", "a", "row"], r"line 1: row is a list, expected an object with a 'prompt' field$"),
]


@pytest.mark.parametrize(("record", "message"), MALFORMED)
def test_malformed_row_is_one_line_naming_file_row_field(tmp_path, record, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(DataError, match=message) as e:
        read_rows(path)
    assert str(e.value).startswith(f"{path} line 1: ") and "\n" not in str(e.value)


def test_error_names_the_right_row(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GSM_ROW, GSM_ROW, {"data_source": "d"}])
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: missing field 'prompt'$"):
        read_rows(path)
    pq.write_table(pa.Table.from_pylist([GSM_ROW, GSM_ROW | {"prompt": None}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet row 1: missing field 'prompt'$"):
        read_rows(tmp_path / "bad.parquet")


def test_parquet_without_prompt_column(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"data_source": "d", "question": "q"}]), tmp_path / "q.parquet")
    with pytest.raises(DataError, match=r"q\.parquet row 0: missing field 'prompt'$"):
        read_rows(tmp_path / "q.parquet")


def test_file_level_errors(tmp_path):
    cases = []
    cases.append((tmp_path / "missing.parquet", r"missing\.parquet: file not found$"))
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    cases.append((tmp_path / "corrupt.parquet", r"corrupt\.parquet: cannot read parquet file \(.+\)$"))
    (tmp_path / "broken.jsonl").write_bytes(orjson.dumps(GSM_ROW) + b"\n{oops\n")
    cases.append((tmp_path / "broken.jsonl", r"broken\.jsonl line 2: invalid JSON \(.+\)$"))
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    cases.append((tmp_path / "binary.jsonl", r"binary\.jsonl line 1: invalid JSON"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    cases.append((tmp_path / "rows.csv", r"rows\.csv: unsupported file type '\.csv'"))
    cases.append((tmp_path, r": is a directory"))
    for path, message in cases:
        with pytest.raises(DataError, match=message) as e:
            read_rows([path])
        assert "\n" not in str(e.value), path
    with pytest.raises(DataError, match="no data files given"):
        read_rows([])


def test_blank_lines_are_not_rows(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_bytes(b"\n" + orjson.dumps(GSM_ROW) + b"\n\n  \n" + orjson.dumps(GSM_ROW) + b"\n")
    assert [r.origin.rsplit(" ", 1)[1] for r in read_rows(path)] == ["2", "5"]  # line numbers as in an editor
