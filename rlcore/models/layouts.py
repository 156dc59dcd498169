"""Forward layouts as values: how one micro-batch's rows meet a model, for the actor and the critic alike.

    layout = layout_of(model, inputs)            # Rows, Packed or SequenceParallel
    feed = layout.feed(model)                    # what the model call takes
    with adapted(model, layout) as extra:        # the family's adapters: routes replayed, images fed
        out = model(feed.input_ids, ..., **extra)  # the caller's own model: logits, or a critic's values
    logprob = layout.per_token(out, fn)          # (m, r): fn(outputs predicting each response token, labels)

- `Rows`: one row per sample, [trimmed prompt | trimmed response]; the last r + 1 positions predict.
- `Packed`: one row per prompt with its responses after it (`rlcore.models.shared_prompt`), a 4D mask;
  `ModelInputs.gather` picks the position predicting each response token.
- `SequenceParallel`: the row layout's sequences cut over the sp ranks (`rlcore.dist.ulysses`); `fn` runs
  on this rank's columns (log-probs before the gather: the vocabulary never crosses ranks), then the
  columns are gathered and each response token's value picked.

A layout is chosen per micro-batch (`layout_of`): sequence-parallel where the model was split by
`apply_sp`, else what `rlcore.models.forward.model_inputs` built. The adapters (`ADAPTERS`) are the
family's extras entered around every forward of a layout: a mixture of experts replays the routes the
layout carries (`rlcore.models.moe`), a vision-language model takes the images it carries
(`rlcore.models.vision.feeding`). A new extra is a new row in that table, not a branch in a forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from rlcore.dist.attention import attention_of
from rlcore.dist.ulysses import SequenceLayout, gather_sequence, sp_group
from rlcore.models.moe import router_tap
from rlcore.models.vision import Images, feeding

if TYPE_CHECKING:
    from rlcore.models.forward import ModelInputs

PerToken = Callable[[Tensor, Tensor], Tensor]
"""(outputs at the positions that predict, (..., n, *), labels (..., n)) -> one value per position (..., n)."""


@dataclasses.dataclass(frozen=True)
class Feed:
    """One model call's inputs as a layout lays them out."""

    input_ids: Tensor
    attention_mask: Tensor | None
    """2D padding mask (rows), the model's 4D mask (packed), or None (sequence-parallel: no padding)."""
    position_ids: Tensor
    keep: int
    """Positions the call must return, counted from the end (`logits_to_keep`; 0: every position)."""


class Layout(Protocol):
    """How a micro-batch's rows meet the model (module docstring)."""

    routes: Tensor | None
    """The recorded routes the forward replays ((tokens, L, k), in the fed order), or None."""
    images: Images | None
    """The images the forward takes, or None."""
    device: torch.device
    """Where the fed tensors are."""

    def feed(self, model: nn.Module) -> Feed: ...

    def per_token(self, out: Tensor, fn: PerToken) -> Tensor: ...


@dataclasses.dataclass(frozen=True)
class Rows:
    """One row per sample: the last r + 1 positions of the call predict the r response tokens."""

    inputs: ModelInputs

    @property
    def routes(self) -> Tensor | None:
        return self.inputs.routes

    @property
    def images(self) -> Images | None:
        return self.inputs.vision

    @property
    def device(self) -> torch.device:
        return self.inputs.input_ids.device

    def feed(self, model: nn.Module) -> Feed:
        i = self.inputs
        return Feed(i.input_ids, i.attention_mask, i.position_ids, keep=i.labels.shape[1] + 1)

    def per_token(self, out: Tensor, fn: PerToken) -> Tensor:
        r = self.inputs.labels.shape[1]
        first = out.shape[1] - r - 1  # the last prompt position predicts the first response token
        return fn(out[:, first : out.shape[1] - 1], self.inputs.labels)  # (m, r, ...)


@dataclasses.dataclass(frozen=True)
class Packed:
    """One row per prompt and its responses: `gather` picks each response token's predicting position."""

    inputs: ModelInputs
    images = None  # a vision-language batch runs in rows (`model_inputs`)

    @property
    def routes(self) -> Tensor | None:
        return self.inputs.routes

    @property
    def device(self) -> torch.device:
        return self.inputs.input_ids.device

    def feed(self, model: nn.Module) -> Feed:
        i = self.inputs
        return Feed(i.input_ids, packed_mask(model, i), i.position_ids, keep=i.keep)

    def per_token(self, out: Tensor, fn: PerToken) -> Tensor:
        kept = out[:, out.shape[1] - self.inputs.keep :]
        return fn(kept.reshape(-1, *out.shape[2:])[self.inputs.gather], self.inputs.labels)  # (m, r, ...)


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """The row layout cut over the sp ranks of `group`: this rank's columns in, every response token out."""

    group: Any
    layout: SequenceLayout
    ids: Tensor
    """(m, c) this rank's columns of the shifted rows."""
    positions: Tensor
    """(m, c) their positions (each row starts at 0)."""
    labels: Tensor
    """(m, c) the token each of this rank's columns predicts."""
    columns: Tensor
    """(m, r) the column predicting each response token, in the gathered sequence."""
    routes = None  # sharded sequences carry no routes (replay is refused with sp)
    images = None  # nor images (refused with sp)

    @classmethod
    def of(cls, inputs: ModelInputs, group: Any) -> SequenceParallel:
        if inputs.packed:
            raise ValueError("sequence parallelism takes row inputs, not prompt-packed ones (share_prompts=False)")
        sp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        layout = SequenceLayout.of(inputs.attention_mask, sp)
        shifted = layout.shift(inputs.input_ids)  # (m, width)
        positions = torch.arange(layout.width, device=shifted.device).expand_as(shifted)
        m, r = inputs.labels.shape
        first = inputs.input_ids.shape[1] - r - 1  # the last prompt column predicts the first response token
        columns = (first + torch.arange(r, device=shifted.device)).expand(m, r)
        following = torch.cat([shifted[:, 1:], shifted[:, :1]], dim=1)  # the next token of each column
        return cls(group, layout, layout.local(shifted, rank), layout.local(positions, rank),
                   layout.local(following, rank), columns)  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def feed(self, model: nn.Module) -> Feed:
        return Feed(self.ids, None, self.positions, keep=0)

    def per_token(self, out: Tensor, fn: PerToken) -> Tensor:
        return self.layout.unshift(gather_sequence(fn(out, self.labels), self.group), self.columns)


def layout_of(model: nn.Module, inputs: ModelInputs) -> Layout:
    """The layout one forward of `model` runs `inputs` in (module docstring)."""
    group = sp_group(model)
    if group is not None:
        return SequenceParallel.of(inputs, group)
    return Packed(inputs) if inputs.packed else Rows(inputs)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as eager attention's additive float mask (0 where allowed, dtype min elsewhere)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def packed_mask(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """The packed inputs' 4D mask as `model`'s attention takes it: bool (sdpa), additive float (eager)."""
    if attention_of(model) == "eager":
        return _additive(inputs.attention_mask, next(model.parameters()).dtype)
    return inputs.attention_mask


# ---------------------------------------------------------------------------------------- the adapters


@contextlib.contextmanager
def _replaying(model: nn.Module, layout: Layout) -> Iterator[dict[str, Tensor]]:
    """A mixture of experts routes the forward's tokens by the layout's recorded routes (none: its own).
    The replay stays set after the block: a checkpointed backward recomputes the forward under it; the
    pass that set it clears it (`rlcore.models.forward.compute_logprobs`, `rlcore.step.update.update_step`)."""
    tap = router_tap(model)
    if tap is not None:
        tap.set_replay(layout.routes)
    yield {}


@contextlib.contextmanager
def _feeding(model: nn.Module, layout: Layout) -> Iterator[dict[str, Tensor]]:
    """A vision-language model takes the layout's images (their forward keywords)."""
    images = layout.images
    with feeding(model, None if images is None else images.to(layout.device)) as keywords:
        yield keywords


ADAPTERS: tuple[Callable[[nn.Module, Layout], contextlib.AbstractContextManager[dict[str, Tensor]]], ...] = (
    _replaying,
    _feeding,
)
"""The family extras entered around every forward, in order; each yields its forward keywords."""


@contextlib.contextmanager
def adapted(model: nn.Module, layout: Layout) -> Iterator[dict[str, Tensor]]:
    """Enter every adapter of `ADAPTERS` for one forward of `model` in `layout`; yields their keywords."""
    with contextlib.ExitStack() as stack:
        keywords: dict[str, Tensor] = {}
        for adapter in ADAPTERS:
            keywords |= stack.enter_context(adapter(model, layout))
        yield keywords
