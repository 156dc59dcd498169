"""rlcore's rollout protocol (`rlcore.rollout.base`) in vLLM's terms, both ways: the sampling settings
of a request, and the response fields of vLLM's completions.

    params = vllm.SamplingParams(**vllm_sampling_fields(sampling), seed=seed)
    fields = response_fields(samples, greedy, pad_token_id)   # responses, masks, log-probs, finish reasons

The vLLM engine (`rlcore.rollout.vllm.engine`) sends every request through `vllm_sampling_fields` and
turns what comes back into the batch fields every engine returns with `response_fields`. Greedy requests
ask for no log-probs (their `rollout_logprobs` are 0) and drop the filters that do nothing at temperature
0; text is detokenized only when stop strings need it. `StepwiseSample` holds one sample of a generate driven one
engine step at a time, grown from vLLM's delta outputs into what a final completion holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlcore.rollout.base import SamplingParams


@dataclasses.dataclass
class StepwiseSample:
    """One sample of a stepwise generate, grown by vLLM's delta outputs (the fields of a final
    `CompletionOutput` that `response_fields` reads)."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, part: Any) -> None:
        """Append one step's `CompletionOutput` (delta): its tokens, their log-probs, its finish."""
        self.token_ids.extend(part.token_ids)
        self.logprobs.extend(part.logprobs or ())
        self.finish_reason = part.finish_reason or self.finish_reason


def vllm_sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM `SamplingParams` fields (all but the seed) for one prompt."""
    greedy = sampling.temperature == 0
    return {
        "n": sampling.n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0 if greedy else sampling.top_k,
        "min_p": 0.0 if greedy else sampling.min_p,
        "stop_token_ids": list(sampling.stop_token_ids),
        "stop": list(sampling.stop_strings),
        "logprobs": None if greedy else 0,  # 0: only the sampled token's log-prob
        "detokenize": bool(sampling.stop_strings),  # text is only needed to match stop strings
    }


def response_fields(samples: list[Any], greedy: bool, pad_token_id: int) -> dict[str, Any]:
    """Right-padded responses, masks, log-probs and finish reasons of the vLLM samples."""
    t = max((len(s.token_ids) for s in samples), default=0)
    responses = torch.full((len(samples), t), pad_token_id, dtype=torch.long)  # (b*n, t)
    response_mask = torch.zeros(len(samples), t, dtype=torch.float32)  # (b*n, t)
    logprobs = torch.zeros(len(samples), t, dtype=torch.float32)  # (b*n, t)
    for row, sample in enumerate(samples):
        tokens = list(sample.token_ids)
        responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[row, : len(tokens)] = 1.0
        if not greedy:
            values = [step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)]
            logprobs[row, : len(tokens)] = torch.tensor(values, dtype=torch.float32)
    return {
        "responses": responses,
        "response_mask": response_mask,
        "response_attention": response_mask.clone(),
        "rollout_logprobs": logprobs,
        "finish_reason": ["length" if s.finish_reason == "length" else "stop" for s in samples],
    }
