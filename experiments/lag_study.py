"""Learning with stale rollouts: lag mode K = 0, 1, 2, 4, with and without an off-policy correction.

    .venv/bin/python experiments/lag_study.py                      # the default task, seed 0, ~5 minutes
    .venv/bin/python experiments/lag_study.py --seeds 0 1 2        # three seeds
    .venv/bin/python experiments/lag_study.py --quick              # 3 steps each: checks the script runs
    .venv/bin/python experiments/lag_study.py --task calc --seeds 0 1 2    # multi-turn calc, 14 steps

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


TASKS = {
    "reverse": ["--trainer.val-every", "5"],  # the embedded default run
    "calc": ["--model.path", "builtin:tiny-calc", "--data.train-files", "builtin:calc", "--data.val-files",
             "builtin:calc", "--rollout.max-turns", "2", "--rollout.max-tokens", "64", "--data.batch-size", "16",
             "--trainer.val-every", "2"],  # the multi-turn calculator task of experiments/algorithms
}  # fmt: skip


CORRECTIONS = {
    "-": [],
    "is": ["--algo.rollout-is", "token", "--algo.rollout-is-cap", "2"],  # decoupled PPO, truncated token IS
    "rs": [
        "--algo.rollout-rs",
        "token",
        "--algo.rollout-rs-upper",
        "2",
        "--algo.rollout-rs-lower",
        "0.5",
    ],  # IcePop
}


def run(
    k: int, correction: str, seed: int, steps: int, task: str = "reverse", lr: float | None = None
) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"lag-k{k}-"))
    cmd = [sys.executable, str(ROOT / "train.py"), "--pipeline.max-staleness", str(k), "--trainer.seed", str(seed),
           "--trainer.steps", str(steps), *TASKS[task], "--log.no-progress", "--out-dir", str(out)]  # fmt: skip
    cmd += CORRECTIONS[correction] + (["--optim.lr", str(lr)] if lr else [])
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
    parser.add_argument("--task", choices=sorted(TASKS), default="reverse")
    parser.add_argument("--corrections", nargs="+", choices=sorted(CORRECTIONS), default=["-", "is"])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument(
        "--lr", type=float, default=None, help="--optim.lr of every run (default: the task's)"
    )
    parser.add_argument("--steps", type=int, default=None, help="default: 30 (reverse), 14 (calc)")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps or (30 if args.task == "reverse" else 14)
    print(
        "K | correction | seed | first val >= 0.9 at step | final val | mean staleness | mean |rollout-old|"
    )
    for k in args.ks:
        for correction in args.corrections:
            for seed in args.seeds:
                r = run(k, correction, seed, steps, args.task, args.lr)
                if "error" in r:
                    print(f"{k} | {correction} | {seed} | {r['error']}")
                    continue
                print(f"{k} | {correction} | {seed} | {r['to_0.9']} | {r['final_val']:.3f} | "
                      f"{r['staleness']:.2f} | {r['gap_mean']:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
