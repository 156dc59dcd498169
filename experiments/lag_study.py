"""Learning with stale rollouts: lag mode K = 0, 1, 2, 4, with and without an off-policy correction.

    .venv/bin/python experiments/lag_study.py                      # the default task, seed 0, ~5 minutes
    .venv/bin/python experiments/lag_study.py --seeds 0 1 2        # three seeds
    .venv/bin/python experiments/lag_study.py --quick              # 3 steps each: checks the script runs

Issue 16. Each run is the real train.py on the embedded default (GRPO, builtin:reverse, tiny-reverse,
30 steps of 32 prompts x 8), validated every 5 steps, with --pipeline.max-staleness K; "is" adds
decoupled PPO's truncated token IS (--algo.rollout-is token, cap 2). Prints, per run, the first
validated step with greedy reward >= 0.9, the final validation reward, and the mean staleness and
|rollout - old| log-prob gap over the steps. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(k: int, correction: bool, seed: int, steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"lag-k{k}-"))
    cmd = [sys.executable, str(ROOT / "train.py"), "--pipeline.max-staleness", str(k), "--trainer.seed", str(seed),
           "--trainer.steps", str(steps), "--trainer.val-every", "5", "--log.no-progress", "--out-dir", str(out)]  # fmt: skip
    if correction:
        cmd += ["--algo.rollout-is", "token", "--algo.rollout-is-cap", "2"]
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val/reward_mean"]) for r in records if "val/reward_mean" in r]
    train = [r for r in records if r["step"] > 0 and "pipeline/staleness_mean" in r]
    gaps = [r["rollout/logprob_diff_mean"] for r in train if "rollout/logprob_diff_mean" in r]
    return {
        "to_0.9": next((s for s, v in vals if v >= 0.9), None),
        "final_val": vals[-1][1],
        "staleness": sum(r["pipeline/staleness_mean"] for r in train) / len(train),
        "gap_mean": sum(gaps) / len(gaps) if gaps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 3 if args.quick else 30
    print(
        "K | correction | seed | first val >= 0.9 at step | final val | mean staleness | mean |rollout-old|"
    )
    for k in (0, 1, 2, 4):
        for correction in (False, True):
            for seed in args.seeds:
                r = run(k, correction, seed, steps)
                if "error" in r:
                    print(f"{k} | {'is' if correction else '-'} | {seed} | {r['error']}")
                    continue
                print(f"{k} | {'is' if correction else '-'} | {seed} | {r['to_0.9']} | {r['final_val']:.3f} | "
                      f"{r['staleness']:.2f} | {r['gap_mean']:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
