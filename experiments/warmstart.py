"""Warm start for the embedded default: a short, reproducible SFT of a built-in model on a mixture.

Why: RL needs a policy that sometimes succeeds (FACTS: GRPO from a random init never learned). The
warm start teaches the model the task's *format* and both behaviours of a mixture — the right answer
with probability `--p-correct` and a systematic wrong one (the task's distractor, e.g. echoing the
digits instead of reversing them) otherwise. Greedy decoding then follows the majority, wrong,
behaviour (validation reward <= 0.3) while sampling finds the right one about `p-correct` of the time:
the GRPO stage is what moves the policy onto it (validation >= 0.9).

    python experiments/warmstart.py                       # writes rlcore/models/weights/tiny-reverse/
    python experiments/warmstart.py --task sort --out /tmp/tiny-sort

Deterministic for a given seed on a given machine (seeded init, seeded batches, no dropout).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from rlcore.data.tasks import compute_score, generate_rows
from rlcore.models import load_policy

DISTRACTORS = {  # the systematic wrong answer of each task, from the prompt text
    "reverse": lambda prompt: prompt.split()[-1],  # echo the digits
    "sort": lambda prompt: prompt.split()[-1],  # echo the digits
    "add": lambda prompt: str(sum(map(int, prompt.split("+"))) + 10),  # off by ten
}


def encode_pairs(tokenizer, rows, answers):
    """Right-padded (input_ids, labels) for prompt + answer + eos; labels are -100 off the answer."""
    seqs, labels = [], []
    for row, answer in zip(rows, answers, strict=True):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, lb) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)], lab[i, : len(lb)] = torch.tensor(s), torch.tensor(lb)
    return ids, lab


@torch.no_grad()
def evaluate(model, tokenizer, rows, *, greedy: bool, max_new_tokens: int = 12, seed: int = 0) -> float:
    """Mean reward of one response per row (greedy or sampled at temperature 1)."""
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [
        compute_score(r["data_source"], a, r["reward_model"]["ground_truth"])
        for r, a in zip(rows, answers, strict=True)
    ]
    return sum(scores) / len(scores)


def fit(model, tokenizer, next_batch, *, steps: int, lr: float) -> None:
    """`steps` AdamW steps (one-cycle schedule, clip 1.0) of cross-entropy on `next_batch()` = (ids, labels)."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    start = time.time()
    for step in range(steps):
        ids, labels = next_batch()
        logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()


def train(args) -> None:
    torch.manual_seed(args.seed)
    model, tokenizer = load_policy(f"builtin:{args.model}", seed=args.seed)
    rows = generate_rows(args.task, "train", args.rows, seed=args.seed)
    val = generate_rows(args.task, "val", 256, seed=args.seed)
    rng = random.Random(args.seed)

    def next_batch():
        batch = [rows[rng.randrange(len(rows))] for _ in range(args.batch)]
        answers = [
            r["reward_model"]["ground_truth"]
            if rng.random() < args.p_correct
            else DISTRACTORS[args.task](r["prompt"][0]["content"])
            for r in batch
        ]
        return encode_pairs(tokenizer, batch, answers)

    fit(model, tokenizer, next_batch, steps=args.steps, lr=args.lr)
    greedy = evaluate(model, tokenizer, val, greedy=True)
    sampled = evaluate(model, tokenizer, val, greedy=False, seed=args.seed)
    print(f"val reward: greedy {greedy:.3f}  sampled {sampled:.3f}  (p_correct {args.p_correct})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    print(f"saved {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="reverse", choices=sorted(DISTRACTORS))
    p.add_argument("--model", default="tiny")
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "rlcore/models/weights/tiny-reverse")
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--p-correct", type=float, default=0.25)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args())


if __name__ == "__main__":
    main()
