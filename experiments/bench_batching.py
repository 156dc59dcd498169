"""Benchmark token-budget dynamic batching + trimming against fixed padded micro-batches (issue 4).

    python experiments/bench_batching.py            # the sizes recorded in experiments/README.md
    python experiments/bench_batching.py --quick    # small sizes, a few seconds (checks the script runs)

It reports and never asserts. Every timing is the median of a few repeats after a warm-up, both
paths side by side in one run, with the fp32 matmul peak of the same machine as the floor.

a) Throughput on builtin:small (6 layers, hidden 256): a batch of rollouts whose response lengths are
   skewed like real RL (log-normal: most short, a long tail capped at 8x the median). Two passes:
   the log-prob pass (forward, no grad) and the gradient pass (forward + backward of a token-mean
   loss). "fixed": micro-batches of a fixed number of rows, every row padded to the batch's full width
   (prompt + max_tokens), as without padding removal; "rlcore": `rlcore.models.forward` with a token
   budget equal to the fixed path's tokens per micro-batch (same peak activation size), rows sorted
   and packed by length, each micro-batch trimmed to the columns it uses. Tokens/s counts real
   tokens (prompt + response) only; the FLOP floor counts the FLOPs those real tokens need.
b) Peak memory of the log-prob pass with a 151,936-token vocabulary (a tiny 2-layer model with that
   vocabulary): "naive" = fixed padded micro-batches, logits at every position, float32 log_softmax,
   gather (what a framework without fused log-probs does); "rlcore" = `compute_logprobs` (response
   positions only, trimmed, token-budgeted, chunked `token_logprobs`). Each in a fresh subprocess:
   extra = peak RSS during the pass (VmHWM after a reset) minus the RSS before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rlcore.batch import Batch
from rlcore.models import load_policy
from rlcore.models.forward import compute_logprobs, micro_batches, response_logits, sequence_tensors
from rlcore.pure.logprobs import token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import matmul_gflops, median_time, rollout

# ---------------------------------------------------------------- data


def skewed_lengths(b: int, median: int, cap: int, gen: torch.Generator) -> torch.Tensor:
    """Log-normal response lengths (sigma 1): half below `median`, ~2% at the cap of 8x the median."""
    z = torch.randn(b, generator=gen)
    return (median * torch.exp(z)).round().clamp(1, cap).long()  # (b,)


def rollout_batch(
    b: int, *, prompt: tuple[int, int], median: int, max_tokens: int, vocab: int, seed: int = 0
) -> Batch:
    """b rows: left-padded prompts of prompt[0]..prompt[1] tokens, right-padded skewed responses."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(prompt[0], prompt[1] + 1, (b,), generator=gen)
    r_len = skewed_lengths(b, median, max_tokens, gen)
    p = prompt[1]
    attention_mask = (torch.arange(p) >= p - p_len[:, None]).long()  # (b, p)
    input_ids = torch.randint(7, vocab, (b, p), generator=gen) * attention_mask
    response_attention = (torch.arange(max_tokens) < r_len[:, None]).float()  # (b, t): padded to max_tokens
    responses = torch.randint(7, vocab, (b, max_tokens), generator=gen) * response_attention.long()
    return rollout(input_ids, attention_mask, responses, response_attention)


# ---------------------------------------------------------------- the two paths


def padded_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Untrimmed model inputs of the whole batch: every row at full width (prompt + max_tokens)."""
    ids = torch.cat([batch["input_ids"], batch["responses"]], dim=1)
    attn = torch.cat([batch["attention_mask"], batch["response_attention"].long()], dim=1)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def fixed_pass(model, batch: Batch, rows: int, *, grad: bool, tokens: int) -> None:
    """Fixed micro-batches of `rows` rows at full padded width; log-probs, and backward when `grad`."""
    ids, attn, pos = padded_inputs(batch)
    t = batch["responses"].shape[1]
    for i in range(0, len(batch), rows):
        with torch.set_grad_enabled(grad):
            logits = model(
                input_ids=ids[i : i + rows],
                attention_mask=attn[i : i + rows],
                position_ids=pos[i : i + rows],
                use_cache=False,
                logits_to_keep=t + 1,
            ).logits[:, :-1]
            lp = token_logprobs(logits, batch["responses"][i : i + rows])
            if grad:
                (-(lp * batch["response_mask"][i : i + rows]).sum() / tokens).backward()


def rlcore_pass(model, batch: Batch, budget: int, *, grad: bool, tokens: int) -> None:
    """rlcore: token-budget micro-batches, trimmed; `compute_logprobs` for the log-prob pass."""
    if not grad:
        compute_logprobs(model, batch, max_tokens=budget)
        return
    for micro, _ in micro_batches(batch, max_tokens=budget):
        inputs = sequence_tensors(micro)
        lp = token_logprobs(response_logits(model, inputs), inputs.labels)
        r = lp.shape[1]
        (-(lp * micro["response_mask"][:, :r]).sum() / tokens).backward()


def useful_flops(model, batch: Batch) -> float:
    """Forward FLOPs the real tokens need: 2 x layer params per token, the lm_head on response tokens,
    causal attention 2 s^2 d per layer and sequence (QK^T and AV over the lower triangle)."""
    cfg = model.config
    layer_params = sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    p_len = batch["attention_mask"].sum(-1).double()
    r_len = batch["response_attention"].sum(-1).double()
    s = p_len + r_len
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn = cfg.num_attention_heads * head_dim
    linear = 2 * layer_params * s.sum()
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size * r_len.sum()
    attention = cfg.num_hidden_layers * 2 * (s**2).sum() * d_attn
    return float(linear + lm_head + attention)


def bench_throughput(quick: bool, peak: float) -> None:
    model, _ = load_policy("builtin:small")
    model.train()
    b, rows, median, max_tokens = (16, 4, 16, 128) if quick else (64, 8, 64, 512)
    batch = rollout_batch(b, prompt=(20, 60), median=median, max_tokens=max_tokens, vocab=103)
    width = batch["input_ids"].shape[1] + max_tokens
    budget = rows * width  # the fixed path's tokens per micro-batch
    real = int(batch["attention_mask"].sum() + batch["response_attention"].sum())
    r_len = batch["response_attention"].sum(-1)
    mask_tokens = float(batch["response_mask"].sum())
    n_micro = len(micro_batches(batch, max_tokens=budget))
    print(
        f"a) builtin:small ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), {b} rows, "
        f"prompts 20-60 tokens, responses log-normal median {median} (mean {float(r_len.mean()):.0f}, "
        f"max {int(r_len.max())}, cap {max_tokens})"
    )
    print(
        f"   real tokens {real}, padded tokens {b * width} ({b * width / real:.1f}x); fixed: "
        f"{math.ceil(b / rows)} micro-batches of {rows} rows x {width}; rlcore: budget {budget} "
        f"tokens -> {n_micro} micro-batches"
    )
    fwd = useful_flops(model, batch)
    repeats = 2 if quick else 3
    results = {}
    for grad, label, factor in ((False, "log-prob pass (no grad)", 1), (True, "forward + backward", 3)):
        for name, fn in (
            ("fixed", lambda g=grad: fixed_pass(model, batch, rows, grad=g, tokens=mask_tokens)),
            ("rlcore", lambda g=grad: rlcore_pass(model, batch, budget, grad=g, tokens=mask_tokens)),
        ):
            model.zero_grad(set_to_none=True)
            results[(label, name)] = median_time(fn, repeats)
        floor = factor * fwd / (peak * 1e9)
        t_fixed, t_ours = results[(label, "fixed")], results[(label, "rlcore")]
        print(f"   {label}: FLOP floor {factor * fwd / 1e9:.1f} GFLOP = {floor * 1e3:.0f} ms")
        for name, t in (("fixed", t_fixed), ("rlcore", t_ours)):
            print(f"     {name:<7}{t:8.3f} s {real / t:10.0f} tok/s {100 * floor / t:6.1f}% of floor")
        print(f"     speed-up rlcore / fixed: {t_fixed / t_ours:.2f}x (target >= 1.5x)")


# ---------------------------------------------------------------- b) memory


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def big_vocab_model(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def naive_logprobs(model, batch: Batch, rows: int) -> torch.Tensor:
    """Fixed padded micro-batches, logits at every position, float32 log_softmax, then gather."""
    ids, attn, pos = padded_inputs(batch)
    p = batch["input_ids"].shape[1]
    out = []
    for i in range(0, len(batch), rows):
        logits = model(
            input_ids=ids[i : i + rows], attention_mask=attn[i : i + rows], position_ids=pos[i : i + rows]
        ).logits
        logp = torch.log_softmax(logits[:, p - 1 : -1].float(), dim=-1)  # (m, t, v): the second full copy
        out.append(logp.gather(-1, batch["responses"][i : i + rows, :, None])[..., 0])
    return torch.cat(out) * batch["response_mask"]


def mem_child(variant: str, quick: bool, out_path: str) -> None:
    """In a fresh process: one log-prob pass of `variant`; prints a JSON line."""
    vocab = 151_936
    b, rows, median, max_tokens = (4, 2, 16, 64) if quick else (16, 4, 32, 256)
    model = big_vocab_model(vocab)
    batch = rollout_batch(b, prompt=(16, 32), median=median, max_tokens=max_tokens, vocab=vocab, seed=1)
    budget = rows * (batch["input_ids"].shape[1] + max_tokens)
    small = batch[:1]
    naive_logprobs(model, small, 1) if variant == "naive" else compute_logprobs(model, small)  # warm-up
    base = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    t0 = time.perf_counter()
    if variant == "naive":
        lp = naive_logprobs(model, batch, rows)
    else:
        lp, _ = compute_logprobs(model, batch, max_tokens=budget)
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    torch.save(lp, out_path)
    t = batch["responses"].shape[1]
    full_logits = rows * (batch["input_ids"].shape[1] + t) * vocab * 4
    record = {"extra_bytes": peak - base, "seconds": seconds, "micro_logits_bytes": full_logits}
    record |= {"rows": b, "micro_rows": rows, "budget": budget, "vocab": vocab}
    print(json.dumps(record))


def bench_memory(quick: bool, threads: int) -> None:
    import tempfile

    results, values = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("naive", "rlcore"):
            path = str(Path(tmp) / f"{variant}.pt")
            cmd = [sys.executable, __file__, "--mem-child", variant, "--out", path, "--threads", str(threads)]
            cmd += ["--quick"] if quick else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            values[variant] = torch.load(path)
    r = results["naive"]
    diff = float((values["naive"] - values["rlcore"]).abs().max())
    print(
        f"b) log-prob pass, vocab {r['vocab']}, 2-layer hidden-64 model, {r['rows']} rows; naive: "
        f"{r['micro_rows']}-row padded micro-batches (full-position fp32 logits "
        f"{r['micro_logits_bytes'] / 1e9:.2f} GB each); rlcore: budget {r['budget']} tokens"
    )
    for name in ("naive", "rlcore"):
        x = results[name]
        print(f"     {name:<7} extra peak {x['extra_bytes'] / 1e9:6.3f} GB  {x['seconds']:7.2f} s")
    ratio = results["rlcore"]["extra_bytes"] / results["naive"]["extra_bytes"]
    print(f"     peak-memory ratio rlcore / naive: {ratio:.3f}; max |log-prob diff| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine, 2 OpenMP threads stall in backward)",
    )
    parser.add_argument("--mem-child", choices=("naive", "rlcore"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mem_child:
        mem_child(args.mem_child, args.quick, args.out)
        return
    env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_NUM_THREADS"))}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, env {env}")
    peak = matmul_gflops()
    print(f"fp32 matmul 2048^3: {peak:.1f} GFLOP/s (the floor below)\n")
    bench_throughput(args.quick, peak)
    print()
    bench_memory(args.quick, args.threads)


if __name__ == "__main__":
    main()
