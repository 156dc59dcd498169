"""Warm start of the built-in vision-language model on the built-in `shapes` task (issue 37).

As `warmstart.py` does for text: a short, reproducible SFT on a mixture of the right answer (the count of
shapes of the asked color and kind, with probability `--p-correct`) and a systematic wrong one (the count
of all shapes in the image, color and kind ignored). Greedy decoding then follows the wrong habit
while sampling finds the right count some of the time: GRPO has a signal, and what it must learn is to
look at the color and kind. The SFT runs through rlcore's own forward (`rlcore.models.forward`, images
and M-RoPE positions as the trainer feeds them) and is evaluated with the native engine.

    python experiments/warmstart_vl.py          # writes rlcore/models/weights/tiny-vl/

Deterministic for a given seed on a given machine (seeded init, seeded batches, no dropout).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from rlcore.batch import Batch
from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import row_from_dict
from rlcore.data.shapes import compute_score, generate_rows
from rlcore.models.forward import model_inputs, response_logprobs
from rlcore.models.policy import load_policy, load_vision
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.engine import NativeEngine


def sft_batch(prompts: Batch, answers: list[str], tokenizer) -> Batch:
    """`prompts` rolled out with the responses `answers` + EOS (the fields the trainer's forward reads)."""
    targets = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    width = max(map(len, targets))
    responses = torch.full((len(answers), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(answers), width)
    for i, t in enumerate(targets):
        responses[i, : len(t)], mask[i, : len(t)] = torch.tensor(t), 1.0
    return prompts.with_(responses=responses, response_mask=mask, response_attention=mask.clone())


def fit(model, next_batch, *, steps: int, lr: float) -> None:
    """`steps` AdamW steps (one-cycle, clip 1.0) of the responses' mean negative log-likelihood."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    start = time.time()
    for step in range(steps):
        batch = next_batch()
        logprob, _ = response_logprobs(model, model_inputs(model, batch))  # (b, r)
        mask = batch["response_mask"][:, : logprob.shape[1]]
        loss = -(logprob * mask).sum() / mask.sum()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()


@torch.no_grad()
def evaluate(model, tokenizer, vision, rows: list[dict], *, greedy: bool, seed: int = 0) -> float:
    """Mean reward of one native-engine response per row (greedy, or sampled at temperature 1)."""
    engine = NativeEngine(model, tokenizer, generator_seed=seed)
    prompts = make_prompt_batch([row_from_dict(r, f"row {i}") for i, r in enumerate(rows)], tokenizer,
                                vision=vision)  # fmt: skip
    out = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0 if greedy else 1.0))
    texts = tokenizer.batch_decode(out["responses"], skip_special_tokens=True)
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    return sum(compute_score("builtin/shapes", t, g) for t, g in zip(texts, truths, strict=True)) / len(rows)


def train(args) -> None:
    torch.manual_seed(args.seed)
    model, tokenizer = load_policy("builtin:tiny-vl", seed=args.seed)
    vision = load_vision("builtin:tiny-vl")
    rows = generate_rows("train", args.rows, seed=args.seed)
    val = generate_rows("val", 256, seed=args.seed)
    rng = random.Random(args.seed)
    prompts = make_prompt_batch([row_from_dict(r, f"row {i}") for i, r in enumerate(rows)], tokenizer,
                                vision=vision)  # fmt: skip  (images processed once)

    def next_batch() -> Batch:
        picked = [rng.randrange(len(rows)) for _ in range(args.batch)]
        answers = [rows[i]["reward_model"]["ground_truth"] if rng.random() < args.p_correct
                   else str(rows[i]["extra_info"]["shapes"]) for i in picked]  # fmt: skip
        return sft_batch(prompts[picked], answers, tokenizer)

    fit(model, next_batch, steps=args.steps, lr=args.lr)
    greedy = evaluate(model, tokenizer, vision, val, greedy=True)
    sampled = evaluate(model, tokenizer, vision, val, greedy=False, seed=args.seed)
    print(f"val reward: greedy {greedy:.3f}  sampled {sampled:.3f}  (p_correct {args.p_correct})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    print(f"saved {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "rlcore/models/weights/tiny-vl"))
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rows", type=int, default=8000)
    p.add_argument("--p-correct", type=float, default=0.25)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args())


if __name__ == "__main__":
    main()
