"""Synthetic rolled-out batches (the fields of `rlcore.rollout.base`) for the forward/update tests."""

from __future__ import annotations

import torch
from torch import nn

from rlcore.batch import Batch
from rlcore.models.forward import compute_logprobs


def fake_rollout(
    prompts: int, n: int, *, max_prompt: int, max_response: int, vocab: int = 103, seed: int = 0
) -> Batch:
    """`prompts` x `n` rows: left-padded prompts of 2..max_prompt tokens, right-padded responses of
    0..max_response tokens (0 = an empty response), response_mask with a few observation holes."""
    g = torch.Generator().manual_seed(seed)
    b = prompts * n
    p_len = torch.randint(2, max_prompt + 1, (prompts,), generator=g).repeat_interleave(n)  # (b,)
    r_len = torch.randint(0, max_response + 1, (b,), generator=g)  # (b,)
    cols_p = torch.arange(max_prompt)
    attention_mask = (cols_p >= max_prompt - p_len[:, None]).long()  # (b, p), left-padded
    prompt_ids = torch.randint(7, vocab, (prompts, max_prompt), generator=g).repeat_interleave(n, dim=0)
    input_ids = prompt_ids * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    t = int(r_len.max()) if b else 0
    response_attention = (torch.arange(t) < r_len[:, None]).float()  # (b, t), right-padded
    responses = torch.randint(7, vocab, (b, t), generator=g) * response_attention.long()
    holes = torch.rand(b, t, generator=g) < 0.1  # tool observations: attended, not trained on
    response_mask = response_attention * (~holes).float()
    adv = torch.randn(b, generator=g)[:, None] * response_mask  # (b, t)
    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": responses,
            "response_attention": response_attention,
            "response_mask": response_mask,
            "advantages": adv,
            "uid": [f"u{i // n}" for i in range(b)],
        }
    )


def with_logprobs(model: nn.Module, batch: Batch, *, seed: int = 0, noise: float = 0.3) -> Batch:
    """Add old_logprobs (the model's, perturbed so that ratios move off 1), ref_ and rollout_logprobs."""
    g = torch.Generator().manual_seed(seed + 1)
    lp, _ = compute_logprobs(model, batch)
    mask = batch["response_mask"]
    shape, dtype = lp.shape, lp.dtype

    def perturbed() -> torch.Tensor:
        return (lp + noise * torch.randn(shape, generator=g, dtype=dtype)) * mask

    return batch.with_(old_logprobs=perturbed(), ref_logprobs=perturbed(), rollout_logprobs=perturbed())
