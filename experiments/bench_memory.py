"""Peak memory against the optimizer floor, and step time, per model x full/LoRA x fp32/bf16 x engine (issue 61).

    .venv/bin/python experiments/bench_memory.py                   # SmolLM2-135M variants (~20 min)
    .venv/bin/python experiments/bench_memory.py --qwen            # + Qwen2.5-0.5B/1.5B-shaped models (~25 min more)
    .venv/bin/python experiments/bench_memory.py --only smollm2/default --only smollm2/rows

Each variant is one `train.py grpo` process on the reverse task (`--trainer.steps 2`, the Qwen shapes 1), its
resident memory sampled every 20 ms over the whole process tree (a vLLM engine's own processes included).
Printed per variant: the tree's peak, the trainer's `perf/max_memory_mb` and its update-phase peak, the floor
(16 bytes per trained parameter for full fine-tuning; for LoRA the frozen weights' bytes plus 16 per adapter
parameter) and the ratio, the parts the run logs (`perf/mem/*`, `perf/mem/saved_tensors_mb`), the
estimate `rlcore.models.footprint` makes before loading, and the last step's time beside its FLOP floor
(6 x parameters x trained tokens + 2 x parameters x sampled tokens over the matmul peak measured here).

The Qwen shapes are random-init directories (Qwen2.5's config.json fields, SmolLM2's tokenizer: its ids beyond
the tokenizer's 49,152 are sampled and decoded as Qwen's padded vocabulary is), written once under
/tmp/rlcore-bench-models.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from benchlib import lscpu_model, matmul_gflops  # noqa: E402

MODELS = Path("/tmp/rlcore-bench-models")
QWEN = {  # Qwen2.5-0.5B / 1.5B-Instruct config.json fields that give the shape
    "qwen0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                 "num_key_value_heads": 2},
    "qwen1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                 "num_key_value_heads": 2},
}  # fmt: skip
SMOL = ["--data.batch-size", "8", "--rollout.n", "8", "--rollout.max-tokens", "48", "--trainer.steps", "2"]
QWEN_RUN = ["--data.batch-size", "8", "--rollout.n", "4", "--rollout.max-tokens", "128", "--trainer.steps", "1"]
VARIANTS = {
    "smollm2/rows": ["--algo.max-tokens-per-micro-batch", "100000"],  # one micro-batch: before issue 61
    "smollm2/default": [],
    "smollm2/256-tokens": ["--algo.max-tokens-per-micro-batch", "256"],
    "smollm2/checkpointing": ["--model.activation-checkpointing"],
    "smollm2/selective": ["--model.selective-checkpointing"],  # the default budget: larger micro-batches
    "smollm2/selective-1058": ["--model.selective-checkpointing", "--algo.max-tokens-per-micro-batch", "1058"],
    "smollm2/bf16": ["--model.dtype", "bfloat16"],
    "smollm2/bf16-compute": ["--model.compute-dtype", "bfloat16"],
    "smollm2/lora16": ["--model.lora-rank", "16"],
    "smollm2/lora16-no-copy": ["--model.lora-rank", "16", "--rollout.no-lora-merged-copy"],
    "smollm2/vllm": ["--rollout.engine", "vllm"],
    "qwen0.5b/default": [],
    "qwen1.5b/lora16": ["--model.lora-rank", "16"],
    "qwen1.5b/lora16-no-copy": ["--model.lora-rank", "16", "--rollout.no-lora-merged-copy"],
}


def qwen_dir(name: str) -> Path:
    """A random-init directory of the shape, with SmolLM2's tokenizer (written once)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlcore.models.policy import load_tokenizer
    from tests.real_model import smollm2_gguf

    path = MODELS / name
    if (path / "config.json").is_file():
        return path
    config = Qwen2Config(**QWEN[name], vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(str(smollm2_gguf())).save_pretrained(path)
    return path


def tree_rss(pid: int) -> int:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def run(name: str, model: str, extra: list[str]) -> dict:
    base = QWEN_RUN if name.startswith("qwen") else SMOL
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / "train.py"), "grpo", "--model.path", model, *base, *extra,
               "--trainer.val-every", "0", "--data.builtin-val-size", "8", "--log.no-progress", "--out-dir", out]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss(proc.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stdout, stderr = proc.communicate()
        done.set()
        sampler.join()
        if proc.returncode != 0:
            return {"error": (stderr.strip().splitlines() or ["?"])[-1]}
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        config = json.loads((Path(out) / "config.json").read_text())
    found = re.search(r"prompt tokens p50 (\d+).*max (\d+)", stderr)
    p50, longest = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    return {"tree_peak_mb": peak[0] / 2**20, "prompt_p50": p50, "prompt_max": longest, "last": records[-1], "records": records, "config": config,
            "defaults": [line for line in stdout.splitlines() if "(default for" in line]}  # fmt: skip


def floor_and_estimate(model: str, extra: list[str], config: dict, prompt: int) -> tuple[float, float, int, int]:
    """(optimizer floor MiB, footprint estimate MiB, parameters, trained parameters)."""
    from configs import Config
    from rlcore.config.defaults import resolve
    from rlcore.config.fits import setup_of
    from rlcore.config.model_checks import model_config
    from rlcore.models.footprint import Shape, estimate
    from rlcore.trainer.cli import parse

    shape = Shape.of(model_config(model))
    cfg: Config = resolve(parse(["grpo", "--model.path", model, *extra]))
    a = config["algo"]
    cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, max_tokens_per_micro_batch=a["max_tokens_per_micro_batch"]),
                              data=dataclasses.replace(cfg.data, batch_size=config["data"]["batch_size"]),
                              rollout=dataclasses.replace(cfg.rollout, n=config["rollout"]["n"],
                                                          max_tokens=config["rollout"]["max_tokens"]))  # fmt: skip
    lora = cfg.model.lora_rank
    trained = shape.lora_params(lora) if lora else shape.params
    dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    floor = (shape.params * dtype_bytes + 16 * trained) if lora else 16 * shape.params
    return floor / 2**20, estimate(shape, setup_of(cfg, shape, 1, prompt)).peak / 2**20, shape.params, trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qwen", action="store_true", help="also the Qwen2.5-0.5B/1.5B-shaped models")
    parser.add_argument("--only", action="append", default=[], help="run only these variants")
    args = parser.parse_args()
    from tests.real_model import smollm2_gguf

    names = args.only or [n for n in VARIANTS if args.qwen or n.startswith("smollm2")]
    fp32 = matmul_gflops(2048)
    bf16 = matmul_gflops(2048, dtype=torch.bfloat16)
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"## bench_memory, {datetime.date.today()}: {lscpu_model()} ({isa}, {torch.get_num_threads()} threads); "
          f"matmul 2048^3 fp32 {fp32:.0f} GFLOP/s, bf16 {bf16:.0f} GFLOP/s")  # fmt: skip
    print("| variant | tree peak MiB | trainer peak MiB | update peak MiB | floor MiB | peak / floor | estimate MiB | "
          "saved tensors MiB | micro-batch tokens | step s | update s | rollout s | FLOP floor s | % of floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        family = name.split("/")[0]
        model = str(smollm2_gguf()) if family == "smollm2" else str(qwen_dir(family))
        r = run(name, model, VARIANTS[name])
        if "error" in r:
            print(f"| {name} | error: {r['error']} |")
            continue
        last = r["last"]
        floor, est, params, _ = floor_and_estimate(model, VARIANTS[name], r["config"], r["prompt_max"])
        rows = r["config"]["data"]["batch_size"] * r["config"]["rollout"]["n"]
        sampled = rows * last["response/length_mean"]
        fed = sampled + rows * r["prompt_p50"]
        train_flops = (6 if not r["config"]["model"]["lora_rank"] else 4) * params * fed
        flops = train_flops + 2 * params * sampled
        peak_gflops = bf16 if "bf16" in name else fp32
        floor_s = flops / (peak_gflops * 1e9)
        print(f"| {name} | {r['tree_peak_mb']:.0f} | {last['perf/max_memory_mb']:.0f} | "
              f"{last.get('perf/mem/update_peak_mb', float('nan')):.0f} | {floor:.0f} | "
              f"{r['tree_peak_mb'] / floor:.2f} | {est:.0f} | {last.get('perf/mem/saved_tensors_mb', float('nan')):.0f} | "
              f"{r['config']['algo']['max_tokens_per_micro_batch']} | {last['timing/step_s']:.1f} | "
              f"{last['timing/update_s']:.1f} | {last['timing/rollout_s']:.1f} | {floor_s:.1f} | "
              f"{100 * floor_s / last['timing/step_s']:.0f}% |", flush=True)  # fmt: skip
        parts = {k.removeprefix("perf/mem/"): round(v) for k, v in last.items() if k.startswith("perf/mem/")}
        print(f"|   parts (MiB): {json.dumps(parts)} |", flush=True)


if __name__ == "__main__":
    main()
