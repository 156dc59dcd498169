"""What a user sees during a run (issue 18): the data report, samples.jsonl, the progress line."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import SMALL, ok, train


def gsm8k_rows(n_short: int, n_long: int) -> list[dict]:
    """verl's GSM8K row format; a long question is ~400 characters (tokens, with the char tokenizer)."""

    def row(i: int, question: str) -> dict:
        return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
                "extra_info": {"index": i}}  # fmt: skip

    short = [row(i, f"What is {i} + {i}?") for i in range(n_short)]
    return short + [row(100 + i, "A farmer counts sheep. " * 18) for i in range(n_long)]


def test_the_data_report_counts_the_prompts_dropped_for_length(tmp_path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(9, 3)), path)
    proc = train("grpo", *SMALL, "--trainer.steps", "1", "--trainer.val-every", "0", "--data.train-files",
                 str(path), "--data.val-files", str(path), "--data.max-prompt-length", "200", out=tmp_path / "run")  # fmt: skip
    ok(proc)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("data:")]
    assert len(lines) == 2 and all(
        f"{path}: 12 rows, 3 dropped as too long (max prompt length 200), longest kept" in x for x in lines
    ), lines
    assert lines[0].startswith("data: --data.train-files ") and lines[1].startswith("data: --data.val-files ")
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["data/train_dropped"] == 3.0 and first["data/val_dropped"] == 3.0
