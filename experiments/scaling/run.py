"""Scaling: seconds per step as the batch and the response length double, and 1 vs 2 ranks (torchrun, CPU).

    .venv/bin/python experiments/scaling/run.py            # ~10 minutes on 2 cores
    .venv/bin/python experiments/scaling/run.py --quick    # two points per sweep (checks the script)

Every point is a real `train.py grpo` run of `--steps` steps on builtin:reverse with a random-init
`builtin:tiny` (it rarely emits EOS, so responses run to max-tokens and the work per step is what the
flags say), validation off. The first step (warm-up) is dropped and the median of the rest reported:
step seconds, and within it rollout and update seconds. Expect linear growth in the batch (the work
is per row) once fixed per-step costs are amortised, and super-linear growth in the response length
only where attention's context term matters (tiny widths: it does not, much).

Ranks: the same global batch on 1 process and on 2 torchrun ranks (gloo, one thread each): each rank
rolls out half the prompts from its unsharded copy, the update is FSDP2 over both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlcore.trainer.logger import read_metrics  # noqa: E402

BASE = [
    "grpo",
    "--model.path",
    "builtin:tiny",
    "--trainer.val-every",
    "0",
    "--log.no-progress",
    "--rollout.n",
    "8",
]


def point(args: list[str], steps: int, out: Path, ranks: int = 1) -> dict[str, float]:
    """Median step / rollout / update seconds of one run (the first step dropped)."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [
        *launcher,
        str(ROOT / "train.py"),
        *BASE,
        *args,
        "--trainer.steps",
        str(steps),
        "--out-dir",
        str(out),
    ]
    threads = "1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    env = os.environ | {
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": threads,
        "TRANSFORMERS_VERBOSITY": "error",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = read_metrics(out / "metrics.jsonl")[1:]
    med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    return {"step_s": med("timing/step_s"), "rollout_s": med("timing/rollout_s"), "update_s": med("timing/update_s"),
            "tokens": statistics.median(r["response/length_mean"] for r in records)}  # fmt: skip


def sweep(name: str, values: list[int], make_args, steps: int, work: Path) -> None:
    if not values:
        return
    print(f"\n{name}")
    print("| value | s/step | rollout s | update s | x previous | response length |")
    print("|---|---|---|---|---|---|")
    previous = None
    for v in values:
        r = point(make_args(v), steps, work / f"{name}-{v}")
        ratio = f"{r['step_s'] / previous:.2f}x" if previous else "-"
        print(f"| {v} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | {ratio} | {r['tokens']:.1f} |",
              flush=True)  # fmt: skip
        previous = r["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only-ranks", action="store_true", help="the 1 vs 2 ranks table alone")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlcore-scaling-"))
    batches = [4, 8] if args.quick else [4, 8, 16, 32, 64]
    lengths = [8, 16] if args.quick else [8, 16, 32, 64, 128]
    steps = 2 if args.quick else args.steps
    if args.only_ranks:
        batches = lengths = []
    sweep("batch size (prompts x 8 samples, 16 new tokens)", batches,
          lambda b: ["--data.batch-size", str(b), "--rollout.max-tokens", "16"], steps, work)  # fmt: skip
    sweep("response length (16 prompts x 8 samples)", lengths,
          lambda t: ["--data.batch-size", "16", "--rollout.max-tokens", str(t)], steps, work)  # fmt: skip
    print("\nranks (32 prompts x 8 samples, 16 new tokens; one thread per rank)")
    print("| ranks | s/step | rollout s | update s |")
    print("|---|---|---|---|")
    flags = ["--data.batch-size", "32", "--rollout.max-tokens", "16"]
    for ranks in (1, 2):
        os.environ["OMP_NUM_THREADS"] = "1"
        r = point(flags, steps, work / f"ranks-{ranks}", ranks=ranks)
        print(f"| {ranks} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
