"""The MoE decode step: Hugging Face's and the lean one, against dense steps of equal active FLOPs.

    .venv/bin/python experiments/moe_decode_overhead.py            # ~2 minutes, 1 thread
    .venv/bin/python experiments/moe_decode_overhead.py --quick    # small models, ~20 s

Issue 36 asks for a lean MoE decode step, or the Hugging Face step if that measures no worse. Four rollouts of 8 prompts x 4 samples
(32 rows), 32 new tokens at temperature 1, by `NativeEngine`, in rounds of all four:
- **moe-hf** and **moe-lean**: bench_moe's random-100m Qwen3-MoE (16 experts of width 384, top-2), with
  the Hugging Face step and with `rlcore.rollout.native.lean` (its attention, each layer's own sparse block);
- **dense-hf** and **dense-lean**: a random Qwen3 with the same attention, embeddings and layers and a
  dense MLP of width 768 (= top-2 x 384: the MoE's active MLP FLOPs per token), with the Hugging Face
  step and with `rlcore.rollout.native.lean`.
dense-hf / dense-lean is what the lean step saves on a dense model of this shape, moe-hf / moe-lean what
it saves on the MoE; moe-lean / dense-lean is what the experts cost beyond a dense MLP of equal FLOPs. Median of `--repeats` runs, each after one warm-up.
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
from rlcore.rollout.native.engine import NativeEngine


def dense_twin(sizes: dict) -> torch.nn.Module:
    """A random Qwen3 with the MoE's attention and a dense MLP as wide as its top-2 experts together."""
    keep = {k: v for k, v in sizes.items() if k not in ("num_experts", "moe_intermediate_size")}
    config = Qwen3Config(**keep, intermediate_size=2 * sizes["moe_intermediate_size"], tie_word_embeddings=True,
                         max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def timed(engines: dict[str, NativeEngine], prompts, sampling: SamplingParams, repeats: int) -> dict:
    """name -> (median seconds, the sampled responses, their token count): one warm-up each, then
    `repeats` rounds of every engine in turn (the order reversed every round), so load drifts hit all."""
    outs = {name: engine.generate(prompts, sampling) for name, engine in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(repeats):
        for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            outs[name] = engines[name].generate(prompts, sampling)
            times[name].append(time.perf_counter() - start)
    return {
        name: (
            statistics.median(times[name]),
            out["responses"] * out["response_mask"],
            int(out["response_mask"].sum()),
        )
        for name, out in outs.items()
    }


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
        "moe-lean": NativeEngine(moe, _Tok(), lean=True),
        "dense-hf": NativeEngine(dense, _Tok(), lean=False),
        "dense-lean": NativeEngine(dense, _Tok(), lean=True),
    }
    with torch.no_grad():
        results = timed(engines, prompts, sampling, args.repeats)
    lean = results["dense-lean"][0]
    print(f"torch {torch.__version__}, {args.threads} thread(s), 32 rows x 32 new tokens")
    print("| rollout | s (median) | response tokens | tok/s | / dense-lean |")
    print("|---|---|---|---|---|")
    for name, (seconds, _, tokens) in results.items():
        print(f"| {name} | {seconds:.3f} | {tokens} | {tokens / seconds:.0f} | {seconds / lean:.2f}x |")
    for kind in ("moe", "dense"):
        same = torch.equal(results[f"{kind}-hf"][1], results[f"{kind}-lean"][1])
        print(f"{kind}: the lean and the Hugging Face step sampled the same tokens: {same}")


if __name__ == "__main__":
    main()
