"""A scale model: synchronous vs asynchronous RL throughput at 8, 64 and 512 accelerators (issue 16).

    .venv/bin/python experiments/scale_model.py                    # the default assumptions, ~10 s
    .venv/bin/python experiments/scale_model.py --cpu-costs        # this machine's measured costs instead

A model in a script, not a toy cluster: one step is B prompts x n samples whose response lengths are
drawn from a long-tailed distribution; rollout and training costs come from a cost model whose
parameters are stated below (and can be set by flags). Three schedules:

- sync (colocated): every accelerator generates its share of the samples (continuous batching: a
  freed slot takes the next sample of the step), then every accelerator trains on the whole batch. A
  rollout lasts until its last sample ends: decode steps cost `t_step(live rows)`, and at the end the
  rows still decoding thin out into the long tail while each step still costs its fixed part.
- lag K=1 (what rlcore builds, `--pipeline.placement split --pipeline.max-staleness 1`): a fraction f of
  the accelerators generates, the rest train, at once; the period is max(rollout on f G, update on
  (1 - f) G) plus the weight push; f is chosen as the best of a grid. Each batch still waits for its
  longest sample.
- stream + partial rollout (verl fully async, AReaL; `--pipeline.mode stream` is not built in rlcore):
  rollout engines stay full — a slot freed by a finished sample takes a new prompt, samples in flight
  at a weight push continue — so the rollout side runs at full occupancy (its cost per token is that of
  a full decode batch, as many rows live as the slots and the K + 1 steps' samples allow) and the tail
  no longer sets the period, except that the longest sample must end within K + 1 periods.

Cost model (defaults: a 7B dense model on H100-class GPUs, bf16; assumptions, not measurements):
- decode step on one accelerator with b live rows: t_step(b) = `--step-fixed-ms` (reading the weights
  once per step: 14 GB at ~2 TB/s effective, ~7 ms, plus launch overhead) + b x `--step-row-ms` (KV
  reads and the per-row FLOPs at long contexts), up to `--max-batch` rows per engine;
- training: 6 x params x tokens at `--train-tflops` effective per accelerator (~40% MFU of ~1 PFLOP/s
  dense bf16), prompts included; the old-log-prob pass is not needed (one update per step);
- weight push: params x 2 bytes at `--push-gbps` (NCCL broadcast), once per step.
Workload (defaults): DAPO's recipe shape, 512 prompts x 16 samples, prompt 512 tokens, responses
lognormal with median 3,000 tokens and sigma 0.8, capped at 20,480 (DAPO's max response length): most
short, a long tail to the cap — the shape verl's and AReaL's papers describe, not their data.
`--cpu-costs` replaces the cost model by what this 2-core machine measured for rlcore's native engine
and update (the decode step of ~5.8 ms for 1 row, ~9 ms for 128; the update at ~55% of the fp32 peak),
for a 3M-parameter model: the same arithmetic at the other end of the scale.

Published speedups beside the model: verl fully async 2.35-2.67x on 128 GPUs (Qwen2.5-7B; its docs),
AReaL 2.77x (its paper's headline, up to 512 GPUs). Their systems add what the model leaves out
(rollout load balancing, dynamic batch sizes, prefix caches), and the model leaves out what they pay
(staleness limits, queueing, stragglers in training).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random


@dataclasses.dataclass(frozen=True)
class Costs:
    params: float
    step_fixed_s: float
    step_row_s: float
    max_batch: int
    train_flops: float
    push_bytes_per_s: float


def gpu_costs(args: argparse.Namespace) -> Costs:
    return Costs(params=args.params, step_fixed_s=args.step_fixed_ms / 1e3, step_row_s=args.step_row_ms / 1e3,
                 max_batch=args.max_batch, train_flops=args.train_tflops * 1e12,
                 push_bytes_per_s=args.push_gbps * 1e9 / 8)  # fmt: skip


def cpu_costs() -> Costs:
    """This machine, rlcore's native engine and update (experiments/README.md, FACTS.md)."""
    return Costs(params=3.0e6, step_fixed_s=5.8e-3, step_row_s=0.025e-3, max_batch=10**6,
                 train_flops=0.55 * 200e9, push_bytes_per_s=1e9)  # fmt: skip


def lengths(count: int, median: float, sigma: float, cap: int, rng: random.Random) -> list[int]:
    return [
        min(cap, max(1, round(math.exp(math.log(median) + sigma * rng.gauss(0, 1))))) for _ in range(count)
    ]


def rollout_s(samples: list[int], engines: int, c: Costs) -> float:
    """Time to decode one step's `samples` on `engines` (dealt round-robin), each with continuous
    batching: `max_batch` slots, a finished sample's slot takes the next queued one. An engine runs
    until its last sample ends (the tail); a decode step costs t_step(live rows), so its time is
    step_fixed x steps + step_row x tokens. The slowest engine sets the rollout's time."""
    slowest = 0.0
    for e in range(engines):
        mine = samples[e::engines]
        free = [0] * min(c.max_batch, len(mine))  # the step at which each slot is free again
        heapq.heapify(free)
        end = 0
        for length in mine:
            done = heapq.heappop(free) + length
            end = max(end, done)
            heapq.heappush(free, done)
        slowest = max(slowest, end * c.step_fixed_s + sum(mine) * c.step_row_s)
    return slowest


def stream_rollout_s(samples: list[int], engines: int, c: Costs, *, staleness: int = 1) -> float:
    """Streaming with partial rollouts: freed slots take new prompts across steps, so no step waits for
    a tail; each engine keeps as many rows live as it has slots, or as the staleness bound lets exist
    at once (the samples of K + 1 steps)."""
    tokens = sum(samples) / engines
    rows = min(c.max_batch, (staleness + 1) * len(samples) / engines)
    step = c.step_fixed_s + rows * c.step_row_s
    longest = max(samples) * step / (staleness + 1)  # the longest sample must end within K + 1 periods
    return max(tokens / rows * step, longest)


def update_s(tokens: float, accelerators: int, c: Costs) -> float:
    return 6 * c.params * tokens / (c.train_flops * accelerators)


def step_times(g: int, samples: list[int], prompt: int, c: Costs, k: int) -> dict[str, float]:
    tokens = sum(samples) + prompt * len(samples)
    push = 2 * c.params / c.push_bytes_per_s
    sync = rollout_s(samples, g, c) + update_s(tokens, g, c)
    lag, stream = math.inf, math.inf
    for r in sorted({min(g - 1, max(1, round(g * i / 32))) for i in range(1, 32)}):  # r generate, g - r train
        train = update_s(tokens, g - r, c) + push
        lag = min(lag, max(rollout_s(samples, r, c), train))
        stream = min(stream, max(stream_rollout_s(samples, r, c, staleness=k), train))
    return {"sync": sync, "lag": lag, "stream": stream}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cpu-costs",
        action="store_true",
        help="this machine's measured costs (a 3M model), at 2, 4, 8 units",
    )
    p.add_argument("--params", type=float, default=7e9)
    p.add_argument("--step-fixed-ms", type=float, default=9.0)
    p.add_argument("--step-row-ms", type=float, default=0.04)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--train-tflops", type=float, default=400.0)
    p.add_argument("--push-gbps", type=float, default=400.0)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--median", type=float, default=3000.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--cap", type=int, default=20480)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-staleness", type=int, default=1, help="K of the streaming schedule")
    args = p.parse_args()
    c = cpu_costs() if args.cpu_costs else gpu_costs(args)
    if args.cpu_costs:  # the bench_async workload: 16 x 8, geometric lengths of mean ~17, at most 128
        args.prompts, args.n, args.prompt_tokens, args.median, args.sigma, args.cap = (
            16,
            8,
            15,
            12.0,
            0.9,
            128,
        )
    rng = random.Random(args.seed)
    samples = lengths(args.prompts * args.n, args.median, args.sigma, args.cap, rng)
    mean = sum(samples) / len(samples)
    print(f"{len(samples)} samples per step: mean {mean:.0f} tokens, median {sorted(samples)[len(samples) // 2]}, "
          f"max {max(samples)}; model {c.params / 1e9:.3g}B params")  # fmt: skip
    print(f"{'accelerators':>12} {'sync s/step':>12} {'lag K=1':>14} {'stream+partial':>16}")
    for g in (2, 4, 8) if args.cpu_costs else (8, 64, 512):
        t = step_times(g, samples, args.prompt_tokens, c, args.stream_staleness)
        print(f"{g:>12} {t['sync']:>12.1f} {t['lag']:>8.1f} {t['sync'] / t['lag']:>4.2f}x "
              f"{t['stream']:>9.1f} {t['sync'] / t['stream']:>5.2f}x")  # fmt: skip
    print("published: verl fully async 2.35-2.67x (128 GPUs, Qwen2.5-7B); AReaL 2.77x")


if __name__ == "__main__":
    main()
