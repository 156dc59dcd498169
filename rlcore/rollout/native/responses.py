"""The native engine's output rows during one decode (`rlcore.rollout.native.engine`): the tokens and log-probs
sampled so far, and when each row finishes.

    out = Responses(rows, max_tokens, pad_id, device, tokenizer, model, sampling)
    done = out.add(step, tokens, logprobs, where, live, n_live)   # (a,) bool: rows stopping at `step`
    out.stop(rows, step)                                          # their lengths and finish reasons

A row finishes at a stop token (`stop_token_ids`: the sampling's ids plus the tokenizer's and the model's
EOS ids), at a stop string, or at `max_tokens` ("length"). Stop strings are checked each step on the
decoded tail of each live row only, as many tokens as the longest stop string has characters plus one
(every token is at least one character), in one `batch_decode` call, so the check costs the same at every
step however long the responses grow. The decode loop's batch positions map to output rows by `where`
(rows compacted away are no longer in it), and `live` marks the positions still sampling.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from rlcore.rollout.base import SamplingParams


def stop_token_ids(tokenizer: Any, model: torch.nn.Module, extra: Iterable[int] = ()) -> list[int]:
    """`extra` plus the tokenizer's EOS and the model's generation-config EOS ids (deduplicated, sorted)."""
    ids = set(extra)
    generation = getattr(model, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return sorted(ids)


class StopStrings:
    """Checks each live row's decoded tail for the stop strings (one batch_decode per step)."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer, self.strings = tokenizer, tuple(s for s in stop_strings if s)
        self.window = max((len(s) for s in self.strings), default=0) + 1  # tokens: >= 1 character each

    def __bool__(self) -> bool:
        return bool(self.strings)

    def hits(self, tokens: Tensor, where: Tensor, live: Tensor, step: int) -> Tensor:
        """(a,) bool: live rows whose response so far ends inside a stop string's first occurrence."""
        rows = where[live].tolist()
        start = max(0, step + 1 - self.window)
        tails = tokens[rows, start : step + 1].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        hit = [any(s in text for s in self.strings) for text in texts]
        out = torch.zeros(live.shape, dtype=torch.bool, device=live.device)
        out[live] = torch.tensor(hit, dtype=torch.bool, device=live.device)
        return out


class Responses:
    """The output rows of one decode: tokens and log-probs (rows, max_tokens), lengths (rows,) and finish
    reasons, and what stops a row."""

    def __init__(
        self, rows: int, max_tokens: int, pad_id: int, device: torch.device, tokenizer: Any,
        model: torch.nn.Module, sp: SamplingParams,
    ) -> None:  # fmt: skip
        self.tokens = torch.full((rows, max_tokens), pad_id, dtype=torch.long, device=device)  # (b, T)
        self.logprobs = torch.zeros((rows, max_tokens), dtype=torch.float32, device=device)
        self.lengths = torch.full((rows,), max_tokens, dtype=torch.long)
        self.reasons = ["length"] * rows
        self.stop_ids = torch.tensor(stop_token_ids(tokenizer, model, sp.stop_token_ids), device=device)
        self.strings = StopStrings(tokenizer, sp.stop_strings)

    def add(self, step: int, tok: Tensor, logp: Tensor, where: Tensor, live: Tensor, n_live: int) -> Tensor:
        """Write token `step` (`tok`, `logp` (a,), one per batch position) into the live positions' output
        rows `where`: (a,) bool, the live positions it stops (a stop token, or a stop string)."""
        if n_live == live.shape[0]:  # every row live (the usual case after a compaction)
            self.tokens[where, step], self.logprobs[where, step] = tok, logp
            done = torch.isin(tok, self.stop_ids)  # (a,)
        else:
            out_rows = where[live]
            self.tokens[out_rows, step] = tok[live]
            self.logprobs[out_rows, step] = logp[live]
            done = torch.isin(tok, self.stop_ids) & live  # (a,)
        if self.strings:
            done |= self.strings.hits(self.tokens, where, live, step)
        return done

    def stop(self, rows: list[int], step: int) -> None:
        """Output rows `rows` stopped at token `step`."""
        for r in rows:
            self.lengths[r], self.reasons[r] = step + 1, "stop"
