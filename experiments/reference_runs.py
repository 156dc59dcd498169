"""Fifteen short reference runs whose metrics must not change when the code is only reorganised.

    python experiments/reference_runs.py run OUT [--only NAME,...]   # each run's metrics to OUT/NAME.json
    python experiments/reference_runs.py compare A B                 # exit 1 on any difference

Each run is the real train.py (or the real Tinker server with the real SDK) for two steps on a tiny model. What is
compared is every logged metric except wall time, memory and throughput, and every rewarded sample, to the last
bit. Run it at two commits (`git worktree add`) and compare the folders.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--data.builtin-train-size",
         "64", "--data.builtin-val-size", "8", "--rollout.val-n", "2", "--log.no-progress", "--trainer.steps", "2",
         "--trainer.val-every", "2"]  # fmt: skip
AGENT = ROOT / "tests" / "gateway" / "agents.py"
RUNS: dict[str, tuple[int, list[str]]] = {  # name: (processes, train.py arguments)
    "default": (1, ["grpo", *SMALL]),
    "ppo": (1, ["ppo", *SMALL]),
    "dapo": (1, ["dapo", *SMALL]),
    "moe-replay": (1, ["grpo", *SMALL, "--model.path", "builtin:tiny-moe", "--algo.router-replay", "replay"]),
    "vl": (
        1,
        [
            "grpo",
            *SMALL,
            "--model.path",
            "builtin:tiny-vl",
            "--data.train-files",
            "builtin:shapes",
            "--data.val-files",
            "builtin:shapes",
        ],
    ),
    "exact-fp32": (1, ["grpo", *SMALL, "--rollout.exact"]),
    "exact-bf16": (1, ["grpo", *SMALL, "--rollout.exact", "--model.dtype", "bfloat16"]),
    "lora": (1, ["grpo", *SMALL, "--model.lora-rank", "8"]),
    "sp2": (2, ["grpo", *SMALL, "--trainer.sp", "2"]),
    "split": (2, ["grpo", *SMALL, "--pipeline.placement", "split", "--pipeline.rollout-ranks", "1"]),
    "calc-agent": (
        1,
        [
            "grpo",
            *SMALL,
            "--data.train-files",
            "builtin:calc",
            "--data.val-files",
            "builtin:calc",
            "--rollout.max-tokens",
            "64",
            "--model.path",
            "builtin:tiny-calc",
            "--rollout.max-turns",
            "3",
        ],
    ),
    "gateway-agent": (
        1,
        ["grpo", *SMALL, "--rollout.max-tokens", "24", "--rollout.agent", f"{AGENT}:two_turns",
         "--rollout.agent-concurrency", "1"],
    ),
    "sft": (1, ["sft", *SMALL]),
    "rloo": (1, ["rloo", *SMALL]),
}
UNSTABLE = ("timing/", "memory/", "throughput/", "perf/")  # wall time (and any *_s) and memory: not the arithmetic


def train_run(name: str, out: Path) -> dict:
    ranks, args = RUNS[name]
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([*launch, str(ROOT / "train.py"), *args, "--out-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = (out / "samples.jsonl").read_text().splitlines() if (out / "samples.jsonl").exists() else []
    return {"metrics": [_stable(m) for m in metrics], "samples": samples}


def tinker_run(out: Path) -> dict:
    """examples/tinker_rl.py's loop for two small steps against the real server, one request in flight at a
    time (requests sent together share engine calls, and the batch they land in moves the last bits), with
    LoRA (rank 8) and the loss's outputs recorded."""
    sys.path.insert(0, str(ROOT))
    from tests.tinker.server import running

    sys.path.insert(0, str(ROOT / "examples"))
    import tinker
    import tinker_rl
    from tinker import types

    from rlcore.data.tasks import generate_rows

    records = []
    with running(out) as url, tinker.ServiceClient(base_url=url, api_key="tml-reference") as service:
        training = service.create_lora_training_client(base_model="builtin:tiny-reverse", rank=8).result()
        tokenizer = training.get_tokenizer()
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=7)
        adam = types.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
        for rows in (generate_rows("reverse", "train", 16)[:8], generate_rows("reverse", "train", 16)[8:]):
            sampler = training.save_weights_and_get_sampling_client().result()
            data, rewards = [], []
            for row in rows:
                prompt = tinker_rl.prompt_of(tokenizer, row)
                seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
                more, scores = tinker_rl.datums(tokenizer, row, prompt, seqs)
                data, rewards = data + more, rewards + scores
            out_fb = training.forward_backward(data, loss_fn="importance_sampling").result()
            training.optim_step(adam).result()
            records.append({"rewards": rewards, **{k: float(v) for k, v in out_fb.metrics.items()},
                            "logprobs": [float(x) for o in out_fb.loss_fn_outputs[:2] for x in o["logprobs"].tolist()]})  # fmt: skip
    return {"metrics": [{k: [_bits(x) for x in v] if isinstance(v, list) else v for k, v in r.items()} for r in records],
            "samples": []}  # fmt: skip


def _stable(record: dict) -> dict:
    return {k: _bits(v) for k, v in record.items() if _compared(k)}


def _compared(key: str) -> bool:
    return not (key.startswith(UNSTABLE) or key.endswith("_s"))


def _bits(value):
    return value.hex() if isinstance(value, float) and math.isfinite(value) else value


def run(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in only:
        with tempfile.TemporaryDirectory() as work:
            result = tinker_run(Path(work)) if name == "tinker" else train_run(name, Path(work))
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
        print(f"{name}: {len(result['metrics'])} records", flush=True)


def compare(a: Path, b: Path) -> int:
    bad = 0
    for name in NAMES:
        left, right = a / f"{name}.json", b / f"{name}.json"
        if not (left.exists() and right.exists()):
            print(f"{name}: missing in {'B' if left.exists() else 'A'}")
            bad += 1
            continue
        x, y = json.loads(left.read_text()), json.loads(right.read_text())
        diffs = [k for i, (p, q) in enumerate(zip(x["metrics"], y["metrics"], strict=False))
                 for k in sorted(set(p) | set(q)) if _compared(k) and p.get(k) != q.get(k)]  # fmt: skip
        same = not diffs and len(x["metrics"]) == len(y["metrics"]) and x["samples"] == y["samples"]
        print(f"{name}: {'identical' if same else 'DIFFERENT ' + ', '.join(sorted(set(diffs))[:8])}")
        bad += not same
    return 1 if bad else 0


NAMES = [*RUNS, "tinker"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--only", default=",".join(NAMES))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.only.split(","))
    else:
        raise SystemExit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
