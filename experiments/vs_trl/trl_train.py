"""TRL's GRPOTrainer on the shared inputs of experiments/vs_trl, with per-step timings (issue 9).

Runs in the TRL venv (experiments/vs_trl/setup.sh); run.py launches it once per seed:

    /work/scratch-trl/venv/bin/python experiments/vs_trl/trl_train.py --model DIR --train-file train.parquet \\
        --out OUT --steps 30 --seed 0

Settings mirror rlcore's run (see run.py): `per_device_train_batch_size` completions per micro-batch,
`gradient_accumulation_steps` micro-batches per optimizer step, and `steps_per_generation` equal to it, so
one generation batch (prompts x num_generations) is one optimizer update; num_iterations=1, beta=0 (no
reference model), no gradient checkpointing (TRL's default is on;
rlcore's is off), loss_type="dapo" (token losses summed over the whole generation batch / its token
count = rlcore's token-mean over the step's batch), constant learning rate, no warm-up, AdamW, grad clip 1.
A TrainerCallback writes one JSON line per optimizer step to OUT/steps.jsonl: the time from
on_step_begin to on_step_end (generation, scoring, forward, backward, optimizer step), the wall time
since the previous step's end, the prompt + completion tokens of the step, and TRL's logged metrics.
The final model and tokenizer go to OUT/final.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reward import trl_reward


class StepTimer(TrainerCallback):
    """One JSON line per optimizer step: step seconds, wall seconds since the last step, tokens, logs."""

    def __init__(self, path: Path):
        self.path, self.records, self.begin, self.last_end, self.tokens = path, [], 0.0, None, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        seen = int(state.num_input_tokens_seen)
        self.records.append(
            {"step": state.global_step, "step_s": now - self.begin, "wall_s": now - self.last_end,
             "tokens": seen - self.tokens}
        )  # fmt: skip
        self.last_end, self.tokens = now, seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.records and self.records[-1]["step"] == state.global_step:
            numbers = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
            self.records[-1].setdefault("logs", {}).update(numbers)

    def on_train_end(self, args, state, control, **kwargs):
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory (shared with rlcore)")
    parser.add_argument("--train-file", required=True, help="verl-format parquet (shared with rlcore)")
    parser.add_argument("--out", required=True, help="output directory (steps.jsonl, final/)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batch", type=int, default=64, help="completions per forward/backward")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    completions = args.prompts * args.n
    if completions % args.micro_batch:
        sys.exit(f"error: --micro-batch {args.micro_batch} must divide prompts x n = {completions}")
    accumulation = completions // args.micro_batch
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=args.n,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL's default is True; rlcore's activation checkpointing is off
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        data_seed=args.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    dataset = load_dataset("parquet", data_files=args.train_file, split="train")
    timer = StepTimer(out / "steps.jsonl")
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=trl_reward, args=config, train_dataset=dataset, callbacks=[timer]
    )
    trainer.train()
    trainer.save_model(str(out / "final"))
    trainer.processing_class.save_pretrained(str(out / "final"))
    print(f"threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
