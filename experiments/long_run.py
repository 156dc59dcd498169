"""Memory over a long run: the embedded default for 200 steps, and the slope of its resident memory.

    python experiments/long_run.py                          # 200 steps into runs/long_run-<timestamp>
    python experiments/long_run.py --steps 400 --warmup 20 --out-dir runs/long

Runs `python train.py --trainer.steps N --out-dir DIR --log.no-progress` (everything else the
default: GRPO on builtin:reverse, 32 prompts x 8 samples, CPU), then reads `perf/rss_mb` (resident
memory after each step) and `perf/max_memory_mb` (the peak so far) from DIR/metrics.jsonl and prints
the least-squares slope of the resident memory after the warm-up, in MB per step and MB per 1000
steps. A flat run has a slope near 0; a per-step leak shows as a steady positive slope.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlcore.trainer.logger import read_metrics  # noqa: E402


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the slope")
    parser.add_argument("--out-dir", type=Path, default=ROOT / f"runs/long_run-{datetime.now():%Y%m%d-%H%M%S}")  # fmt: skip
    args = parser.parse_args()
    started = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "train.py"), "--trainer.steps", str(args.steps), "--log.no-progress",
           "--out-dir", str(args.out_dir)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True)
    seconds = time.perf_counter() - started
    records = [r for r in read_metrics(args.out_dir / "metrics.jsonl") if r["step"] > 0]
    steps = [float(r["step"]) for r in records if r["step"] > args.warmup]
    rss = [r["perf/rss_mb"] for r in records if r["step"] > args.warmup]
    at = {r["step"]: r["perf/rss_mb"] for r in records}
    per_step = slope(steps, rss)
    print(f"{len(records)} steps in {seconds:.0f} s ({args.out_dir})")
    print(f"resident MB: step 1 {at[1]:.1f}, step {args.warmup} {at[args.warmup]:.1f}, "
          f"last {at[records[-1]['step']]:.1f}, min/max after warm-up {min(rss):.1f}/{max(rss):.1f}")  # fmt: skip
    print(f"peak resident MB (perf/max_memory_mb): {records[-1]['perf/max_memory_mb']:.1f}")
    print(f"slope after step {args.warmup}: {per_step:+.4f} MB/step ({per_step * 1000:+.1f} MB/1000 steps)")


if __name__ == "__main__":
    main()
