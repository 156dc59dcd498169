"""A seeded cookbook-style RL step for the tests: sample (one seed per request) -> reward -> advantages ->
forward_backward(importance_sampling) -> optim_step; it returns everything the server gave back."""

from __future__ import annotations

import torch
from tinker import types

from rlcore.data.tasks import compute_score, generate_rows

WAIT = 120
ROWS = generate_rows("reverse", "train", 64)


def prompt_ids(tokenizer, row) -> list[int]:
    text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def rl_step(training, tokenizer, step: int, prompts: int = 4, group: int = 4) -> dict:
    sampler = training.save_weights_and_get_sampling_client().result(WAIT)
    rows = ROWS[step * prompts : (step + 1) * prompts]
    ids = [prompt_ids(tokenizer, r) for r in rows]
    futures = [sampler.sample(types.ModelInput.from_ints(p), group,
                              types.SamplingParams(max_tokens=12, temperature=1.0, seed=1000 * step + i))
               for i, p in enumerate(ids)]  # fmt: skip
    data, tokens = [], []
    for row, p, f in zip(rows, ids, futures, strict=True):
        seqs = f.result(WAIT).sequences
        scores = [compute_score(row["data_source"], tokenizer.decode(s.tokens, skip_special_tokens=True),
                                row["reward_model"]["ground_truth"]) for s in seqs]  # fmt: skip
        mean = sum(scores) / len(scores)
        for s, score in zip(seqs, scores, strict=True):
            full, pad = p + s.tokens, [0.0] * (len(p) - 1)
            tokens.append(list(s.tokens))
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + list(s.logprobs),
                                                    "advantages": pad + [score - mean] * len(s.tokens)}))  # fmt: skip
    out = training.forward_backward(data, "importance_sampling").result(WAIT)
    optim = training.optim_step(types.AdamParams(learning_rate=1e-3)).result(WAIT)
    return {"tokens": tokens, "loss": out.metrics["loss:sum"], "grad_norm": optim.metrics["grad_norm"],
            "logprobs": [o["logprobs"].to_torch() for o in out.loss_fn_outputs]}  # fmt: skip


def same(a: dict, b: dict) -> bool:
    """Bit for bit: the sampled tokens, the loss, the gradient norm and every log-prob."""
    return (a["tokens"] == b["tokens"] and a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
            and all(torch.equal(x, y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)))  # fmt: skip
