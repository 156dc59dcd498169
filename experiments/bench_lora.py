"""LoRA vs full fine-tuning, side by side in one run: what each holds and costs, and how each learns.

    .venv/bin/python experiments/bench_lora.py            # both parts, ~6 minutes on 2 cores
    .venv/bin/python experiments/bench_lora.py --quick    # 2 steps each: checks the script runs

Issue 19. Every run is the real train.py (GRPO), the variants alternated. Part 1, sizes and speed: a
~31M-parameter Llama (10 layers, 512 wide, random init, the char tokenizer) for 4 steps with a
checkpoint at the end: parameters, trainable parameters, optimizer state (AdamW: two fp32 moments per
held parameter), peak resident memory, checkpoint size, median update and step seconds, weight-sync
bytes (0 for both in one process: the native engine samples from the trained module). Part 2, the
reward curve: the default task (tiny-reverse, 30 steps of 32 prompts x 8), full fine-tuning at its
default lr (1e-3) vs LoRA rank 16 at its default (5e-3), greedy validation every 10 steps, two seeds.
Reports, never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {"full": [], "lora r16": ["--model.lora-rank", "16"]}


def llama_31m(directory: Path) -> Path:
    """A 31.5M-parameter Llama with the char tokenizer, saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcore.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def train(args: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "train.py"), "grpo", *args, "--log.no-progress", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def size_part(root: Path, quick: bool) -> None:
    model = llama_31m(root / "llama-31m")
    steps = 2 if quick else 4
    common = ["--model.path", str(model), "--trainer.steps", str(steps), "--trainer.val-every", "0",
              "--trainer.save-every", str(steps), "--data.batch-size", "8", "--rollout.n", "4",
              "--rollout.max-tokens", "16"]  # fmt: skip
    print(f"\nPart 1: {model.name}, {steps} steps of 8 prompts x 4, 16 tokens, a checkpoint at the end")
    head = (
        "params",
        "trainable",
        "optimizer MB",
        "peak RSS MB",
        "checkpoint MB",
        "update s",
        "step s",
        "sync MB",
    )
    print(f"{'variant':>9s} " + " ".join(f"{h:>13s}" for h in head))
    for name, flags in VARIANTS.items():
        out = root / f"size-{name.replace(' ', '-')}"
        records = train([*common, *flags], out)
        first = records[0]
        ckpt = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) / 2**20
        later = records[1:] or records
        row = (
            first["model/params"], first["model/trainable_params"], first["model/optimizer_params"] * 8 / 2**20,
            max(r["perf/max_memory_mb"] for r in records), ckpt,
            statistics.median(r["timing/update_s"] for r in later), statistics.median(r["timing/step_s"] for r in later),
            sum(r.get("sync/bytes", 0.0) for r in records) / 2**20,
        )  # fmt: skip
        print(f"{name:>9s} " + " ".join(f"{v:13.4g}" for v in row))


def curve_part(root: Path, quick: bool, seeds: list[int]) -> None:
    steps = ["--trainer.steps", "3", "--trainer.val-every", "3"] if quick else []
    print("\nPart 2: the default task (tiny-reverse, 30 steps of 32 x 8), greedy validation reward")
    for seed in seeds:
        for name, flags in VARIANTS.items():
            records = train(
                [*flags, *steps, "--trainer.seed", str(seed)], root / f"curve-{name}-{seed}".replace(" ", "-")
            )
            val = [(r["step"], round(r["val/reward_mean"], 3)) for r in records if "val/reward_mean" in r]
            step_s = statistics.median(r["timing/step_s"] for r in records if "timing/step_s" in r)
            print(f"  seed {seed} {name:>9s}: val {val}, median {step_s:.3f} s/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    size_part(root, args.quick)
    curve_part(root, args.quick, args.seeds)


if __name__ == "__main__":
    main()
