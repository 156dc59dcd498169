"""Write a random-init Hugging Face directory of a 0.5B- or 1.5B-class Qwen2 config (no download).

    python experiments/gpu/make_model.py 0.5b /tmp/qwen-0.5b-shapes
    python experiments/gpu/make_model.py tiny /tmp/tiny-shapes          # a CPU check of the script

The tokenizer is rlcore's character-level one (prompts stay short character strings), while the
vocabulary of the config is Qwen2's 151,936 so the embedding and lm_head cost what they do for real.
Seeded init, bf16 weights on disk.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlcore.models import build_char_tokenizer

SHAPES = {  # hidden, layers, heads, kv heads, MLP (Qwen2-0.5B and Qwen2-1.5B)
    "0.5b": (896, 24, 14, 2, 4864),
    "1.5b": (1536, 28, 12, 2, 8960),
    "tiny": (128, 2, 2, 1, 256),
}


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, mlp = SHAPES[name]
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=151_936 if name != "tiny" else len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
