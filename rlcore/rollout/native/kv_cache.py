"""The native engine's Hugging Face KV caches (`rlcore.rollout.native.engine`), and the decode state over them.

    cache = new_cache(config, "auto", prealloc=True, capacity=p + max_tokens)
    state = HFState(step, static, cache, mask, positions, p)     # after the prefill into `cache`
    logits = state.step(tokens)                                  # (a,) -> (a, v)
    state.select(keep)                                           # drop finished rows

Which cache: "static" is HF's `StaticCache` (fixed shapes, for compile and CUDA graphs); "auto" on a model
whose every layer is full attention is a `Cache` of `PreallocatedLayer`s, each with room for the prompt
and every response token, written in place, so a decode step copies one position instead of
concatenating the whole cache; any other model gets HF's `DynamicCache`. The lean step
(`rlcore.rollout.native.lean`) takes its prefill from the preallocated layers' buffers.

`HFState` is the Hugging Face step's side of a decoding: the cache, the attention mask over prompt and
response (its response columns switched on one step at a time) and each row's next position; the
engine's forward is passed in as `step`, so this module needs nothing of the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer with room for `capacity` positions, written in place.

    `update` writes the new keys/values after the ones already held and returns views of the filled
    part, so a decode step copies one position instead of concatenating the whole cache.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.key_buffer = key_states.new_empty((b, h, self.capacity, dk))  # (b, h, c, d)
        self.value_buffer = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times (n samples after one prefill of each prompt)."""
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0] * repeats, *old.shape[1:]))
            new[:, :, : self.length] = old[:, :, : self.length].repeat_interleave(repeats, dim=0)
            setattr(self, name, new)
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep rows `indices` (copies only the filled positions into new buffers)."""
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((indices.shape[0], *old.shape[1:]))
            new[:, :, : self.length] = old[indices, :, : self.length]
            setattr(self, name, new)
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False
        self.keys = self.values = self.key_buffer = self.value_buffer = None


def new_cache(config: Any, kind: str, prealloc: bool, capacity: int) -> Cache:
    """An empty cache for `capacity` positions: HF's `StaticCache` for `kind` "static", preallocated layers
    where `prealloc` (every layer full attention, "auto"), else HF's `DynamicCache`."""
    if kind == "static":
        return StaticCache(config=config, max_cache_len=capacity)
    if prealloc:
        return Cache(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity))
    return DynamicCache(config=config) if isinstance(config, PretrainedConfig) else DynamicCache()


class HFState:
    """The Hugging Face decode step's state: its cache, the attention mask (b, p + T) whose response
    columns are switched on one step at a time, and each row's next position (b, 1)."""

    def __init__(
        self, step: Callable[[Tensor, Tensor, Tensor, Cache], Tensor], static: bool, cache: Cache, mask: Tensor,
        pos: Tensor, p: int,
    ) -> None:  # fmt: skip
        """`step(ids (a, 1), mask, positions (a, 1), cache)`: the engine's forward, the logits (a, v) after
        each row's token; `static`: a static cache, which takes the full-length mask."""
        self.forward, self.static = step, static
        self.cache, self.mask, self.pos, self.fed = cache, mask, pos, p

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` (a,): the logits (a, v) of the token after each."""
        self.mask[:, self.fed] = 1  # the token fed now
        self.fed += 1
        step_mask = self.mask if self.static else self.mask[:, : self.fed]
        logits = self.forward(tokens[:, None], step_mask, self.pos, self.cache)
        self.pos = self.pos + 1
        return logits

    def select(self, keep: Tensor) -> None:
        """Keep rows `keep` of the batch."""
        self.cache.batch_select_indices(keep)
        self.mask, self.pos = self.mask[keep], self.pos[keep]
