"""Mixture of experts: routing agreement and log-prob gap with and without routing replay (R3), and its cost.

    .venv/bin/python experiments/bench_moe.py           # the run in experiments/README.md: ~4 minutes
    .venv/bin/python experiments/bench_moe.py --quick   # small models, 1 repeat, ~40 s: checks it runs
    .venv/bin/python experiments/bench_moe.py --threads 2 --repeats 5

Issue 36. Two Qwen3-MoE models (`Qwen3MoeForCausalLM`), each in fp32 and in bf16 compute (the engine
and the trainer run the same module, converted with `model.to(torch.bfloat16)`):
- `builtin:tiny-moe` (4 layers, 8 experts, top-2; its warm-started weights when
  rlcore/models/weights/tiny-moe/ holds them, else the seeded random init) on `reverse` prompts;
- `random-100m`: a random-init Qwen3-MoE of ~98M parameters (vocab 32000, hidden 512, 8 layers, 8
  heads / 4 kv heads of 64, 16 experts of width 384, top-2, renormalised, tied embeddings; 32M
  active), on random prompt ids. Its routers are re-drawn from normal(0, 0.02) by a seeded generator:
  `Qwen3MoeTopKRouter` is built with zero weights (every token would tie) and only transformers'
  `_init_weights` (5.19: normal(0, initializer_range)) makes them non-degenerate.

Accuracy, per (model, dtype): one rollout of `NativeEngine(record_routes=True)` (temperature 1), then
- agreement: per MoE layer, the share of response tokens whose expert set in the trainer's own full
  forward (`rlcore.models.moe.own_routes`) is the one the engine recorded in its KV-cached decode
  (`rlcore.pure.routing.route_agreement`); the mean over layers and the least agreeing layer, and the
  share of response tokens routed differently in at least one layer;
- gap: |trainer log-prob - rollout_logprobs| over response tokens, mean and max, for
  `compute_logprobs` without the route fields (the trainer routes by itself) and with them (replay).

Costs, side by side (same seed; one warm-up each, then 5 (tiny-moe) or 3 (random-100m) pairs, the
order flipped every pair): rollout with and without recording (`record_routes`); `compute_logprobs`
with and without replay; one training forward + backward (`model_inputs` + `response_logprobs`,
masked sum) with and without replay. Reported: the median CPU seconds of the process (with the default
1 thread, the work done, whatever share of the cores other jobs leave), and the with / without ratio
as the median of the pairs' ratios with their range, in CPU and in wall time. random-100m in bf16 is
not timed: this machine is AVX2 only, with no fast bf16 kernel (bf16 `F.linear` runs at ~1/6 of fp32,
a plain `a @ b` at ~1/50).

Floors: forward FLOPs = 2 x (body x tokens + vocab x hidden x logit rows), fwd + bwd 3x that, at the
`F.linear` throughput (per CPU second) of the same dtype measured at the start of the run with the
same threads, on a (512, 512) x (2048, 512)^T product (the models' layer shape). body = the
non-expert, non-embedding parameters + top_k / num_experts of the expert parameters (the active
parameters but the embedding); tokens = every real token the pass feeds (the rollout: each prompt
once + each fed response token; the trainer: each row's prompt + response); logit rows = positions
whose logits are computed. Attention scores are left out (sequences <= 80 tokens). Reports, never
asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from rlcore.batch import Batch  # noqa: E402
from rlcore.data.prompts import make_prompt_batch  # noqa: E402
from rlcore.data.rows import row_from_dict  # noqa: E402
from rlcore.data.tasks import generate_rows  # noqa: E402
from rlcore.models.forward import (  # noqa: E402
    compute_logprobs,
    model_inputs,
    response_logprobs,
    sequence_tensors,
)
from rlcore.models.moe import own_routes, router_tap, routers  # noqa: E402
from rlcore.models.policy import load_policy  # noqa: E402
from rlcore.pure.routing import route_agreement  # noqa: E402
from rlcore.rollout import NativeEngine, SamplingParams  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RANDOM_SIZES = {
    "full": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, num_experts=16, moe_intermediate_size=384),
    "quick": dict(vocab_size=4000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, num_experts=8, moe_intermediate_size=64),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One (model, dtype) row: its rollout shape and how many times its costs are timed."""

    model: str
    dtype: str
    prompts: int
    n: int
    max_tokens: int
    repeats: int
    """Timed pairs (0: not timed)."""


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(m, d, 4, 2, 8, 1) for m in ("tiny-moe", "random") for d in DTYPES]
    return [
        Case("tiny-moe", "fp32", 16, 4, 48, 5),
        Case("tiny-moe", "bf16", 16, 4, 48, 5),
        Case("random-100m", "fp32", 8, 4, 32, 3),
        Case("random-100m", "bf16", 8, 4, 32, 0),
    ]


class _Tok:
    """Enough of a tokenizer for the engine on a model without one: no stop strings, eos 1."""

    pad_token_id, eos_token_id = 0, 1


def random_moe(sizes: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The random-init Qwen3-MoE of `sizes` (seed 0), routers from normal(0, 0.02), in `dtype`."""
    config = Qwen3MoeConfig(**sizes, intermediate_size=sizes["moe_intermediate_size"], num_experts_per_tok=2,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=True, max_position_embeddings=512,
                            pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in routers(model):
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.02)
    return model.to(dtype).eval()


def random_prompts(count: int, vocab: int, lengths: tuple[int, int]) -> Batch:
    """`count` left-padded prompts of random ids in [3, vocab), lengths drawn from `lengths`."""
    g = torch.Generator().manual_seed(1)
    width = lengths[1]
    length = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g)
    mask = (torch.arange(width) >= width - length[:, None]).long()
    ids = torch.randint(3, vocab, (count, width), generator=g) * mask
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask})


def reverse_prompts(tokenizer, count: int) -> Batch:
    rows = [row_from_dict(r, "builtin:reverse") for r in generate_rows("reverse", "train", count)]
    return make_prompt_batch(rows, tokenizer)


def build(case: Case, quick: bool) -> tuple[torch.nn.Module, object, Batch]:
    """(model, tokenizer, prompts) of `case`."""
    dtype = DTYPES[case.dtype]
    if case.model == "tiny-moe":
        model, tokenizer = load_policy("builtin:tiny-moe")
        return model.to(dtype).eval(), tokenizer, reverse_prompts(tokenizer, case.prompts)
    sizes = RANDOM_SIZES["quick" if quick else "full"]
    prompts = random_prompts(case.prompts, sizes["vocab_size"], (8, 24) if not quick else (4, 8))
    return random_moe(sizes, dtype), _Tok(), prompts


def param_counts(model: torch.nn.Module) -> dict[str, float]:
    """total, active (non-expert + top_k / E of the experts), body (active without the embedding) and
    head (vocab x hidden) parameters."""
    tap = router_tap(model)
    named = dict(model.named_parameters())  # tied weights once
    expert = sum(p.numel() for name, p in named.items() if ".experts." in name)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in named.values())
    active = total - expert + expert * tap.top_k / tap.num_experts
    body = active - embed.numel() - (0 if head is embed else head.numel())
    return {"total": total, "active": active, "body": body, "head": head.numel()}


def without_routes(batch: Batch) -> Batch:
    return batch.select(*[k for k in batch.keys() if not k.endswith("_routes")])  # noqa: SIM118 (no __iter__)


def accuracy(model: torch.nn.Module, rollout: Batch) -> dict[str, float]:
    """Router agreement on the response tokens, and the trainer-rollout log-prob gap without and with
    replay."""
    inputs = sequence_tensors(rollout)
    own = own_routes(model, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                     position_ids=inputs.position_ids, logits_to_keep=1)  # fmt: skip
    response = inputs.token_kind == 2
    agree = route_agreement(own, inputs.routes, response)  # (L,)
    recorded = response & (inputs.routes >= 0).all(dim=(1, 2))
    same = (own.sort(dim=-1).values == inputs.routes.sort(dim=-1).values).all(dim=-1).all(dim=-1)  # (N,)
    mask = rollout["response_mask"] != 0
    out = {"tokens": float(mask.sum()), "agree": float(agree.mean()), "agree_min": float(agree.min()),
           "flipped": float((~same & recorded).sum() / recorded.sum().clamp(min=1))}  # fmt: skip
    for name, batch in (("plain", without_routes(rollout)), ("replay", rollout)):
        logprobs, _ = compute_logprobs(model, batch, share_prompts=False)
        gap = (logprobs - rollout["rollout_logprobs"]).abs()[mask]
        out |= {f"{name}_mean": float(gap.mean()), f"{name}_max": float(gap.max())}
    return out


def linear_gflops(dtype: torch.dtype, repeats: int = 3) -> float:
    """Throughput, GFLOP/s of CPU time, of `F.linear` on a (512, 512) x (2048, 512)^T product in
    `dtype`: the models' layer shape and layout (a plain `a @ b` takes a slower bf16 path here)."""
    x, w = torch.randn(512, 512).to(dtype), torch.randn(2048, 512).to(dtype)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        started = time.process_time()
        torch.nn.functional.linear(x, w)
        times.append(time.process_time() - started)
    return 2 * 512 * 512 * 2048 / min(times) / 1e9


def paired(with_: Callable[[], object], without: Callable[[], object], repeats: int) -> dict[str, float]:
    """`with_` and `without` run in turn `repeats` times after one warm-up each (the order flipped
    every repeat): the median CPU seconds of each, and the with / without ratio as the median of the
    repeats' ratios and their range, of CPU time and of wall time."""
    with_(), without()
    cpu: dict[str, list[float]] = {"with": [], "without": []}
    wall: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(repeats):
        pair = [("with", with_), ("without", without)]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            started, started_cpu = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - started_cpu)
            wall[name].append(time.perf_counter() - started)
    out = {name: statistics.median(runs) for name, runs in cpu.items()}
    for kind, times in (("cpu", cpu), ("wall", wall)):
        ratios = [a / b for a, b in zip(times["with"], times["without"], strict=True)]
        out |= {kind: statistics.median(ratios), f"{kind}_min": min(ratios), f"{kind}_max": max(ratios)}
    return out


def train_step(model: torch.nn.Module, batch: Batch) -> Callable[[], None]:
    """One training forward + backward of the masked log-prob sum over `batch` (routes replayed when
    the batch carries them)."""
    inputs = model_inputs(model, batch, share_prompts=False)
    mask = batch["response_mask"]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logprobs, _ = response_logprobs(model, inputs)
        (logprobs * mask[:, : logprobs.shape[1]]).sum().backward()

    return step


def rollout_fn(engine: NativeEngine, prompts: Batch, sampling: SamplingParams, model) -> Callable[[], Batch]:
    tap = router_tap(model)

    def run() -> Batch:
        tap.set_replay(None)  # a non-recording engine keeps a replay a trainer forward left set
        return engine.generate(prompts, sampling)

    return run


def costs(model, tokenizer, prompts: Batch, sampling: SamplingParams, rollout: Batch, repeats: int) -> dict:
    """Median seconds with / without routes of the rollout, the log-prob pass and a training step."""
    plain_engine = NativeEngine(model, tokenizer, record_routes=False)
    record_engine = NativeEngine(model, tokenizer, record_routes=True)
    rollout_s = paired(rollout_fn(record_engine, prompts, sampling, model),
                       rollout_fn(plain_engine, prompts, sampling, model), repeats)  # fmt: skip
    plain = without_routes(rollout)
    logprobs_s = paired(lambda: compute_logprobs(model, rollout, share_prompts=False),
                        lambda: compute_logprobs(model, plain, share_prompts=False), repeats)  # fmt: skip
    train_s = paired(train_step(model, rollout), train_step(model, plain), repeats)
    model.zero_grad(set_to_none=True)
    same = torch.equal(plain_engine.generate(prompts, sampling)["responses"], rollout["responses"])
    return {"rollout": rollout_s, "logprobs": logprobs_s, "train": train_s, "same_tokens": same}


def flops(model, prompts: Batch, rollout: Batch) -> dict[str, float]:
    """Forward FLOPs of the rollout (each prompt once, each fed response token) and of one trainer
    pass (each row's prompt + response); the train step is 3x the trainer's."""
    counts = param_counts(model)
    body, head = counts["body"], counts["head"]
    fed = float((rollout["response_routes"][:, :, 0, 0] >= 0).sum())  # the last sampled token is never fed
    prompt_tokens = float(prompts["attention_mask"].sum())
    rows_tokens = float(rollout["attention_mask"].sum() + rollout["response_mask"].sum())
    response = float(rollout["response_mask"].sum())
    forward_rollout = 2 * (body * (prompt_tokens + fed) + head * (len(prompts) + fed))
    forward_trainer = 2 * (body * rows_tokens + head * response)
    return {"rollout": forward_rollout, "logprobs": forward_trainer, "train": 3 * forward_trainer}


def run_case(case: Case, quick: bool, repeats: int | None, peaks: dict[str, float]) -> dict:
    model, tokenizer, prompts = build(case, quick)
    sampling = SamplingParams(n=case.n, max_tokens=case.max_tokens, temperature=1.0, seed=0)
    started = time.perf_counter()
    rollout = NativeEngine(model, tokenizer, record_routes=True).generate(prompts, sampling)
    result = {"case": case, "params": param_counts(model), "first_rollout_s": time.perf_counter() - started}
    result["accuracy"] = accuracy(model, rollout)
    if case.repeats:
        result["costs"] = costs(model, tokenizer, prompts, sampling, rollout, repeats or case.repeats)
        result["flops"] = flops(model, prompts, rollout)
        result["peak"] = peaks[case.dtype]
    print(f"  {case.model} {case.dtype}: done in {time.perf_counter() - started:.0f} s", flush=True)
    return result


def label(case: Case) -> str:
    return f"{case.model} {case.dtype} ({case.prompts}x{case.n}, <= {case.max_tokens} tokens)"


def print_accuracy(results: list[dict]) -> None:
    print("\n| model, dtype (prompts x n, new tokens) | response tokens | agreement mean (min layer) | "
          "tokens routed differently | gap without replay mean / max | "
          "gap with replay mean / max |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results:
        a = r["accuracy"]
        print(f"| {label(r['case'])} | {a['tokens']:.0f} | {a['agree']:.4f} ({a['agree_min']:.4f}) | "
              f"{100 * a['flipped']:.1f}% | {a['plain_mean']:.1e} / {a['plain_max']:.1e} | "
              f"{a['replay_mean']:.1e} / {a['replay_max']:.1e} |")  # fmt: skip


def print_costs(results: list[dict]) -> None:
    print("\n| model, dtype | phase | without routes, CPU s | with routes, CPU s | "
          "with / without, CPU (range) | with / without, wall (range) | floor ms | "
          "% of floor reached (without / with) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    phases = {"rollout": "rollout (recording)", "logprobs": "compute_logprobs (replay)",
              "train": "train fwd+bwd (replay)"}  # fmt: skip
    for r in (r for r in results if "costs" in r):
        for phase, name in phases.items():
            t = r["costs"][phase]
            floor = r["flops"][phase] / (r["peak"] * 1e9)
            print(f"| {r['case'].model} {r['case'].dtype} | {name} | {t['without']:.3f} | {t['with']:.3f} | "
                  f"{t['cpu']:.2f}x ({t['cpu_min']:.2f}-{t['cpu_max']:.2f}) | "
                  f"{t['wall']:.2f}x ({t['wall_min']:.2f}-{t['wall_max']:.2f}) | {1e3 * floor:.0f} | "
                  f"{100 * floor / t['without']:.1f}% / {100 * floor / t['with']:.1f}% |")  # fmt: skip
    for r in (r for r in results if "costs" in r):
        print(f"{r['case'].model} {r['case'].dtype}: recorded and plain rollouts sample the same tokens: "
              f"{r['costs']['same_tokens']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, 1 repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (at most 2 on this machine)")
    parser.add_argument("--repeats", type=int, help="timed pairs per timed case (default: 5 tiny, 3 100m)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = {name: linear_gflops(dtype) for name, dtype in DTYPES.items()}
    weights = ROOT / "rlcore" / "models" / "weights" / "tiny-moe"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}; matmul peak (linear 512x512x2048, best of 3, CPU "
          f"time) fp32 {peaks['fp32']:.1f} GFLOP/s, bf16 {peaks['bf16']:.2f}; tiny-moe: "
          f"{'warm-started weights' if weights.is_dir() else 'seeded random init'}", flush=True)  # fmt: skip
    results = [run_case(case, args.quick, args.repeats, peaks) for case in cases(args.quick)]
    for r in results:
        p = r["params"]
        print(f"{r['case'].model} {r['case'].dtype}: {p['total'] / 1e6:.2f}M parameters, "
              f"{p['active'] / 1e6:.2f}M active; first recorded rollout "
              f"{r['first_rollout_s']:.1f} s")  # fmt: skip
    print_accuracy(results)
    print_costs(results)


if __name__ == "__main__":
    main()
