"""Algorithm study: every RL preset on two built-in tasks, three seeds each, through the real train.py.

    .venv/bin/python experiments/algorithms/run.py                    # 8 presets x 2 tasks x 3 seeds
    .venv/bin/python experiments/algorithms/run.py --presets grpo ppo --seeds 0 --steps 4   # a subset

Tasks (each starts from its shipped warm start, since RL from a random init does not learn here):
- `reverse`: builtin:tiny-reverse on builtin:reverse (single turn, 12 new tokens), the embedded default;
- `calc`: builtin:tiny-calc on builtin:calc (multi-turn, the calculator tool, 64 tokens, 2 turns).
Settings are each preset's defaults plus `--data.batch-size 16 --rollout.n 8` and validation (greedy,
128 val prompts) every 2 steps. Runs go one at a time (the machine has 2 cores), each in its own
process; results land in `<work>/results.json`, the table is printed in markdown and the curves are
drawn to experiments/algorithms/curves.png.

Per (preset, task): steps and training seconds (the sum of `timing/step_s`, validation excluded) to
the first validation >= 0.9, as the median over the seeds that got there ("-" when none did, with the
count), and the final validation reward (mean ± spread over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from configs import PRESETS  # noqa: E402
from rlcore.trainer.logger import read_metrics  # noqa: E402

TASKS = {
    "reverse": ["--model.path", "builtin:tiny-reverse", "--data.train-files", "builtin:reverse",
                "--data.val-files", "builtin:reverse"],
    "calc": ["--model.path", "builtin:tiny-calc", "--data.train-files", "builtin:calc", "--data.val-files",
             "builtin:calc", "--rollout.max-turns", "2", "--rollout.max-tokens", "64"],
}  # fmt: skip
RL_PRESETS = [name for name in PRESETS if name != "sft"]
TARGET = 0.9


def run_one(preset: str, task: str, seed: int, steps: int, out: Path) -> dict:
    """Train once; the validation curve and the time to TARGET from its metrics.jsonl."""
    cmd = [sys.executable, str(ROOT / "train.py"), preset, *TASKS[task], "--trainer.seed", str(seed),
           "--trainer.steps", str(steps), "--trainer.val-every", "2", "--data.batch-size", "16",
           "--rollout.n", "8", "--log.no-progress", "--out-dir", str(out)]  # fmt: skip
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "TRANSFORMERS_VERBOSITY": "error"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    records = read_metrics(out / "metrics.jsonl")
    curve, train_s, hit = [], 0.0, None
    for r in records:
        train_s += r.get("timing/step_s", 0.0)
        if "val/reward_mean" in r:
            curve.append((r["step"], r["val/reward_mean"]))
            if hit is None and r["val/reward_mean"] >= TARGET:
                hit = {"step": r["step"], "train_s": train_s}
    return {"curve": curve, "final": curve[-1][1], "hit": hit, "wall_s": wall}


def table(results: dict, presets: list[str], tasks: list[str], seeds: list[int]) -> str:
    lines = ["| preset | task | steps to 0.9 | train s to 0.9 | final val reward | runs reaching 0.9 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for preset in presets:
        for task in tasks:
            runs = [results.get(f"{preset}/{task}/{s}") for s in seeds]
            ok = [r for r in runs if r and "final" in r]
            hits = [r["hit"] for r in ok if r["hit"]]
            finals = [r["final"] for r in ok]
            steps = f"{statistics.median(h['step'] for h in hits):.0f}" if hits else "-"
            secs = f"{statistics.median(h['train_s'] for h in hits):.1f}" if hits else "-"
            final = (f"{statistics.mean(finals):.3f} ± {(max(finals) - min(finals)) / 2:.3f}" if finals
                     else "failed")  # fmt: skip
            lines.append(f"| {preset} | {task} | {steps} | {secs} | {final} | {len(hits)}/{len(runs)} |")
    return "\n".join(lines)


def plot(results: dict, presets: list[str], tasks: list[str], seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, task in zip(axes, tasks, strict=True):
        for preset in presets:
            curves = [
                results[k]["curve"] for s in seeds if "curve" in results.get(k := f"{preset}/{task}/{s}", {})
            ]
            if not curves:
                continue
            steps = [s for s, _ in curves[0]]
            mean = [statistics.mean(c[i][1] for c in curves if i < len(c)) for i in range(len(steps))]
            ax.plot(steps, mean, marker="o", markersize=3, label=preset)
        ax.axhline(TARGET, color="grey", linewidth=0.5, linestyle="--")
        ax.set_title(f"{task} (mean of {len(seeds)} seeds)")
        ax.set_xlabel("step")
    axes[0].set_ylabel("greedy validation reward")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=RL_PRESETS, choices=RL_PRESETS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--work", type=Path, default=None, help="run directories and results.json")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rlcore-algorithms-"))
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    renamed = {"reinforce_pp/": "reinforce-pp/"}  # the preset's name before issue 57 (results.json keeps it)
    for old, new in renamed.items():
        results = {(new + k.removeprefix(old) if k.startswith(old) else k): v for k, v in results.items()}
    for preset in args.presets:
        for task in args.tasks:
            for seed in args.seeds:
                key = f"{preset}/{task}/{seed}"
                if key in results and "final" in results[key]:
                    continue  # resumable: finished runs are kept
                results[key] = run_one(preset, task, seed, args.steps, work / key.replace("/", "-"))
                results_path.write_text(json.dumps(results, indent=1))
                r = results[key]
                print(f"{key}: final {r.get('final')} hit {r.get('hit')} wall {r['wall_s']:.0f}s "
                      f"{r.get('error', '')}", flush=True)  # fmt: skip
    print(table(results, args.presets, args.tasks, args.seeds))
    plot(results, args.presets, args.tasks, args.seeds, Path(__file__).with_name("curves.png"))
    print(f"results: {results_path}")


if __name__ == "__main__":
    main()
