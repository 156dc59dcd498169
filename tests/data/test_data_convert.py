"""experiments/data/gsm8k.py and math.py on small fixture files; their output loads with rlcore.data."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.data import read_rows
from tests.data.conftest import FIXTURES

SCRIPTS = Path(__file__).parents[2] / "experiments" / "data"
GSM_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py
MATH_INSTRUCTION = (
    "Let's think step by step and output the final answer within \\boxed{}."  # verl's math_dataset.py
)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"convert_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gsm8k = load_script("gsm8k")
math_script = load_script("math")


def test_gsm8k_rows(tmp_path):
    out = tmp_path / "gsm8k" / "train.parquet"
    assert gsm8k.convert(FIXTURES / "gsm8k_sample.jsonl", out, split="train") == 3
    records = pq.read_table(out).to_pylist()
    question = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    assert records[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + GSM_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {
            "split": "train",
            "index": 0,
            "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
            "question": question,
        },
    }
    # thousands separators removed; negative answers kept; the blank line in the fixture is not a row
    assert [r["reward_model"]["ground_truth"] for r in records] == ["7", "2400", "-3"]
    assert [r["extra_info"]["index"] for r in records] == [0, 1, 2]
    rows = read_rows(out)
    assert [r.ground_truth for r in rows] == ["7", "2400", "-3"] and rows[2].data_source == "openai/gsm8k"


def test_gsm8k_bad_answer_names_the_line(tmp_path):
    src = tmp_path / "train.jsonl"
    good = orjson.dumps({"question": "q", "answer": "#### 1"})
    src.write_bytes(good + b"\n" + orjson.dumps({"question": "q", "answer": "no final answer"}) + b"\n")
    with pytest.raises(
        ValueError, match=r"train\.jsonl line 2: field 'answer' has no '#### <number>' final answer"
    ):
        gsm8k.convert(src, tmp_path / "out.parquet", split="train")
    src.write_bytes(orjson.dumps({"question": "q"}) + b"\n")
    with pytest.raises(ValueError, match=r"line 1: missing or non-string field 'answer'"):
        gsm8k.convert(src, tmp_path / "out.parquet", split="train")


def test_gsm8k_from_parquet_source(tmp_path):
    """The Hugging Face copy of GSM8K is parquet with the same two columns."""
    src = tmp_path / "test-00000-of-00001.parquet"
    lines = (FIXTURES / "gsm8k_sample.jsonl").read_bytes().splitlines()
    pq.write_table(pa.Table.from_pylist([orjson.loads(x) for x in lines if x.strip()]), src)
    gsm8k.main([str(src), str(tmp_path / "out.parquet")])
    rows = read_rows(tmp_path / "out.parquet")
    assert [r.ground_truth for r in rows] == ["7", "2400", "-3"]
    assert rows[0].extra_info["split"] == "test"  # default split: the file name up to '-'


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # nested braces balanced
        ("$\\boxed{2}$ then $\\boxed{5}$", "5"),  # the last box
        ("answer $\\boxed 5$.", "5"),  # '\boxed ' up to '$'
        ("$\\fbox{7}$", "7"),
        ("$\\boxed{x^{2}+1}$ and more text", "x^{2}+1"),
        ("no box here", None),
        ("$\\boxed{unclosed$", None),
    ],
)
def test_math_boxed_answer(solution, answer):
    assert math_script.boxed_answer(solution) == answer


def test_math_jsonl_rows(tmp_path):
    out = tmp_path / "math.parquet"
    assert math_script.convert(FIXTURES / "math_sample.jsonl", out, split="test") == 3
    records = pq.read_table(out).to_pylist()
    assert records[0] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [
            {"role": "user", "content": "What is $\\frac{2}{4}$ in lowest terms? " + MATH_INSTRUCTION}
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"split": "test", "index": 0, "level": "Level 1", "type": "Prealgebra"},
    }
    assert [r.ground_truth for r in read_rows(out)] == ["\\frac{1}{2}", "5", "5"]


def test_math_directory_tree(tmp_path):
    out = tmp_path / "train.parquet"
    assert math_script.convert(FIXTURES / "math_tree" / "train", out, split="train") == 2
    rows = read_rows(out)
    assert [r.ground_truth for r in rows] == ["3", "4"]  # algebra/1.json, geometry/2.json (sorted paths)
    assert [r.extra_info["type"] for r in rows] == ["Algebra", "Geometry"]


def test_math_missing_box_names_the_record(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(orjson.dumps({"problem": "p", "solution": "no box"}) + b"\n")
    with pytest.raises(
        ValueError, match=r"bad\.jsonl line 1: field 'solution' has no \\boxed\{\.\.\.\} answer"
    ):
        math_script.convert(src, tmp_path / "out.parquet", split="train")
    with pytest.raises(ValueError, match=r"nowhere\.jsonl: file not found"):
        math_script.convert(tmp_path / "nowhere.jsonl", tmp_path / "out.parquet", split="train")


def test_math_script_runs_from_the_command_line(tmp_path):
    """Run as a script, experiments/data is sys.path[0]; the file must not shadow the stdlib `math`."""
    out = tmp_path / "cli.parquet"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "math.py"), str(FIXTURES / "math_sample.jsonl"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote 3 rows to {out}" in result.stdout
    assert read_rows(out)[0].extra_info["split"] == "math_sample"
    bad = subprocess.run(
        [sys.executable, str(SCRIPTS / "math.py"), str(tmp_path / "none.jsonl"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stderr.strip().endswith("none.jsonl: file not found")
