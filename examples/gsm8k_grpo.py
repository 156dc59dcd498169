"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct: GSM8K's parquet files to verl's row format, then train.py.

    hf download openai/gsm8k --repo-type dataset --local-dir data/gsm8k   # main/{train,test}-*.parquet
    .venv/bin/python examples/gsm8k_grpo.py --gsm8k data/gsm8k/main                   # convert, then train
    .venv/bin/python examples/gsm8k_grpo.py --gsm8k data/gsm8k/main --convert-only    # only write the rows
    .venv/bin/python examples/gsm8k_grpo.py --gsm8k data/gsm8k/main -- --rollout.engine vllm --trainer.steps 100

GSM8K's files hold `question` and `answer` (a worked solution ending in `#### 72`). Each becomes the row
verl's examples/data_preprocess/gsm8k.py writes: data_source `openai/gsm8k` (scored by rlcore's built-in
GSM8K reward, verl's strict `#### n` rule), the question plus verl's instruction as the user turn, and the
number after `####` (commas dropped) as the ground truth; written to --out/train.parquet and
--out/test.parquet. Then `train.py grpo --model.path Qwen/Qwen2.5-0.5B-Instruct` on them, with 512
response tokens and 8 reward processes; flags after `--` go to train.py and win. A hub id is downloaded
on first use (HF_HUB_OFFLINE=1 reads only the cache); the learning rate defaults to 1e-6, a pretrained
model's default. One GPU runs it as is (a CPU too, slowly); 8 GPUs: examples/torchrun_8gpu.sh.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""verl's instruction after each question (examples/data_preprocess/gsm8k.py)."""


def solution(answer: str) -> str:
    """The number after `####` in a GSM8K answer, commas dropped (`#### 1,234` -> `1234`)."""
    found = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if found is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def convert(source: Path, target: Path, split: str) -> int:
    """GSM8K's `question`/`answer` parquet `source` as verl's rows in `target`; the number of rows."""
    table = pq.read_table(source, columns=["question", "answer"]).to_pylist()
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution(r["answer"])},
            "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]},
        }
        for i, r in enumerate(table)
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), target)
    return len(rows)


def find(directory: Path, split: str) -> Path:
    """GSM8K's file of `split` in `directory` (the hub's `train-00000-of-00001.parquet`, or `train.parquet`)."""
    found = sorted(directory.glob(f"{split}*.parquet"))
    if not found:
        raise SystemExit(
            f"no {split}*.parquet in {directory} (download openai/gsm8k first: see the docstring)"
        )
    return found[0]


def command(train: Path, test: Path, extra: list[str]) -> list[str]:
    """The train.py command line: GRPO, the model, the rows, 512 tokens, 8 reward processes, then `extra`."""
    return [
        sys.executable, str(ROOT / "train.py"), "grpo", "--model.path", MODEL,
        "--data.train-files", str(train), "--data.val-files", str(test),
        "--rollout.max-tokens", "512", "--reward.num-workers", "8", *extra,
    ]  # fmt: skip


def main() -> None:
    args, extra = sys.argv[1:], []
    if "--" in args:
        args, extra = args[: args.index("--")], args[args.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", type=Path, required=True, help="the folder of GSM8K's train/test parquet")
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k_rows"), help="where the rows go")
    parser.add_argument("--convert-only", action="store_true", help="write the rows, do not train")
    ns = parser.parse_args(args)
    rows = {}
    for split in ("train", "test"):
        rows[split] = ns.out / f"{split}.parquet"
        n = convert(find(ns.gsm8k, split), rows[split], split)
        print(f"{rows[split]}: {n} rows", file=sys.stderr)
    if ns.convert_only:
        return
    cmd = command(rows["train"], rows["test"], extra)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
