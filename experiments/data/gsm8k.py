"""Convert GSM8K to rlcore / verl prompt rows (parquet).

Input: a local copy of the public GSM8K split, either the jsonl of openai/grade-school-math
(`{"question": ..., "answer": "...#### 42"}` per line) or the parquet of the Hugging Face
`openai/gsm8k` dataset (same columns). Output: one parquet file with the rows verl's
`examples/data_preprocess/gsm8k.py` writes, so verl's GSM8K reward (`data_source` "openai/gsm8k")
and rlcore's both apply:

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "42"}     (the number after "####", commas removed)
    extra_info    {"split", "index", "answer", "question"}

Usage (from the repository root):

    python experiments/data/gsm8k.py ~/gsm8k/train.jsonl data/gsm8k/train.parquet
    python experiments/data/gsm8k.py ~/gsm8k/test.jsonl data/gsm8k/test.parquet --split test
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def final_answer(answer: str) -> str | None:
    """The number after the first `#### `, without thousands separators; None if there is none."""
    match = FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def read_records(path: Path) -> list[tuple[str, Any]]:
    """(origin, record) pairs of a jsonl or parquet file; origin names the file and line / row."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    if path.suffix == ".parquet":
        try:
            return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: cannot read parquet file ({e})") from None
    records = []
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if line.strip():
            try:
                records.append((f"{path} line {n}", orjson.loads(line)))
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: invalid JSON ({e})") from None
    return records


def to_row(record: Any, *, split: str, index: int, origin: str) -> dict[str, Any]:
    """One GSM8K record as a verl prompt row."""
    for key in ("question", "answer"):
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(f"{origin}: missing or non-string field {key!r}")
    solution = final_answer(record["answer"])
    if solution is None:
        raise ValueError(f"{origin}: field 'answer' has no '#### <number>' final answer")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": record["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": record["answer"],
            "question": record["question"],
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
    parser.add_argument("source", type=Path, help="GSM8K split as .jsonl or .parquet")
    parser.add_argument("output", type=Path, help="parquet file to write")
    parser.add_argument("--split", help="extra_info.split (default: the source file name up to '-' or '.')")
    args = parser.parse_args(argv)
    split = args.split or args.source.name.split("-")[0].split(".")[0]
    try:
        n = convert(args.source, args.output, split=split)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {n} rows to {args.output}")


if __name__ == "__main__":
    main()
