"""Does bf16 compute learn the same? --model.compute-dtype float32 vs bfloat16, side by side.

    .venv/bin/python experiments/bf16_study.py                   # both tasks, seeds 0 1 2, ~6 minutes
    .venv/bin/python experiments/bf16_study.py --tasks reverse --seeds 0
    .venv/bin/python experiments/bf16_study.py --quick           # 3 steps each: checks the script runs

Issue 17, item 3. Each run is the real train.py (GRPO), the two dtypes alternated per seed so both
see the same machine load. Tasks: "reverse" is the embedded default run (tiny-reverse, 30 steps of 32
prompts x 8, validated every 10 steps): the learning comparison; "small" is builtin:small (6 layers,
256 wide, random init) on builtin:sort with 24-token responses, 12 steps: the speed comparison at a
size where bf16 matmuls pay (a random init learns nothing in 12 steps: its rewards are noise). Prints, per task and dtype,
the mean training reward over thirds of the run, the final greedy validation reward, the median
update seconds and the bf16/fp32 update ratio, and the mean |rollout - old| log-prob gap (the
rollout stays fp32, so this is the trainer pass's bf16 rounding). Reports, never asserts.
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

TASKS = {
    "reverse": ["--trainer.steps", "30", "--trainer.val-every", "10"],
    "small": ["--model.path", "builtin:small", "--data.train-files", "builtin:sort", "--data.val-files",
              "builtin:sort", "--rollout.max-tokens", "24", "--data.batch-size", "16", "--trainer.steps", "12",
              "--trainer.val-every", "12"],
}  # fmt: skip
COMMON = ["--log.no-progress", "--algo.rollout-is", "token"]  # rollout-is: the old-log-prob pass runs


def run(task: str, dtype: str, seed: int, out: Path, quick: bool) -> list[dict]:
    flags = [*TASKS[task], *COMMON, "--model.compute-dtype", dtype, "--trainer.seed", str(seed)]
    if quick:
        flags += ["--trainer.steps", "3", "--trainer.val-every", "3"]
    cmd = [sys.executable, str(ROOT / "train.py"), "grpo", *flags, "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{task} {dtype} seed {seed} failed:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[list[dict]]) -> dict[str, float]:
    """Means over seeds: reward per third of the steps, final validation reward, update s, gap."""
    steps = [[r for r in rs if r["step"] > 0 and "reward/score_mean" in r] for rs in records]
    n = len(steps[0])
    thirds = [(k * n // 3, (k + 1) * n // 3) for k in range(3)]
    out = {
        f"reward {a + 1}-{b}": statistics.mean(r["reward/score_mean"] for rs in steps for r in rs[a:b])
        for a, b in thirds
    }
    out["final val"] = statistics.mean(
        [r for r in rs if "val/reward_mean" in r][-1]["val/reward_mean"] for rs in records
    )
    warm = [r["timing/update_s"] for rs in steps for r in rs[1:]]  # each run's first step warms up
    out["update s"] = statistics.median(warm)
    out["gap mean"] = statistics.mean(r["rollout/logprob_diff_mean"] for rs in steps for r in rs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bf16-study-"))
    for task in args.tasks:
        runs: dict[str, list[list[dict]]] = {"float32": [], "bfloat16": []}
        for seed in args.seeds:
            for dtype in runs if seed % 2 == 0 else reversed(runs):  # alternate who runs first
                runs[dtype].append(run(task, dtype, seed, root / f"{task}-{dtype}-{seed}", args.quick))
        table = {dtype: summary(rs) for dtype, rs in runs.items()}
        keys = list(table["float32"])
        print(f"\n{task} (seeds {args.seeds}): " + ", ".join(TASKS[task]))
        print(f"{'dtype':>9s} " + " ".join(f"{k:>13s}" for k in keys))
        for dtype, row in table.items():
            print(f"{dtype:>9s} " + " ".join(f"{row[k]:13.4g}" for k in keys))
        ratio = table["float32"]["update s"] / table["bfloat16"]["update s"]
        print(f"bf16 update speed-up: {ratio:.2f}x")


if __name__ == "__main__":
    main()
