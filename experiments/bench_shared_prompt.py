"""Benchmark shared-prompt packing (`--algo.share-prompts`) against one row per sample (issue 9).

    python experiments/bench_shared_prompt.py           # the cases recorded in experiments/README.md
    python experiments/bench_shared_prompt.py --quick   # smaller batches, to check the script runs

It reports and never asserts. GRPO-shaped batches (P prompts x n samples, responses log-normal like
real rollouts) through the update's gradient pass: forward + backward of a token-mean loss over
micro-batches, once with every sample's prompt in its own row ("rows") and once with
`rlcore.models.forward.model_inputs(..., share_prompts=True)` ("shared"; the FLOP estimate of
`rlcore.models.shared_prompt.worth_packing` decides per micro-batch, so a case where it declines shows
~1.00x). Medians of a few repeats, both side by side in one run, one thread.

Floors: forward + backward FLOPs (3x the forward) at the measured fp32 matmul peak. "rows" needs every
row's prompt (2 x layer params per token, causal attention, the lm_head on response tokens only);
"shared" needs each prompt once and each response token once (its attention still spans the prompt).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rlcore.batch import Batch
from rlcore.models import load_policy
from rlcore.models.forward import micro_batches, model_inputs, response_logits
from rlcore.pure.logprobs import token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import matmul_gflops, median_time, rollout

# (model, prompts, n, prompt lengths, response median, response cap, micro-batch rows or token budget)
CASES = {
    "reverse (vs_trl's task)": ("builtin:tiny-reverse", 32, 8, (18, 30), 6, 12, {"micro_batch_size": 64}),
    "math-like, short answers": ("builtin:small", 16, 8, (60, 160), 24, 128, {"micro_batch_size": 16}),
    "math-like, token budget": ("builtin:small", 16, 8, (60, 160), 24, 128, {"max_tokens": 4096}),
    "long responses": ("builtin:small", 4, 8, (40, 80), 300, 1024, {"micro_batch_size": 8}),
}


def grouped_batch(prompts: int, n: int, p_range: tuple[int, int], median: int, cap: int, vocab: int) -> Batch:
    """prompts x n rows: each prompt repeated n times (left-padded), log-normal responses (right-padded)."""
    g = torch.Generator().manual_seed(0)
    b, p = prompts * n, p_range[1]
    p_len = torch.randint(p_range[0], p_range[1] + 1, (prompts,), generator=g).repeat_interleave(n)
    r_len = (median * torch.exp(torch.randn(b, generator=g))).round().clamp(1, cap).long()
    attention_mask = (torch.arange(p) >= p - p_len[:, None]).long()
    input_ids = (
        torch.randint(7, vocab, (prompts, p), generator=g).repeat_interleave(n, dim=0) * attention_mask
    )
    t = int(r_len.max())
    response_attention = (torch.arange(t) < r_len[:, None]).float()
    responses = torch.randint(7, vocab, (b, t), generator=g) * response_attention.long()
    return rollout(input_ids, attention_mask, responses, response_attention)


def floors(model, batch: Batch, n: int) -> tuple[float, float]:
    """Forward FLOPs the real tokens need: (every row's prompt, each prompt once)."""
    cfg = model.config
    layer_params = sum(q.numel() for layer in model.model.layers for q in layer.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    att = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * head_dim  # per query-key pair
    p = batch["attention_mask"].sum(-1).double()
    r = batch["response_attention"].sum(-1).double()
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size * r.sum()
    rows = 2 * layer_params * (p + r).sum() + att * ((p + r) ** 2 / 2).sum() + lm_head
    p_once = p[::n]  # rows of a prompt are consecutive
    shared = (
        2 * layer_params * (p_once.sum() + r.sum())
        + att * ((p_once**2 / 2).sum() + (r * p + r**2 / 2).sum())
        + lm_head
    )
    return float(rows), float(shared)


def gradient_pass(model, batch: Batch, split: dict, share: bool) -> int:
    """Forward + backward of a token-mean loss over the micro-batches; how many ran packed."""
    tokens = float(batch["response_mask"].sum())
    packed = 0
    for micro, _ in micro_batches(batch, **split):
        inputs = model_inputs(model, micro, share_prompts=share)
        packed += inputs.gather is not None
        lp = token_logprobs(response_logits(model, inputs), inputs.labels)
        (-(lp * micro["response_mask"][:, : lp.shape[1]]).sum() / tokens).backward()
    return packed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the prompts, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    peak = matmul_gflops(1024)
    print(f"fp32 matmul peak (1 thread, 1024^3): {peak:.0f} GFLOP/s")
    repeats = 1 if args.quick else args.repeats
    for name, (model_name, prompts, n, p_range, median, cap, split) in CASES.items():
        model, _ = load_policy(model_name)
        model.train()
        prompts = max(1, prompts // 4) if args.quick else prompts
        batch = grouped_batch(prompts, n, p_range, median, cap, model.config.vocab_size)
        p_tok, r_tok = int(batch["attention_mask"].sum()), int(batch["response_attention"].sum())
        f_rows, f_shared = floors(model, batch, n)
        times, packed = {}, {}
        for share in (False, True):
            packed[share] = gradient_pass(model, batch, split, share)
            times[share] = median_time(partial(gradient_pass, model, batch, split, share), repeats, warmup=0)
            model.zero_grad(set_to_none=True)
        pieces = len(micro_batches(batch, **split))
        print(
            f"\n{name}: {model_name}, {prompts} prompts x {n}, {split}; prompt tokens {p_tok} (each prompt "
            f"once: {p_tok // n}), response tokens {r_tok} (mean {r_tok / len(batch):.0f}); packed "
            f"{packed[True]}/{pieces} micro-batches"
        )
        for share, label, flops in ((False, "rows", f_rows), (True, "shared", f_shared)):
            floor = 3 * flops / (peak * 1e9)
            print(
                f"  {label:<7}{times[share]:8.3f} s  floor {3 * flops / 1e9:6.2f} GFLOP = {floor * 1e3:6.0f} ms"
                f"  {100 * floor / times[share]:5.1f}% of it"
            )
        print(f"  speed-up shared / rows: {times[False] / times[True]:.2f}x")


if __name__ == "__main__":
    main()
