"""Where the rollout/trainer log-prob gap comes from, one source at a time (issue 41, first step).

    .venv/bin/python experiments/exact_sources.py                 # built-in tiny-reverse and SmolLM2-135M
    .venv/bin/python experiments/exact_sources.py --models builtin:tiny-reverse

Before a batch-invariant mode is built, each source of difference between the native engine's sampling
log-probs and the trainer's forward is measured alone, as the largest absolute difference (0 means
bitwise equal), in fp32 and under bf16 autocast:

- linear, M rows: `F.linear(X[:M], W)` against the first M rows of `F.linear(X, W)` (X of 128 rows), for
  the model's widest products (the MLP's up projection and the head): the decode step multiplies a few
  rows, the trainer many.
- attention, cached: one query against a KV cache of L keys (`scaled_dot_product_attention`, q length 1)
  against row L of the causal attention over the whole sequence.
- batch company: the trainer's log-probs of one sequence alone against the same sequence in a batch of 8
  (other prompts, left padding) - what other rows and padding change.
- micro-batching: the batch in micro-batches of 1 row against one of 8.
- packing: shared-prompt packing (each prompt once for its samples) against one row per sample.
- engine vs trainer: the engine's sampling log-probs (prefill, then cached decode) against the trainer's
  forward of the same samples: the whole gap, as `rollout/logprob_diff_max` logs it.

Reports, never asserts; the table goes to experiments/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from rlcore.batch import Batch  # noqa: E402
from rlcore.data.prompts import make_prompt_batch  # noqa: E402
from rlcore.data.rows import Row  # noqa: E402
from rlcore.models.forward import compute_logprobs  # noqa: E402
from rlcore.models.policy import load_policy  # noqa: E402
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.native.engine import NativeEngine  # noqa: E402

PROMPTS = ["reverse 1234", "reverse 98", "what is 3 + 4?", "reverse 5551", "name a colour", "reverse 7",
           "count to five", "reverse 120"]  # fmt: skip


def autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)


def linear_rows(model, dtype: torch.dtype) -> dict[str, float]:
    """The widest products at M = 1, 2, 7, 16, 64 rows against the rows of the 128-row product."""
    mlp = next(m for name, m in model.named_modules() if name.endswith("mlp.up_proj"))
    out = {}
    for label, weight in (("up", mlp.weight), ("head", model.get_output_embeddings().weight)):
        x = torch.randn(128, weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), autocast(dtype):
            full = F.linear(x, weight)
            for m in (1, 2, 7, 16, 64):
                out[f"linear {label} M={m}"] = (F.linear(x[:m], weight) - full[:m]).abs().max().item()
    return out


def cached_attention(model, dtype: torch.dtype) -> dict[str, float]:
    """q length 1 over L cached keys against row L of the causal attention over L + 1 positions."""
    config = model.config.get_text_config()
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(1)
    out = {}
    for length in (16, 100):
        q, k, v = (torch.randn(1, heads, length + 1, dim, generator=g) for _ in range(3))
        with torch.no_grad(), autocast(dtype):
            full = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -1:]
            cached = F.scaled_dot_product_attention(q[:, :, -1:], k, v)
        out[f"attention, one query over {length} cached keys"] = (cached - full).abs().max().item()
    return out


def rollout(model, tokenizer, prompts: list[str], n: int = 2) -> Batch:
    rows = [Row(data_source="x", prompt=[{"role": "user", "content": p}]) for p in prompts]
    engine = NativeEngine(model, tokenizer)
    return engine.generate(make_prompt_batch(rows, tokenizer), SamplingParams(n=n, max_tokens=24, seed=0))


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs().masked_fill(mask == 0, 0).max().item()


def trainer_sources(model, tokenizer, dtype: torch.dtype) -> dict[str, float]:
    """Batch company, micro-batching, packing and the whole engine/trainer gap on one rollout."""
    with autocast(dtype):
        batch = rollout(model, tokenizer, PROMPTS)
        mask = batch["response_mask"]
        many, _ = compute_logprobs(model, batch, micro_batch_size=16, share_prompts=False)
        ones, _ = compute_logprobs(model, batch, micro_batch_size=1, share_prompts=False)
        eights, _ = compute_logprobs(model, batch, micro_batch_size=8, share_prompts=False)
        packed, _ = compute_logprobs(model, batch, micro_batch_size=16, share_prompts=True)
        alone = rollout(model, tokenizer, PROMPTS[:1])
        solo, _ = compute_logprobs(model, alone, micro_batch_size=1, share_prompts=False)
    t = min(solo.shape[1], many.shape[1])
    same = torch.equal(alone["responses"][:, :t], batch["responses"][:2, :t])
    out = {
        "micro-batches of 1 vs 8 rows": masked_gap(ones, eights, mask),
        "micro-batch of 16 vs 8 rows": masked_gap(many, eights, mask),
        "shared-prompt packing vs one row per sample": masked_gap(packed, many, mask),
        "engine (prefill + cached decode) vs trainer": masked_gap(batch["rollout_logprobs"], many, mask),
    }
    if same:  # the lone prompt sampled the same tokens: its rows alone vs in the batch of 8 prompts
        out["one prompt alone vs in a padded batch of 8"] = masked_gap(
            solo[:, :t], many[:2, :t], mask[:2, :t]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=None)
    args = parser.parse_args()
    models = args.models
    if models is None:
        from bench_real import find_model

        models = ["builtin:tiny-reverse", str(find_model())]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; max |difference|, 0 = bitwise equal\n"
    )
    for path in models:
        model, tokenizer = load_policy(path)
        name = path if path.startswith("builtin:") else "SmolLM2-135M-Instruct"
        print(f"| {name} | fp32 | bf16 autocast |\n|---|---|---|")
        rows: dict[str, list[float]] = {}
        for dtype in (torch.float32, torch.bfloat16):
            for part in (linear_rows, cached_attention):
                for key, value in part(model, dtype).items():
                    rows.setdefault(key, []).append(value)
            for key, value in trainer_sources(model, tokenizer, dtype).items():
                rows.setdefault(key, []).append(value)
        for key, values in rows.items():
            print(f"| {key} | " + " | ".join(f"{v:.2e}" if v else "0" for v in values) + " |")
        print()


if __name__ == "__main__":
    main()
