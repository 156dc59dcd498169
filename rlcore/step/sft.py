"""Supervised fine-tuning through the RL update: the `sft` preset.

With the `gpg` policy loss (-log p * A) and advantages of 1 on the answer tokens, `update_step` takes
exactly the gradient of the token-mean negative log-likelihood, so SFT shares the engine, the
micro-batching, the FSDP2 path and the checkpoints of every other preset. A row's target response is
`extra_info["response"]` when present, else its ground truth (the answer of the built-in tasks).
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore.batch import Batch
from rlcore.data.prompts import pad_token_id


def target_text(ground_truth: Any, extra_info: dict | None) -> str:
    if extra_info and isinstance(extra_info.get("response"), str):
        return extra_info["response"]
    return str(ground_truth)


def sft_batch(prompts: Batch, tokenizer: Any) -> Batch:
    """Prompts + their target responses (and EOS) as a rolled-out Batch with unit advantages."""
    eos, pad = tokenizer.eos_token_id, pad_token_id(tokenizer)
    targets = [
        tokenizer(target_text(gt, info), add_special_tokens=False)["input_ids"] + [eos]
        for gt, info in zip(prompts["ground_truth"], prompts["extra_info"], strict=True)
    ]
    width = max(map(len, targets))
    responses = torch.full((len(targets), width), pad, dtype=torch.long)  # (b, t) right-padded
    mask = torch.zeros(len(targets), width)  # (b, t)
    for i, ids in enumerate(targets):
        responses[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1.0
    return prompts.with_(
        responses=responses,
        response_mask=mask,
        response_attention=mask.clone(),
        rollout_logprobs=torch.zeros_like(mask),
        old_logprobs=torch.zeros_like(mask),
        advantages=mask.clone(),
        finish_reason=["stop"] * len(targets),
    )
