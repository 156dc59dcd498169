"""Exact mode's row layouts (issue 55): whether each keeps a row's bits on this CPU, and what each costs,
side by side, natively and under oneDNN's ISA caps.

    .venv/bin/python experiments/bench_exact_rows.py            # this CPU, then capped at AVX512_CORE and AVX2
    .venv/bin/python experiments/bench_exact_rows.py --quick    # a smoke run: checks the script
    .venv/bin/python experiments/bench_exact_rows.py --isa AVX2 # one setting (the cap must be set before
                                                                # oneDNN first runs: each setting is its own process)

Per setting: the CPU (`lscpu`'s model name and `cpu_isa`), the matmul peak (2048^3, fp32 and bf16), and per
dtype and layout (`exact_check.CANDIDATES`):
- holds: `exact_check.row_invariant` on every SmolLM2-135M product shape (q/o 576x576, k/v 192x576, gate/up
  1536x576, down 576x1536, head 49152x576);
- decode: one pass of all SmolLM2 products (30 layers' 7, then the head) on 1, 4 and 16 rows, as the
  engine's decode step runs them; trainer: the same on 512 rows, as a trainer forward's micro-batch does;
  seconds, the ratio to the default layout's, the floor (FLOPs / peak) and % of it reached.
With the model (not --quick; native setting only): an exact SmolLM2 trainer forward (2 x 512 tokens) and an
engine generate (4 prompts x 4 samples, 32 tokens) in each layout, fp32 and bf16. Reports, never asserts;
the results go to experiments/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

SETTINGS = ("native", "AVX512_CORE", "AVX2")
"""oneDNN ISA settings measured: as the CPU is, then capped (MKL capped alike)."""

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down
HEAD = (49152, 576)
LAYERS = 30


def pass_seconds(rows: int, dtype, layout, repeats: int) -> tuple[float, float]:
    """(median seconds of one pass of every SmolLM2 product on `rows` rows in `layout`, its FLOPs)."""
    import torch
    from benchlib import median_time

    from rlcore.models.exact_kernels import packed_or_plain, product

    generator = torch.Generator().manual_seed(0)
    weights = [packed_or_plain(torch.randn(s, generator=generator).to(dtype)) for s in [*LAYER, HEAD]]
    xs = {k: torch.randn((rows, k), generator=generator).to(dtype) for k in {s[1] for s in [*LAYER, HEAD]}}

    def run() -> None:
        for _ in range(LAYERS):
            for (_, k), w in zip(LAYER, weights, strict=False):
                product(xs[k], w, rows=layout)
        product(xs[HEAD[1]], weights[-1], rows=layout)

    flops = 2 * rows * (LAYERS * sum(n * k for n, k in LAYER) + HEAD[0] * HEAD[1])
    return median_time(run, repeats=repeats), flops


def measure(quick: bool) -> None:
    """This process's setting: the CPU, the peaks, and per dtype and layout whether it holds and its cost."""
    import torch
    from benchlib import lscpu_model, matmul_gflops

    from rlcore.models import exact_check
    from rlcore.models.onednn import cpu_isa

    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "native")
    peaks = {d: matmul_gflops(2048, dtype=d, device="cpu") * 1e9 for d in (torch.float32, torch.bfloat16)}
    print(f"\n## {cap}: {lscpu_model()} ({cpu_isa()}), {torch.get_num_threads()} threads, matmul peak "
          f"fp32 {peaks[torch.float32] / 1e9:.0f}, bf16 {peaks[torch.bfloat16] / 1e9:.0f} GFLOP/s", flush=True)  # fmt: skip
    print("| dtype | layout | holds | decode 1 / 4 / 16 rows s (x default) | trainer 512 rows s (x default) | "
          "trainer floor s | % of floor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    cpu = torch.device("cpu")
    shapes = [*LAYER, HEAD]
    counts = (1, 4, 16)
    big = 128 if quick else 512
    for dtype in (torch.float32, torch.bfloat16):
        base: dict[int, float] = {}
        for layout in exact_check.CANDIDATES:
            holds = all(exact_check.row_invariant(layout, n, k, dtype, cpu, batched=False) for n, k in shapes)
            decode = [pass_seconds(m, dtype, layout, 1 if quick else 3)[0] for m in counts]
            trainer, flops = pass_seconds(big, dtype, layout, 1 if quick else 2)
            times = dict(zip((*counts, big), (*decode, trainer), strict=True))
            base = base or times
            ratio = {m: t / base[m] for m, t in times.items()}
            floor = flops / peaks[dtype]
            print(f"| {str(dtype).removeprefix('torch.')} | {layout.name} | {'yes' if holds else 'NO'} | "
                  + " / ".join(f"{times[m]:.3f} ({ratio[m]:.2f}x)" for m in counts)
                  + f" | {trainer:.3f} ({ratio[big]:.2f}x) | {floor:.3f} | {100 * floor / trainer:.0f}% |", flush=True)  # fmt: skip


def model_runs() -> None:
    """An exact SmolLM2 trainer forward and engine generate in each layout, fp32 and bf16 (side by side)."""
    import torch
    from bench_real import find_model

    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import Row
    from rlcore.models import exact_check, exact_kernels, load_policy
    from rlcore.models.exact import make_exact
    from rlcore.rollout import NativeEngine, SamplingParams

    path = str(find_model())
    print("\n| dtype | layout | trainer forward 2 x 512 tokens s (x) | generate 4 x 4 x 32 tokens s (x) |")
    print("|---|---|---|---|")
    prompts = ["What is 2 + 2?", "Name a colour.", "Count to three.", "Say hi."]
    for dtype in (torch.float32, torch.bfloat16):
        model, tokenizer = load_policy(path)
        model = make_exact(model.to(dtype).eval())
        rows = [Row(data_source="x", prompt=[{"role": "user", "content": p}]) for p in prompts]
        batch = make_prompt_batch(rows, tokenizer)
        ids = torch.randint(3, 40000, (2, 512), generator=torch.Generator().manual_seed(0))
        scored = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        base = None
        for layout in exact_check.CANDIDATES:
            exact_kernels.ROWS[dtype] = layout
            exact_kernels.ROWS[torch.float32] = layout if dtype == torch.float32 else exact_kernels.ROWS[torch.float32]
            start = time.perf_counter()
            with torch.no_grad():
                model(**scored)
            forward = time.perf_counter() - start
            start = time.perf_counter()
            out = NativeEngine(model, tokenizer).generate(batch, SamplingParams(n=4, max_tokens=32, seed=0))
            generate = time.perf_counter() - start
            base = base or (forward, generate)
            print(f"| {str(dtype).removeprefix('torch.')} | {layout.name} | {forward:.2f} ({forward / base[0]:.2f}x) | "
                  f"{generate:.2f} ({generate / base[1]:.2f}x) |", flush=True)  # fmt: skip
            del out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--isa", choices=SETTINGS, help="measure one setting in this process")
    args = parser.parse_args()
    if args.isa is not None:
        measure(args.quick)
        if args.isa == "native" and not args.quick:
            model_runs()
        return
    print(f"# bench_exact_rows {datetime.date.today()}")
    for setting in SETTINGS:
        env = dict(os.environ)
        if setting != "native":
            env["ONEDNN_MAX_CPU_ISA"] = setting
            env["MKL_ENABLE_INSTRUCTIONS"] = "AVX512" if setting.startswith("AVX512") else setting
        flags = ["--isa", setting, *(["--quick"] if args.quick else [])]
        subprocess.run([sys.executable, __file__, *flags], env=env, check=True)


if __name__ == "__main__":
    main()
