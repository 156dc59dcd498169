"""Shared measuring helpers of the benchmarks: median wall time and the machine's matmul peak."""

from __future__ import annotations

import statistics
import subprocess
import time

import torch


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(
    n: int = 2048, repeats: int = 5, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """Matmul throughput, GFLOP/s, on an n^3 product (2 n^3 FLOPs) in `dtype` on `device` (default: the
    fp32 CPU peak the floors are measured against)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))

    def product() -> None:
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()

    return 2 * n**3 / median_time(product, repeats) / 1e9


def rollout(input_ids, attention_mask, responses, response_attention):
    """A rolled-out `rlcore.batch.Batch` of these tensors, every attended response token trained on."""
    from rlcore.batch import Batch  # here: vs_verl_math imports this module where only rlcore.pure is

    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "responses": responses,
            "response_attention": response_attention,
            "response_mask": response_attention,
        }
    )


def lscpu_model() -> str:
    """The CPU's model name as `lscpu` prints it (benchmarks print it beside the ISA)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
