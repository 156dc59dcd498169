"""The rollout protocol: what every generation engine takes and returns.

An engine turns a prompt `Batch` into a rolled-out `Batch`:

input (left-padded prompts, one row per prompt)
    tensors      input_ids (b, p) long, attention_mask (b, p), position_ids (b, p)
    non_tensors  uid, data_source, ground_truth, extra_info, raw_prompt (as rlcore.data builds them)
output (each prompt repeated `n` times consecutively, same `uid` — `Batch.repeat_interleave(n)`)
    tensors      the prompt tensors above, repeated
                 responses          (b*n, t) long   generated ids, right-padded with the pad id
                 response_mask      (b*n, t) float32 1 on tokens the policy generated and that count
                                    (the stop token included), 0 on padding and on tool observations
                 response_attention (b*n, t) float32 1 on every real token (observations included),
                                    0 on padding; equals response_mask for single-turn rollouts
                 rollout_logprobs   (b*n, t) float32 log-prob of each generated token under the
                                    distribution it was actually sampled from (temperature, top-k,
                                    top-p, min-p applied); 0 where response_mask is 0
    non_tensors  finish_reason: "stop" (a stop token or string) or "length" (max_tokens reached)
`t` is the longest response in the batch (at most `max_tokens`). Tokens after a stop string's end
are padding. Greedy (`temperature == 0`) gives log-probs of the argmax distribution (0).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from rlcore.batch import Batch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample. `temperature == 0` is greedy decoding."""

    n: int = 1
    """Samples per prompt."""
    max_tokens: int = 16
    """Most new tokens per sample."""
    temperature: float = 1.0
    """Softmax temperature (0 = greedy)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample (included in the response); the tokenizer's EOS is always one."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a sample once decoded (the response keeps the tokens up to the match)."""
    seed: int | None = None
    """Seed of this call's sampling (None: the engine's own generator)."""


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that applies LoRA adapters itself (vLLM's LoRARequest), so a push sends the adapter only."""

    def adapter_dir(self) -> Path:
        """A fresh directory to write the next adapter version into."""
        ...

    def use_adapter(self, directory: str | os.PathLike) -> None:
        """Generate with the peft adapter in `directory` from now on."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine colocated with the trainer."""

    @property
    def module(self) -> nn.Module | None:
        """The torch module it samples with in this process (the native engine's: a push into it is a
        no-op when it is the trained module itself), or None for an engine with its own copy (vLLM)."""
        ...

    @property
    def adapters(self) -> AdapterEngine | None:
        """What takes a LoRA policy's adapters as adapters (vLLM: the engine), or None: the adapters reach
        the engine as weights (`load_weights` of the adapter tensors)."""
        ...

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Roll out `sampling.n` samples per prompt row (see the module docstring for the fields)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full (unsharded) weights, named as in the trainer's Hugging Face model, into the engine."""
        ...

    def sleep(self) -> None:
        """Free what memory the engine can (KV cache, weights) while the trainer runs."""
        ...

    def wake(self) -> None:
        """Undo `sleep` before the next `generate`."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this object (processes, process groups, directories)."""
        ...


class Wrapping:
    """A mixin for an engine around `inner` that changes `generate` only: the weights, adapters, sleep,
    wake and close are `inner`'s (the agent loop, partial rollouts' version tags)."""

    inner: RolloutEngine

    @property
    def module(self) -> nn.Module | None:
        return self.inner.module

    @property
    def adapters(self) -> AdapterEngine | None:
        return self.inner.adapters

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.inner.load_weights(named_tensors)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()
