"""Benchmark rlcore.pure against the per-sample loops and the naive log-softmax it replaces (issue 2).

    python experiments/bench_pure.py            # the full sizes recorded in experiments/README.md
    python experiments/bench_pure.py --quick    # small sizes, a few seconds (checks the script runs)

It reports and never asserts: every timing is the median of a few repeats, measured side by side in
one run, with the fp32 matmul peak and the copy bandwidth of the same machine as the floor.

a) Group advantages (grpo, rloo) at b = 16384 rows in groups of 16, t = 256, float32: vectorised
   `rlcore.pure.advantages` vs a per-sample Python loop in the style of verl 0.9.1's loop versions
   (a dict of lists per group id, torch.mean / torch.std per group). The two are compared first.
b) `token_logprobs` at 2,048 positions x 151,936 vocab, float32 logits: peak extra memory of
   forward + backward beyond the inputs, each variant in a fresh subprocess
   (ru_maxrss after backward minus ru_maxrss right after allocating the logits and labels).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rlcore.pure.advantages import grpo, rloo
from rlcore.pure.logprobs import token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import matmul_gflops, median_time


def copy_gbps(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth, GB/s, of a float32 copy (read + write = 2 x n_bytes)."""
    src = torch.randn(n_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * n_bytes / median_time(lambda: dst.copy_(src), repeats) / 1e9


# ---------------------------------------------------------------- a) advantages


def make_batch(b: int, g: int, t: int, seed: int = 0):
    """Outcome rewards on each row's last response token; groups of g rows with scattered labels."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)  # (b,)
    mask = (torch.arange(t) < lengths[:, None]).float()  # (b, t)
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.rand(b, generator=gen)
    group_ids = (torch.arange(b // g) * 7919 + 13).repeat_interleave(g)[
        torch.randperm(b, generator=gen)
    ]  # (b,)
    return rewards, mask, group_ids


def grpo_loop(token_rewards, response_mask, index, eps: float = 1e-6):
    """Per-sample loop as verl's compute_grpo_outcome_advantage: dict of lists, mean / std per group."""
    scores = token_rewards.sum(dim=-1)
    by_group, mean, std = defaultdict(list), {}, {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            by_group[index[i]].append(scores[i])
        for key, members in by_group.items():
            if len(members) == 1:
                mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(members)
                mean[key], std[key] = torch.mean(stacked), torch.std(stacked)
        for i in range(scores.shape[0]):
            scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
        out = scores.unsqueeze(-1) * response_mask
    return out, out


def rloo_loop(token_rewards, response_mask, index):
    """Per-sample loop as verl's compute_rloo_outcome_advantage: n/(n-1) (s_i - mean_g)."""
    scores = token_rewards.sum(dim=-1)
    by_group, mean = defaultdict(list), {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            by_group[index[i]].append(scores[i])
        for key, members in by_group.items():
            mean[key] = torch.tensor(0.0) if len(members) == 1 else torch.mean(torch.stack(members))
        for i in range(scores.shape[0]):
            n = len(by_group[index[i]])
            if n > 1:
                scores[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
        out = scores.unsqueeze(-1) * response_mask
    return out, out


def bench_advantages(b: int, g: int, t: int, loop_repeats: int, vec_repeats: int) -> list[dict]:
    rewards, mask, group_ids = make_batch(b, g, t)
    index = group_ids.numpy()  # verl passes the group uids as a numpy array
    rows = []
    for name, vec, loop in [("grpo", grpo, grpo_loop), ("rloo", rloo, rloo_loop)]:
        diff = (vec(rewards, mask, group_ids)[0] - loop(rewards, mask, index)[0]).abs().max().item()
        t_loop = median_time(lambda loop=loop: loop(rewards, mask, index), loop_repeats, warmup=0)
        t_vec = median_time(lambda vec=vec: vec(rewards, mask, group_ids), vec_repeats)
        rows.append({"name": name, "max_abs_diff": diff, "loop_s": t_loop, "vec_s": t_vec})
    return rows


# ---------------------------------------------------------------- b) token_logprobs memory


def _status_bytes(field: str) -> int:
    """A `Vm*` line of /proc/self/status (kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _run_variant(variant: str, logits, labels):
    variant = variant.removesuffix("-nograd")
    if variant == "naive":
        return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    chunk = None if variant == "chunked" else (16 * 2**20) // (4 * logits.shape[-1])  # "chunked-16MiB"
    return token_logprobs(logits, labels, chunk_size=chunk)


def mem_child(variant: str, n: int, v: int, out_path: str) -> None:
    """Runs in a fresh process: forward + backward of one variant; prints a JSON line.

    Extra memory = peak RSS during forward + backward minus the RSS right after allocating the
    logits and labels. The peak is VmHWM after resetting it (write 5 to /proc/self/clear_refs);
    ru_maxrss (never reset) gives the same number whenever that peak exceeds the import-time peak.
    """
    grad = not variant.endswith("-nograd")  # "-nograd": the old/ref log-prob pass, under no_grad
    torch.set_grad_enabled(grad)
    small = torch.randn(4, v).requires_grad_(grad)  # warm-up: thread pools and kernels initialise here
    warm = _run_variant(variant, small, torch.zeros(4, dtype=torch.long)).sum()
    if grad:
        warm.backward()
    torch.manual_seed(0)
    logits = torch.randn(n, v).requires_grad_(grad)  # (n, v) float32
    labels = torch.randint(0, v, (n,))
    base = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    times = []
    for i in range(2):  # the first pass is measured for memory; the second (warm) for time
        logits.grad = None
        t0 = time.perf_counter()
        out = _run_variant(variant, logits, labels)
        t1 = time.perf_counter()
        if grad:
            out.sum().backward()
        times.append((t1 - t0, time.perf_counter() - t1))
        if i == 0:
            peak = _status_bytes("VmHWM")
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save(out.detach(), out_path)
    record = {"extra_bytes": peak - base, "extra_maxrss_bytes": maxrss - base_maxrss, "base_bytes": base}
    record |= {
        "fwd_cold_s": times[0][0],
        "bwd_cold_s": times[0][1],
        "fwd_s": times[1][0],
        "bwd_s": times[1][1],
    }
    print(json.dumps(record))


VARIANTS = ("naive", "chunked", "chunked-16MiB", "naive-nograd", "chunked-nograd")  # chunked: ~64 MiB chunks


def bench_logprobs(n: int, v: int) -> dict:
    """Each variant in a fresh subprocess, one after the other; values compared with the naive path."""
    results, values = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            path = str(Path(tmp) / f"{variant}.pt")
            cmd = [
                sys.executable,
                __file__,
                "--mem-child",
                variant,
                "--n",
                str(n),
                "--v",
                str(v),
                "--out",
                path,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            values[variant] = torch.load(path)
    for variant in VARIANTS:
        results[variant]["max_abs_diff"] = (values[variant] - values["naive"]).abs().max().item()
    return results


# ---------------------------------------------------------------- report


def report_advantages(b: int, g: int, t: int, peak: float, bw: float, quick: bool) -> None:
    print(f"a) group advantages, b={b} (groups of {g}), t={t}, float32; median of repeats")
    print(
        f"{'estimator':<10}{'loop (s)':>10}{'rlcore (ms)':>13}{'speed-up':>10}{'max|diff|':>11}{'mem floor %':>13}"
    )
    # ~5 elementwise FLOPs per (b, t) element (select, multiply, add for the masked sum; broadcast
    # and mask for the output) is ~0.1 ms at the matmul peak: the work is memory-bound. The memory
    # floor is reading rewards + mask and writing the advantages once (12 bytes per element).
    flops, mem_bytes = 5 * b * t, 12 * b * t
    mem_floor = mem_bytes / (bw * 1e9)
    for row in bench_advantages(b, g, t, loop_repeats=1 if quick else 3, vec_repeats=10):
        print(
            f"{row['name']:<10}{row['loop_s']:>10.3f}{row['vec_s'] * 1e3:>13.2f}"
            f"{row['loop_s'] / row['vec_s']:>9.0f}x{row['max_abs_diff']:>11.1e}"
            f"{100 * mem_floor / row['vec_s']:>12.0f}%"
        )
    print(
        f"floors: compute {flops / 1e6:.0f} MFLOP at {peak:.0f} GFLOP/s = {flops / (peak * 1e9) * 1e3:.2f} ms; "
        f"memory {mem_bytes / 1e6:.0f} MB at {bw:.1f} GB/s = {mem_floor * 1e3:.2f} ms (memory-bound)\n"
    )


def report_logprobs(n: int, v: int, peak: float) -> None:
    full = n * v * 4
    print(f"b) token_logprobs fwd + bwd, {n} positions x {v} vocab, float32 logits ({full / 1e9:.2f} GB)")
    res = bench_logprobs(n, v)
    # FLOPs: ~5 per logit forward (max, subtract, exp, sum, log / gather); the backward recomputes
    # the softmax (~5) and scales it (~1): ~11 per logit for forward + backward.
    fwd_floor, all_floor = 5 * n * v / (peak * 1e9), 11 * n * v / (peak * 1e9)
    print(
        f"{'path':<15}{'extra (GB)':>11}{'x logits':>9}{'beyond grad':>13}{'fwd (s)':>9}{'bwd (s)':>9}"
        f"{'fwd floor':>11}{'all floor':>11}{'max|diff|':>11}"
    )
    for name in VARIANTS:
        r = res[name]
        print(
            f"{name:<15}{r['extra_bytes'] / 1e9:>11.2f}{r['extra_bytes'] / full:>9.2f}"
            + (f"{(r['extra_bytes'] - full) / full:>13.2f}" if "nograd" not in name else f"{'-':>13}")
            + f"{r['fwd_s']:>9.3f}{r['bwd_s']:>9.3f}"
            f"{100 * fwd_floor / r['fwd_s']:>10.1f}%{100 * all_floor / (r['fwd_s'] + r['bwd_s']):>10.1f}%"
            f"{r['max_abs_diff']:>11.1e}"
        )
    naive, ours = res["naive-nograd"]["extra_bytes"], res["chunked-nograd"]["extra_bytes"]
    print(f"log-prob pass (no grad) extra-memory ratio chunked / naive: {ours / naive:.3f} (target <= 0.25)")
    naive, ours = res["naive"]["extra_bytes"], res["chunked"]["extra_bytes"]
    print(
        f"forward + backward extra-memory ratio chunked / naive: {ours / naive:.3f} (floor 1/3: both return"
    )
    print(f"  a full gradient); not counting that gradient: {(ours - full) / (naive - full):.3f}")
    print(
        "  ru_maxrss cross-check (GB): "
        + ", ".join(f"{k} {res[k]['extra_maxrss_bytes'] / 1e9:.2f}" for k in VARIANTS)
    )
    speedup = (res["naive"]["fwd_s"] + res["naive"]["bwd_s"]) / (
        res["chunked"]["fwd_s"] + res["chunked"]["bwd_s"]
    )
    print(
        f"FLOP floors at {peak:.0f} GFLOP/s: forward {5 * n * v / 1e9:.2f} GFLOP = {fwd_floor * 1e3:.1f} ms; "
        f"forward + backward {11 * n * v / 1e9:.2f} GFLOP = {all_floor * 1e3:.1f} ms; "
        f"time naive / chunked (fwd + bwd, warm): {speedup:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    parser.add_argument("--mem-child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--v", type=int, default=151_936, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mem_child:
        mem_child(args.mem_child, args.n, args.v, args.out)
        return
    env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_NUM_THREADS"))}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, env {env}")
    peak, bw = matmul_gflops(), copy_gbps()
    print(f"fp32 matmul 2048^3: {peak:.1f} GFLOP/s; float32 copy bandwidth: {bw:.1f} GB/s\n")
    report_advantages(*((1024, 16, 64) if args.quick else (16384, 16, 256)), peak, bw, args.quick)
    report_logprobs(*((256, 32_000) if args.quick else (2048, 151_936)), peak)


if __name__ == "__main__":
    main()
