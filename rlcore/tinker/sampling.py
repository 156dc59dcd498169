"""`sample` through rlcore's engine: the requests waiting together become as few `generate` calls as
their options allow (`rlcore.rollout.worker.grouped` with the key `seeded_alone`: requests with the same
sampling options and no seed share one call; a seeded request runs alone, so its tokens depend on its seed
only), and each gets its sequences, their log-probs and, when asked, its prompt's log-probs under the
sampler's weights. Past the operation's deadline (`--op-timeout-s`) the engine stops between decode steps
and the requests of that batch fail in one line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.sampling import check_sampling
from rlcore.rollout.worker import Sample, generate, grouped
from rlcore.tinker.errors import UserError
from rlcore.tinker.limits import Deadline
from rlcore.tinker.rows import prompt_row, right_aligned, row_inputs, row_logprobs
from rlcore.tinker.wire import Sampled, encode_sample


@dataclasses.dataclass(frozen=True)
class SampleOp:
    """One `/asample` request."""

    sampler_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    """Its options, `n` = num_samples."""
    prompt_logprobs: bool


def sampling_params(params: dict[str, Any], n: int) -> SamplingParams:
    """The SDK's SamplingParams (JSON) as rlcore's; a UserError for values the engine cannot take."""
    stop = params.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stop) and not all(isinstance(s, int) for s in stop):
        raise UserError("sampling_params.stop: give strings or token ids, not both")
    max_tokens, top_k = params.get("max_tokens"), int(params.get("top_k", -1))
    if max_tokens is None or int(max_tokens) < 1:
        raise UserError("sampling_params.max_tokens: give a positive number of tokens to sample")
    strings = tuple(s for s in stop if isinstance(s, str))
    try:
        check_sampling(temperature=float(params.get("temperature", 1.0)), top_k=max(top_k, 0),
                       top_p=float(params.get("top_p", 1.0)), min_p=0.0)  # fmt: skip
    except ValueError as e:
        raise UserError(str(e).replace("sampling.", "sampling_params.")) from None
    return SamplingParams(n=n, max_tokens=int(max_tokens), temperature=float(params.get("temperature", 1.0)),
                          top_p=float(params.get("top_p", 1.0)), top_k=max(top_k, 0),
                          stop_token_ids=tuple(s for s in stop if isinstance(s, int)), stop_strings=strings,
                          seed=params.get("seed"))  # fmt: skip


def prompt_tokens(prompt: Any) -> tuple[int, ...]:
    """The token ids of a JSON ModelInput (token chunks only), or a UserError."""
    chunks = prompt.get("chunks", []) if isinstance(prompt, dict) else None
    if chunks is None:
        raise UserError("prompt: expected a ModelInput with chunks")
    ids: list[int] = []
    for k, chunk in enumerate(chunks):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt chunk {k} is {chunk.get('type')}; this server takes token chunks only")
        try:
            ids.extend(int(t) for t in chunk.get("tokens", []))
        except (TypeError, ValueError):
            raise UserError(f"prompt chunk {k}: tokens must be integers") from None
    if not ids:
        raise UserError("prompt: an empty prompt")
    return tuple(ids)


def fitted(sampling: SamplingParams, prompt: Sequence[int], context: int, model: str) -> SamplingParams:
    """`sampling` with max_tokens cut to what the context leaves after `prompt`; a UserError for a prompt that
    leaves no room."""
    if len(prompt) >= context:
        raise UserError(f"prompt of {len(prompt)} tokens: {model} has a context of {context} tokens, and sampling "
                        "needs room for one more; send a shorter prompt")  # fmt: skip
    return dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, context - len(prompt)))


def _stop_past(deadline: Deadline) -> Callable[[Tensor], None]:
    """The engine's `each_step` hook that stops a `generate` at its first decode step past `deadline`."""

    def check(sampled: Tensor) -> None:
        if deadline.passed():
            raise UserError(deadline.message("sample", f"after {int(sampled.max())} tokens; nothing was returned"))

    return check


def seeded_alone(i: int, sampling: SamplingParams) -> Hashable:
    """The group key of a sample request: equal options share a `generate`; a seeded request has one of its own."""
    return ("seeded", i) if sampling.seed is not None else sampling


def run_samples(engine: Any, pad_id: int, ops: Sequence[SampleOp], deadline: Deadline) -> list[bytes]:
    """Each request's `SampleResponse` body, in order (see the module docstring for the batching)."""
    sequences: dict[int, list[Sample]] = {}
    for members in grouped([op.sampling for op in ops], seeded_alone):
        with engine.each_step(_stop_past(deadline)):
            outs = generate(engine, pad_id, [ops[i].prompt for i in members], ops[members[0]].sampling)
        sequences.update(zip(members, outs, strict=True))
    return [encode_sample([_sampled(s) for s in sequences[i]],
                          _prompt_logprobs(engine, op.prompt) if op.prompt_logprobs else None)
            for i, op in enumerate(ops)]  # fmt: skip


def _sampled(sample: Sample) -> Sampled:
    return Sampled(tokens=list(sample.tokens), logprobs=list(sample.logprobs), stop=sample.finish_reason == "stop")


@torch.no_grad()
def _prompt_logprobs(engine: Any, prompt: tuple[int, ...]) -> list[float]:
    """The prompt's log-probs under the engine's weights: NaN at position 0, which nothing predicts."""
    if len(prompt) < 2:
        return [float("nan")] * len(prompt)
    module = engine.module
    if module is None:
        raise UserError("prompt log-probs need the native engine (this engine holds its weights elsewhere)")
    inputs, _ = row_inputs([prompt_row(prompt)], engine.pad_id, engine.device)
    lp = right_aligned(row_logprobs(module, inputs), [len(prompt) - 1])[0]
    return [float("nan"), *lp.tolist()]
