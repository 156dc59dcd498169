"""Convert the MATH dataset (Hendrycks et al.) to rlcore / verl prompt rows (parquet).

Input: a local copy of a MATH split: the original tree of per-problem json files
(`train/algebra/1.json`, ... given as the directory), one such json file, a json array, a jsonl
file, or the parquet of the Hugging Face `DigitalLearningGmbH/MATH-lighteval` mirror. Each record
has `problem`, `solution` (with the answer in `\\boxed{...}`), `level` and `type`. Output: the rows
verl's `examples/data_preprocess/math_dataset.py` writes, so verl's MATH reward applies:

    data_source   "DigitalLearningGmbH/MATH-lighteval"
    prompt        [{"role": "user", "content": problem + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": <contents of the last \\boxed{...}>}
    extra_info    {"split", "index", "level", "type"}     (verl keeps split and index only)

Usage (from the repository root):

    python experiments/data/math.py ~/MATH/train data/math/train.parquet --split train
    python experiments/data/math.py ~/MATH/test data/math/test.parquet --split test
"""

# This file shares its name with the standard library's `math`: when it runs as a script its folder
# is sys.path[0], where `import math` (done by numpy, pyarrow, ...) would find this file. Drop it.
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import orjson  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from rlcore.data.answers import last_boxed  # noqa: E402  (verl's precedence: a `\\boxed ` wins)

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def strip_box(boxed: str) -> str | None:
    """The contents of `\\boxed{x}` / `\\fbox{x}` / `\\boxed x`; None for anything else."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    for left in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(left) and boxed.endswith("}"):
            return boxed[len(left) : -1]
    return None


def boxed_answer(solution: str) -> str | None:
    """The answer of a MATH solution: the contents of its last box; None when it has none."""
    boxed = last_boxed(solution)
    return None if boxed is None else strip_box(boxed)


def read_records(path: Path) -> list[tuple[str, Any]]:
    """(origin, record) pairs from a directory of json files, a json / jsonl file, or a parquet file."""
    if path.is_dir():
        files = sorted(path.rglob("*.json"))
        if not files:
            raise ValueError(f"{path}: no .json files in this directory")
        return [pair for f in files for pair in read_records(f)]
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    if path.suffix == ".parquet":
        try:
            return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: cannot read parquet file ({e})") from None
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None
        return (
            [(f"{path} row {i}", r) for i, r in enumerate(value)]
            if isinstance(value, list)
            else [(str(path), value)]
        )
    records = []
    for n, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            try:
                records.append((f"{path} line {n}", orjson.loads(line)))
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: invalid JSON ({e})") from None
    return records


def to_row(record: Any, *, split: str, index: int, origin: str) -> dict[str, Any]:
    """One MATH record as a verl prompt row."""
    for key in ("problem", "solution"):
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(f"{origin}: missing or non-string field {key!r}")
    answer = boxed_answer(record["solution"])
    if answer is None:
        raise ValueError(f"{origin}: field 'solution' has no \\boxed{{...}} answer")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": record["problem"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "level": record.get("level"),
            "type": record.get("type"),
        },
    }


def convert(source: Path, output: Path, *, split: str) -> int:
    """Write the rows of `source` to the parquet file `output`; return the number of rows."""
    records = read_records(source)
    if not records:
        raise ValueError(f"{source}: no records")
    rows = [to_row(r, split=split, index=i, origin=o) for i, (o, r) in enumerate(records)]
    output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output)
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="MATH split: directory of .json, .json, .jsonl or .parquet")
    parser.add_argument("output", type=Path, help="parquet file to write")
    parser.add_argument("--split", help="extra_info.split (default: the source name up to '-' or '.')")
    args = parser.parse_args(argv)
    split = args.split or args.source.name.split("-")[0].split(".")[0]
    try:
        n = convert(args.source, args.output, split=split)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {n} rows to {args.output}")


if __name__ == "__main__":
    main()
