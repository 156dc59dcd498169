r"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct: download GSM8K, convert it to verl's rows, train.
Not yet run on a GPU, nor anywhere beyond its conversion step (below).

    .venv/bin/python examples/gsm8k_grpo.py

That one command does three things, from the repository root:
1. downloads GSM8K (`openai/gsm8k`, its `main` parquet files) from the Hugging Face hub into data/gsm8k
   with huggingface_hub's `snapshot_download`, the call behind
   `hf download openai/gsm8k --repo-type dataset --local-dir data/gsm8k`;
2. writes verl's rows to data/gsm8k_rows/train.parquet and data/gsm8k_rows/test.parquet;
3. runs (and prints) this train.py command, whose flags are the defaults of this recipe:

    python train.py grpo --model.path Qwen/Qwen2.5-0.5B-Instruct \
        --data.train-files data/gsm8k_rows/train.parquet --data.val-files data/gsm8k_rows/test.parquet \
        --rollout.max-tokens 512 --reward.num-workers 8 \
        --trainer.steps 300 --trainer.val-every 25 --trainer.save-every 50 --out-dir runs/gsm8k

Other forms:

    .venv/bin/python examples/gsm8k_grpo.py --gsm8k data/gsm8k/main --convert-only  # files on disk, rows only
    .venv/bin/python examples/gsm8k_grpo.py --model /models/Qwen2.5-0.5B-Instruct    # a local copy
    .venv/bin/python examples/gsm8k_grpo.py -- --rollout.engine vllm --trainer.steps 100  # to train.py

GSM8K's files hold `question` and `answer` (a worked solution ending in `#### 72`). Each becomes the row
verl's examples/data_preprocess/gsm8k.py writes: data_source `openai/gsm8k` (scored by rlcore's built-in
GSM8K reward, verl's strict `#### n` rule), the question plus verl's instruction as the user turn, and the
number after `####` (commas dropped) as the ground truth. --gsm8k reads a folder that already holds
GSM8K's train and test parquet files instead of downloading. Flags after `--` go to train.py and win. The
hub id is downloaded on first use (HF_HUB_OFFLINE=1 reads only the cache); the learning rate is 1e-6, a
pretrained model's default; rerunning the command resumes from the last checkpoint in runs/gsm8k (one
every 50 steps). 8 GPUs: examples/torchrun_8gpu.sh.

This recipe has not been run on a GPU, nor anywhere else beyond its conversion step: tests/test_docs.py
converts two GSM8K-shaped rows, reads them back, scores them and parses the train.py command line. The
download and the training are not tested.

Memory, an estimate (not measured): Qwen2.5-0.5B has 494,032,768 parameters; full fine-tuning in fp32 with
AdamW holds 16 bytes per parameter (weights, gradients, two moments), 7.4 GiB. `rlcore.models.footprint`,
the estimate rlcore checks CPU runs with, gives for this run's shape (32 prompts x 8 samples, each rollout
row at its longest, 512 prompt + 512 response tokens; update micro-batches of 511 tokens, the CPU's budget; a GPU's is 25% of its free memory) about 13.4 GiB of
tensors at the peak: the weights and moments, 5.5 GiB, throughout; in the rollout an engine copy of the
weights (1.8 GiB) and a KV cache of up to 6.0 GiB; in the update the gradients and activations (3.8 GiB).
CUDA's context and cached blocks come on top, so one GPU of 24 GB or more.

What to expect: verl's algorithm baselines
(https://github.com/volcengine/verl/blob/main/docs/algo/baseline.md) give Qwen2.5-0.5B-Instruct a GSM8K
test score of 36.4 as released (taken from the Qwen2.5 blog), 56.7 after verl's PPO, 54.3 after its GRPO
with LoRA rank 32, and 58.7 after PRIME. These are verl's runs, with their own batch sizes and lengths,
not runs of this script.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DATASET, DOWNLOAD = "openai/gsm8k", Path("data/gsm8k")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""verl's instruction after each question (examples/data_preprocess/gsm8k.py)."""
DEFAULTS = [
    "--rollout.max-tokens", "512", "--reward.num-workers", "8", "--trainer.steps", "300",
    "--trainer.val-every", "25", "--trainer.save-every", "50", "--out-dir", "runs/gsm8k",
]  # fmt: skip
"""The recipe's train.py flags after the model and the rows (the README's "Train a real model")."""


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


def download(directory: Path = DOWNLOAD) -> Path:
    """GSM8K's `main` parquet files from the hub into `directory` (what `hf download` does); their folder."""
    from huggingface_hub import snapshot_download

    snapshot_download(DATASET, repo_type="dataset", local_dir=directory, allow_patterns=["main/*"])
    return directory / "main"


def find(directory: Path, split: str) -> Path:
    """GSM8K's `split` file in `directory` (the hub's `train-00000-of-00001.parquet`, or `train.parquet`)."""
    found = sorted(directory.glob(f"{split}*.parquet"))
    if not found:
        raise SystemExit(f"no {split}*.parquet in {directory} (leave out --gsm8k to download {DATASET})")
    return found[0]


def command(train: Path, test: Path, extra: list[str], model: str = MODEL) -> list[str]:
    """The train.py command line: GRPO, the model, the rows, the recipe's DEFAULTS, then `extra`."""
    return [
        sys.executable, str(ROOT / "train.py"), "grpo", "--model.path", model,
        "--data.train-files", str(train), "--data.val-files", str(test), *DEFAULTS, *extra,
    ]  # fmt: skip


def main() -> None:
    args, extra = sys.argv[1:], []
    if "--" in args:
        args, extra = args[: args.index("--")], args[args.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gsm8k", type=Path, help="a folder of GSM8K's train/test parquet (default: download)"
    )
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k_rows"), help="where the rows go")
    parser.add_argument("--model", default=MODEL, help="a hub id or a model directory")
    parser.add_argument("--convert-only", action="store_true", help="write the rows, do not train")
    ns = parser.parse_args(args)
    source = ns.gsm8k or download()
    rows = {}
    for split in ("train", "test"):
        rows[split] = ns.out / f"{split}.parquet"
        n = convert(find(source, split), rows[split], split)
        print(f"{rows[split]}: {n} rows", file=sys.stderr)
    if ns.convert_only:
        return
    cmd = command(rows["train"], rows["test"], extra, ns.model)
    print(shlex.join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
