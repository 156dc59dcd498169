"""What a colocated stream mode could gain on long-tailed lengths: the decode steps' cost by live rows.

    .venv/bin/python experiments/colocated_stream.py            # bench_async's workload, ~1 min

One colocated rank that streamed would, instead of waiting for a batch's longest samples, update on the
groups that are done and carry the unfinished samples into the next batch's decoding (partial rollouts
across its own updates). All it can save is the tail: the decode steps that run with few live rows,
whose tokens cost more each than in a full step. This measures that bound on bench_async's model and
workload (16 prompts x 8 samples, up to 128 tokens, geometric lengths): every decode step of the
native engine is timed with its live rows, and the tail's excess is the time of the steps below a
quarter of the rows minus what their tokens would cost at the full-batch per-token cost. The bound is
then set against the whole step (rollout + the rest, timed by train.py on the same work).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench_async import SETTINGS, long_tailed_model  # noqa: E402
from rlcore.data.prompts import make_prompt_batch  # noqa: E402
from rlcore.data.rows import row_from_dict  # noqa: E402
from rlcore.data.tasks import generate_rows  # noqa: E402
from rlcore.models.policy import load_policy  # noqa: E402
from rlcore.rollout import NativeEngine, SamplingParams  # noqa: E402


def timed_rollout(engine: NativeEngine, prompts, seed: int) -> tuple[list[float], torch.Tensor]:
    """Each decode step's seconds (the first: prefill and token 0) and the response lengths."""
    marks = [time.perf_counter()]
    with engine.each_step(lambda _: marks.append(time.perf_counter())):
        out = engine.generate(prompts, SamplingParams(n=8, max_tokens=128, seed=seed))
    marks.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(marks)]
    return steps, out["response_mask"].sum(-1).long()


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    work = Path(tempfile.mkdtemp(prefix="rlcore-colocated-stream-"))
    model_dir = long_tailed_model(work / "model")
    model, tokenizer = load_policy(str(model_dir), dtype=torch.float32)
    engine = NativeEngine(model, tokenizer)
    rows = [row_from_dict(r, "builtin:reverse") for r in generate_rows("reverse", "train", 16 * 6)]
    totals, tails, excesses = [], [], []
    for batch in range(6):
        prompts = make_prompt_batch(rows[batch * 16 : (batch + 1) * 16], tokenizer)
        steps, lengths = timed_rollout(engine, prompts, seed=batch)
        live = [int((lengths > j).sum()) for j in range(len(steps))]
        full = [s / n for s, n in zip(steps[1:], live[1:], strict=False) if n >= 0.75 * len(lengths)]
        per_token = statistics.median(full)  # seconds per row-token in a full decode step
        tail = [(s, n) for s, n in zip(steps[1:], live[1:], strict=False) if n < 0.25 * len(lengths)]
        tail_s = sum(s for s, _ in tail)
        excess = tail_s - per_token * sum(n for _, n in tail)
        if batch > 0:  # the first batch warms the allocator up
            totals.append(sum(steps))
            tails.append(tail_s)
            excesses.append(excess)
        print(f"batch {batch}: rollout {sum(steps):.3f} s over {len(steps)} steps, mean length "
              f"{lengths.float().mean():.1f}, tail (< 1/4 rows live) {tail_s:.3f} s in {len(tail)} steps, "
              f"excess over full-step cost {excess:.3f} s", flush=True)  # fmt: skip
    update = update_seconds(model_dir, work)
    rollout, excess = statistics.median(totals), statistics.median(excesses)
    print(f"\nrollout {rollout:.3f} s, tail {statistics.median(tails):.3f} s, tail excess {excess:.3f} s; "
          f"the rest of the step {update:.3f} s; a colocated stream mode saves at most {excess:.3f} s of a "
          f"{rollout + update:.3f} s step: {100 * excess / (rollout + update):.1f}%")  # fmt: skip


def update_seconds(model_dir: Path, work: Path) -> float:
    """The median of what a colocated train.py step spends outside its rollout (log-prob passes, update,
    bookkeeping) over steps 3-6 on the same workload."""
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": os.environ.get("THREADS", "2")}
    out = work / "train"
    cmd = [sys.executable, str(ROOT / "train.py"), *SETTINGS, "--model.path", str(model_dir),
           "--trainer.steps", "6", "--out-dir", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env, timeout=1800)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["timing/step_s"] - r["timing/rollout_s"] for r in records[2:])


if __name__ == "__main__":
    main()
