"""Fake causal LMs for the rollout tests, shaped like a Hugging Face model as the native engine uses it.

The fixed-logits and scripted models keep the token ids they have seen in the engine's own KV cache
(as the "keys" of layer 0), so the engine's cache handling (preallocation, dropping finished rows) is
exercised for real and the model always knows each row's full context. `BiasedLM` wraps a real model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
from torch import Tensor, nn


def _context_ids(cache, input_ids: Tensor, attention_mask: Tensor) -> list[list[int]]:
    """Store `input_ids` in layer 0 of `cache` and return every row's unpadded context so far."""
    ids = input_ids[:, None, :, None].to(torch.float64)  # (b, 1, s, 1): token ids as "keys"
    keys, _ = cache.update(ids, ids, 0)
    full = keys[:, 0, :, 0].long()  # (b, L)
    assert full.shape == attention_mask.shape, (full.shape, attention_mask.shape)
    return [row[m.bool()].tolist() for row, m in zip(full, attention_mask, strict=True)]


class FixedLogitsLM(nn.Module):
    """Returns the same next-token logits at every position, whatever the input."""

    def __init__(self, logits: Sequence[float]) -> None:
        super().__init__()
        self.fixed = nn.Parameter(torch.tensor(logits, dtype=torch.float32), requires_grad=False)
        self.config = SimpleNamespace(num_hidden_layers=1)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> SimpleNamespace:
        _context_ids(cache, input_ids, attention_mask)
        s = 1 if logits_to_keep == 1 else input_ids.shape[1]
        return SimpleNamespace(logits=self.fixed.expand(input_ids.shape[0], s, -1))


class ScriptedLM(nn.Module):
    """Emits `script(context ids) -> next id` with logit `margin` above every other token.

    Its forward names the cache argument `past_key_values` (transformers < 5.20) when
    `legacy_cache_kw`, else `cache` (transformers >= 5.20), and takes no logits_to_keep.
    """

    def __init__(self, script: Callable[[list[int]], int], vocab_size: int, *, margin: float = 40.0) -> None:
        super().__init__()
        self.script, self.vocab_size, self.margin = script, vocab_size, margin
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.config = SimpleNamespace(num_hidden_layers=1)
        self.calls: list[int] = []  # batch size of each forward call

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, cache) -> SimpleNamespace:
        contexts = _context_ids(cache, input_ids, attention_mask)
        self.calls.append(len(contexts))
        logits = torch.zeros((len(contexts), input_ids.shape[1], self.vocab_size))
        for i, ctx in enumerate(contexts):
            logits[i, -1, self.script(ctx)] = self.margin
        return SimpleNamespace(logits=logits)


class ScriptedLMCache(ScriptedLM):
    def forward(self, input_ids, attention_mask, position_ids, cache=None, use_cache=True):
        return self._logits(input_ids, attention_mask, cache)


class ScriptedLMLegacy(ScriptedLM):
    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True):
        return self._logits(input_ids, attention_mask, past_key_values)


def turn_script(
    tokenizer, turns: Sequence[str], *, marker: str = "<|assistant|>", result_close: str = "</result>"
):
    """A script that writes `turns[k]` (as the tokenizer encodes it) after the k-th observation.

    The response is what follows the last `marker` token; observations are counted by
    `result_close`; once a turn's text is exhausted the script emits EOS.
    """
    marker_id = tokenizer.convert_tokens_to_ids(marker)
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]

    def script(ctx: list[int]) -> int:
        start = len(ctx) - ctx[::-1].index(marker_id)
        text = tokenizer.decode(ctx[start:], skip_special_tokens=False)
        k = text.count(result_close)
        current = text.rpartition(result_close)[2] if k else text
        done = len(tokenizer(current, add_special_tokens=False)["input_ids"])
        target = encoded[k] if k < len(encoded) else []
        return target[done] if done < len(target) else tokenizer.eos_token_id

    return script


class BiasedLM(nn.Module):
    """A real Hugging Face causal LM with a constant vector added to its logits (to make some tokens
    frequent); the forward signature mirrors the wrapped model's cache keyword."""

    def __init__(self, model: nn.Module, bias: Tensor) -> None:
        super().__init__()
        self.inner, self.config = model, model.config
        self.register_buffer("bias", bias, persistent=False)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0
    ):
        kw = {self.cache_kw: cache} if cache is not None else {}
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kw,
        )
        return SimpleNamespace(logits=out.logits + self.bias)


def pieces(tokenizer, out, i: int) -> list[tuple[str, int]]:
    """Row `i`'s response as (text, mask) runs: consecutive tokens with the same response_mask."""
    n = int(out["response_attention"][i].sum())
    ids, mask = out["responses"][i, :n].tolist(), out["response_mask"][i, :n].tolist()
    runs, start = [], 0
    for j in range(1, n + 1):
        if j == n or mask[j] != mask[start]:
            runs.append((tokenizer.decode(ids[start:j], skip_special_tokens=False), int(mask[start])))
            start = j
    return runs
