"""What the update's time goes to, fp32 against bf16, by aten op (issue 61: "profile the bf16 step").

    .venv/bin/python experiments/profile_update.py                       # SmolLM2-135M, fp32 then bf16
    .venv/bin/python experiments/profile_update.py --dtype bfloat16
    .venv/bin/python experiments/profile_update.py --dtype float32 --lora 16

Runs `train.py grpo` in this process (GRPO 8 prompts x 8 samples, 48 tokens, 2 steps) with the second step's
update (`rlcore.step.update.update_step`) under torch.profiler, and prints its self CPU time by op group: the
matrix products (mm, addmm, bmm, linear's products), attention (scaled_dot_product_attention and its
backward), the log-softmax and the logits' gradient work (`rlcore.pure.token_logprobs`), dtype casts
(`to`, `copy_`), and the rest (elementwise and norms), with the top ops of each run.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from benchlib import lscpu_model  # noqa: E402

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_mkldnn", "mkldnn"),
    "attention": ("scaled_dot_product", "_flash_attention", "attention"),
    "log-softmax / logits grad": ("log_softmax", "softmax", "scatter_add", "gather", "_TokenLogprobs"),
    "casts and copies": ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous"),
}


def group_of(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "elementwise, norms, other"


def profile(model: str, dtype: str, lora: int) -> None:
    import train
    from rlcore.step import stages

    calls, original = [0], stages.update_step

    def profiled(*args, **kwargs):
        calls[0] += 1
        if calls[0] != 2:
            return original(*args, **kwargs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = original(*args, **kwargs)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        by_group: dict[str, float] = collections.defaultdict(float)
        for e in events:
            by_group[group_of(e.key)] += e.self_cpu_time_total
        print(f"### {dtype}{f', LoRA rank {lora}' if lora else ''}: the update's self CPU time {total / 1e6:.1f} s (profiled)")
        print("| group | s | share |\n|---|---|---|")
        for group, t in sorted(by_group.items(), key=lambda kv: -kv[1]):
            print(f"| {group} | {t / 1e6:.2f} | {100 * t / total:.0f}% |")
        print("| top op | s | share | calls |\n|---|---|---|---|")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
            print(f"| {e.key} | {e.self_cpu_time_total / 1e6:.2f} | {100 * e.self_cpu_time_total / total:.0f}% | {e.count} |")
        return out

    stages.update_step = profiled
    try:
        with tempfile.TemporaryDirectory() as out:
            code = train.main(["grpo", "--model.path", model, "--model.dtype", dtype, "--data.batch-size", "8",
                               "--rollout.n", "8", "--rollout.max-tokens", "48", "--trainer.steps", "2",
                               "--trainer.val-every", "0", "--data.builtin-val-size", "8", "--log.no-progress",
                               "--model.lora-rank", str(lora), "--out-dir", out])  # fmt: skip
    finally:
        stages.update_step = original
    assert code == 0, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], default=[])
    parser.add_argument("--model", default=None, help="a model path (default: SmolLM2-135M's GGUF file)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    args = parser.parse_args()
    from tests.real_model import smollm2_gguf

    model = args.model or str(smollm2_gguf())
    print(f"## profile_update, {datetime.date.today()}: {lscpu_model()} ({torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads); {model}")  # fmt: skip
    for dtype in args.dtype or ["float32", "bfloat16"]:
        profile(model, dtype, args.lora)


if __name__ == "__main__":
    main()
