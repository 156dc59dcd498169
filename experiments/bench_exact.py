"""`--rollout.exact` against the default, step time side by side (issue 41), on two workloads.

    .venv/bin/python experiments/bench_exact.py                      # both workloads, every variant, 4 steps
    .venv/bin/python experiments/bench_exact.py --workloads longtail --steps 3
    .venv/bin/python experiments/bench_exact.py --quick              # a smoke run: checks the script

Workloads (the real `train.py grpo`, one variant after the other, no validation):
- real: SmolLM2-135M-Instruct (its GGUF, fp32) on reasoning_gym chain_sum, 8 prompts x 8 samples, <= 48 tokens
  (bench_real's);
- longtail: bench_async's long-tailed Llama (4 layers, width 256, EOS about constant per token) on `reverse`,
  16 prompts x 8 samples, <= 128 tokens: most responses short, a few long (bench_rollout's issue-17 workload).
Variants: default; exact (`--rollout.exact`); the same two with 2 mini-batches per step (an off-policy update,
so the default runs an old-log-prob pass) and exact with `--algo.bypass` there (no old pass: the rollout's
log-probs are the old policy's, bit for bit); and bf16 weights (`--model.dtype bfloat16`) with and without
exact, for the bf16 gap. Per variant, medians over steps 2..S: rollout, old-log-prob, update and step
seconds, the ratio to its baseline (default, default 2mb, bf16) and the largest `rollout/logprob_diff_max`.
Floors: 2 x params x generated tokens (rollout) and 6 x params x trained tokens (update) over the matmul
peak measured here (fp32 or bf16), reported as % of floor for the step.
Reports, never asserts; the table goes to experiments/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_async import long_tailed_model  # noqa: E402
from bench_real import TASK, find_model, matmul_peak, prompt_tokens, run_grpo  # noqa: E402

WORKLOADS = {  # model, task, shape
    "real": {"task": TASK, "batch": 8, "n": 8, "max_tokens": 48, "lr": "5e-6"},
    "longtail": {"task": "builtin:reverse", "batch": 16, "n": 8, "max_tokens": 128, "lr": "1e-4"},
}
QUICK = {"batch": 2, "n": 4, "max_tokens": 16}
VARIANTS = {  # name: (flags, baseline)
    "default": ([], None),
    "exact": (["--rollout.exact"], "default"),
    "default 2mb": (["--algo.mini-batch-size", "{half}"], None),
    "exact 2mb": (["--algo.mini-batch-size", "{half}", "--rollout.exact"], "default 2mb"),
    "exact+bypass 2mb": (
        ["--algo.mini-batch-size", "{half}", "--rollout.exact", "--algo.bypass"],
        "default 2mb",
    ),
    "bf16": (["--model.dtype", "bfloat16"], None),
    "bf16 exact": (["--model.dtype", "bfloat16", "--rollout.exact"], "bf16"),
}


def train(model: Path, work: dict, flags: list[str], steps: int, out: Path) -> list[dict] | None:
    half = str(max(1, work["batch"] // 2))
    shape = {k: work[k] for k in ("batch", "n", "max_tokens")} | {"steps": steps}
    return run_grpo(model, work["task"], shape, work["lr"], [f.format(half=half) for f in flags], out, label=out.name)


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else 0.0


def summarize(records: list[dict], work: dict, peak: float, prompt: float) -> dict[str, float]:
    later = [r for r in records if r["step"] > 1] or records
    params = records[0]["model/params"]
    samples = work["batch"] * work["n"]
    generated = statistics.median(samples * r["response/length_mean"] for r in later)
    floor = (2 * params * generated + 6 * params * (generated + samples * prompt)) / peak
    step = median(later, "timing/step_s")
    return {
        "rollout": median(later, "timing/rollout_s"),
        "old": median(later, "timing/old_logprobs_s"),
        "update": median(later, "timing/update_s"),
        "step": step,
        "floor_pct": 100 * floor / step,
        "gap": max(
            (r["rollout/logprob_diff_max"] for r in records if "rollout/logprob_diff_max" in r),
            default=float("nan"),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-exact-"))
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print(f"bench_exact.py, {datetime.date.today()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"matmul peak fp32 {peaks['fp32'] / 1e9:.0f}, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")  # fmt: skip
    for name in args.workloads:
        work = WORKLOADS[name] | (QUICK if args.quick else {})
        model = find_model() if name == "real" else long_tailed_model(root / "longtail-model")
        prompt = prompt_tokens(model, task=work["task"])
        rows: dict[str, dict[str, float] | None] = {}
        steps = 2 if args.quick else args.steps
        for variant in args.variants:
            flags, _ = VARIANTS[variant]
            started = time.perf_counter()
            records = train(
                model, work, flags, 2 if args.quick else args.steps, root / name / variant.replace(" ", "_")
            )
            print(f"{name} / {variant}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            peak = peaks["bf16" if "bfloat16" in flags else "fp32"]
            rows[variant] = summarize(records, work, peak, prompt) if records else None
        print(f"\n{name}: {work['batch']} prompts x {work['n']} samples, <= {work['max_tokens']} tokens, "
              f"prompt {prompt:.1f} tokens; medians of steps 2..{steps}")  # fmt: skip
        print(
            "| variant | rollout s | old-log-prob s | update s | step s | vs its baseline | % of floor | gap max |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for variant, row in rows.items():
            if row is None:
                print(f"| {variant} | failed |||||||")
                continue
            base = rows.get(VARIANTS[variant][1] or "")
            ratio = f"{row['step'] / base['step']:.2f}x" if base else "-"
            print(f"| {variant} | {row['rollout']:.2f} | {row['old']:.2f} | {row['update']:.2f} | {row['step']:.2f} | "
                  f"{ratio} | {row['floor_pct']:.1f}% | {row['gap']:.2g} |")  # fmt: skip


if __name__ == "__main__":
    main()
