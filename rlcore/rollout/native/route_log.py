"""The experts a mixture of experts routed each token to during one native `generate` call
(`NativeEngine(record_routes=True)`, `rlcore.rollout.native.engine`).

    with RouteLog(tap, prompts, sampling, width) as routes:     # traces the model's own routers
        ...                                                     # after each forward:
        routes.prefilled(rows, sampled)  /  routes.fed(rows, step)
    batch = batch.with_(**routes.fields(lengths - 1, t, device))  # prompt_routes, response_routes

Why: router replay (`rlcore.models.moe`) makes the trainer's forward send every token to the experts the
sampler chose, so the engine has to keep them. The routers are traced (`RouterTap.tracing`) for the whole
call, and after each forward the traced routes are filed by output row: a prefill's under the prompt
columns (shared by a prompt's n samples when it was prefilled once) and the response tokens it re-fed
(a restart after new weights), a decode step's under the token it fed. A token never fed (prompt
padding, each row's last sampled token, the columns after it) keeps -1.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.models.moe import RouterTap
from rlcore.rollout.base import SamplingParams


class RouteLog:
    """The experts a mixture of experts routed each token of one `generate` call to (`record_routes`):
    a context that traces the routers, and after each forward files its routes by output row."""

    def __init__(self, tap: RouterTap, prompts: Batch, sp: SamplingParams, width: int) -> None:
        """`width`: the prompt columns each prefill runs (more than `prompts`' in exact mode, whose extra
        leading padding columns are dropped from the log)."""
        self.tap, self.n, self.p, self.width = tap, sp.n, prompts["input_ids"].shape[1], width
        rows, shape = len(prompts) * sp.n, (tap.layers, tap.top_k)
        self.prompt = torch.full((rows, self.p, *shape), -1, dtype=torch.int16)
        self.response = torch.full((rows, sp.max_tokens, *shape), -1, dtype=torch.int16)
        self.padding = prompts["attention_mask"].cpu().repeat_interleave(sp.n, dim=0) == 0  # (rows, p)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RouteLog:
        self.trace = self._stack.enter_context(self.tap.tracing())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def prefilled(self, rows: Tensor, sampled: int) -> None:
        """A prefill of the prompts (+ the first `sampled` tokens) of output rows `rows`, or of each
        prompt once for its n samples (fewer prefilled rows than `rows`)."""
        routes = self.trace.take(self.tap.layers).cpu().to(torch.int16)  # (R * (width + sampled), L, k)
        routes = routes.view(-1, self.width + sampled, *routes.shape[1:])[:, self.width - self.p :]
        if routes.shape[0] != len(rows):  # one prefill per prompt, shared by its n samples
            routes = routes.repeat_interleave(self.n, dim=0)
        self.prompt[rows] = routes[:, : self.p]
        self.response[rows, :sampled] = routes[:, self.p :]

    def fed(self, rows: Tensor, step: int) -> None:
        """A decode step that fed token `step` of output rows `rows`."""
        self.response[rows, step] = self.trace.take(self.tap.layers).cpu().to(torch.int16)

    def fields(self, last: Tensor, width: int, device: torch.device) -> dict[str, Tensor]:
        """`prompt_routes` and `response_routes` cut to `width` columns, -1 on prompt padding and from
        each row's last token (`last` (rows,): it was sampled, never fed) on."""
        response = self.response[:, :width].clone()
        response[torch.arange(width)[None, :] >= last[:, None]] = -1
        prompt = self.prompt.masked_fill(self.padding[:, :, None, None], -1)
        return {"prompt_routes": prompt.to(device), "response_routes": response.to(device)}
