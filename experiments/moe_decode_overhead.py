"""How much a lean MoE decode step could save: the Hugging Face MoE step against dense steps of equal active FLOPs.

    .venv/bin/python experiments/moe_decode_overhead.py            # ~2 minutes, 1 thread
    .venv/bin/python experiments/moe_decode_overhead.py --quick    # small models, ~20 s

Issue 36 asks for a lean MoE decode step, or the Hugging Face step if that measures no worse. There is no
lean MoE step yet; this measures the room one would have. Three rollouts of 8 prompts x 4 samples
(32 rows), 32 new tokens at temperature 1, by `NativeEngine`:
- **moe-hf**: bench_moe's random-100m Qwen3-MoE (16 experts of width 384, top-2), the Hugging Face step
  (the only MoE step there is);
- **dense-hf** and **dense-lean**: a random Qwen3 with the same attention, embeddings and layers and a
  dense MLP of width 768 (= top-2 x 384: the MoE's active MLP FLOPs per token), with the Hugging Face
  step and with `rlcore.rollout.lean`.
dense-hf / dense-lean is what the lean step saves on a dense model of this shape; moe-hf / dense-lean
bounds what a lean MoE step could reach if its experts cost no more than the dense MLP of equal FLOPs
(they cost more: a loop over the experts hit). Median of `--repeats` runs, each after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import RANDOM_SIZES, _Tok, random_moe, random_prompts

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native import NativeEngine


def dense_twin(sizes: dict) -> torch.nn.Module:
    """A random Qwen3 with the MoE's attention and a dense MLP as wide as its top-2 experts together."""
    keep = {k: v for k, v in sizes.items() if k not in ("num_experts", "moe_intermediate_size")}
    config = Qwen3Config(**keep, intermediate_size=2 * sizes["moe_intermediate_size"], tie_word_embeddings=True,
                         max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def timed(engine: NativeEngine, prompts, sampling: SamplingParams, repeats: int) -> tuple[float, int]:
    """(median seconds, response tokens) of `repeats` generates after one warm-up."""
    engine.generate(prompts, sampling)
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        times.append(time.perf_counter() - start)
        tokens = int(out["response_mask"].sum())
    return statistics.median(times), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = RANDOM_SIZES["quick" if args.quick else "full"]
    prompts = random_prompts(8, sizes["vocab_size"], (8, 24))
    sampling = SamplingParams(n=4, max_tokens=32, seed=0)
    moe, dense = random_moe(sizes, torch.float32), dense_twin(sizes)
    engines = {
        "moe-hf": NativeEngine(moe, _Tok(), lean=False),
        "dense-hf": NativeEngine(dense, _Tok(), lean=False),
        "dense-lean": NativeEngine(dense, _Tok(), lean=True),
    }
    with torch.no_grad():
        results = {name: timed(engine, prompts, sampling, args.repeats) for name, engine in engines.items()}
    lean = results["dense-lean"][0]
    print(f"torch {torch.__version__}, {args.threads} thread(s), 32 rows x 32 new tokens")
    print("| rollout | s (median) | response tokens | tok/s | / dense-lean |")
    print("|---|---|---|---|---|")
    for name, (seconds, tokens) in results.items():
        print(f"| {name} | {seconds:.3f} | {tokens} | {tokens / seconds:.0f} | {seconds / lean:.2f}x |")


if __name__ == "__main__":
    main()
