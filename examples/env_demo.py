"""GRPO on a user environment: `--rollout.env examples/envs/reverse_retry.py:ReverseRetry`, 2 turns.

    .venv/bin/python examples/env_demo.py                  # 30 steps, seeds 0 1, ~4 minutes
    .venv/bin/python examples/env_demo.py --steps 3 --seeds 0   # checks the script runs

Writes verl-format rows of the reverse task under the data_source "reverse_retry" (no reward
function: the environment alone scores), runs the real train.py (GRPO, tiny-reverse, 32 prompts x 8,
greedy validation every 10 steps) and prints, per seed, the mean episode score over thirds of the run,
the share of episodes that needed the retry (agent/turns_mean - 1), the observation tokens per
episode and the validation scores. Reports, never asserts. A recorded run: experiments/README.md,
"env_demo: GRPO on a user environment". The environment itself is examples/envs/reverse_retry.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlcore.data.tasks import generate_rows

ROOT = Path(__file__).resolve().parents[1]
ENV = "examples/envs/reverse_retry.py:ReverseRetry"


def write_rows(path: Path, split: str, n: int) -> None:
    rows = [row | {"data_source": "reverse_retry"} for row in generate_rows("reverse", split, n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run(seed: int, steps: int, data: Path, out: Path) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "train.py"), "grpo", "--rollout.env", ENV, "--rollout.max-turns", "2",
           "--rollout.max-tokens", "24", "--data.train-files", str(data / "train.jsonl"), "--data.val-files",
           str(data / "val.jsonl"), "--trainer.steps", str(steps), "--trainer.val-every", str(min(10, steps)),
           "--trainer.seed", str(seed), "--log.no-progress", "--out-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def report(seed: int, records: list[dict]) -> None:
    steps = [r for r in records if r["step"] > 0]
    n = len(steps)
    thirds = [(k * n // 3, max(k * n // 3 + 1, (k + 1) * n // 3)) for k in range(3)]
    score = " / ".join(
        f"{statistics.mean(r['reward/score_mean'] for r in steps[a:b]):.3f}" for a, b in thirds
    )
    retry = " / ".join(
        f"{statistics.mean(r['agent/turns_mean'] - 1 for r in steps[a:b]):.2f}" for a, b in thirds
    )
    obs = statistics.mean(r["agent/observation_tokens_mean"] for r in steps)
    val = ", ".join(f"{r['step']}: {r['val/reward_mean']:.3f}" for r in records if "val/reward_mean" in r)
    print(f"seed {seed}: score per third {score}; retried {retry}; observation tokens {obs:.1f}; val {val}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        write_rows(data / "train.jsonl", "train", 2000)
        write_rows(data / "val.jsonl", "val", 64)
        for seed in args.seeds:
            report(seed, run(seed, args.steps, data, data / f"run{seed}"))


if __name__ == "__main__":
    main()
