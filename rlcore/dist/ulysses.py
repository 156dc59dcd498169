"""Ulysses sequence parallelism: each sequence's tokens split over the `sp` ranks, all-to-all around attention.

    apply_sp(model, mesh["sp"])                  # attention through `ulysses_attention`, the group kept on the model
    layout = SequenceLayout.of(attention, sp)    # rows shifted to start at column 0, width a multiple of sp
    local = layout.local(ids, rank)              # this rank's columns
    outputs = gather_sequence(local_outputs, group)    # (m, width, ...) on every rank, grads to their owner

A rank holds columns [rank * c, (rank + 1) * c) of every row (c = width / sp) through embeddings, norms,
MLPs and the head; around attention, one all-to-all turns (b, heads, c, d) into (b, heads / sp, width,
d) — every token for a slice of the heads — and one more turns the output back (DeepSpeed-Ulysses).
Rows are shifted left so that each starts at column 0 (a left-padded prompt, then the response,
padding at the end): causal attention is then exact without a padding mask (no real token sees a pad
key), so the memory-lean sdpa kernels run and no (width x width) mask is built. Position ids restart
at 0 on each row's first real token, as the unsplit forward's `cumsum(attention) - 1` does.

Outputs per position (log-probs, entropies, values) are gathered, not logits: each rank's backward then
reaches only its own columns, so the parameters' gradients are partial sums over the sp ranks, which
FSDP2's reduction over (dp_shard x sp) adds up. The caller computes the same loss on every sp rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from rlcore.dist.attention import has_switch, with_attention

ATTENTION = "rlcore_ulysses"
"""The attention implementation name `apply_sp` registers with transformers."""

_GROUP_ATTR = "_rlcore_sp_group"


def sp_problem(config: Any, sp: int, tp: int = 1) -> str | None:
    """One line on why `config` cannot run Ulysses over `sp` ranks (after `tp`), None if it can."""
    if sp == 1:
        return None
    heads = config.num_attention_heads
    if heads % (tp * sp):
        return f"num_attention_heads {heads} not divisible by tp({tp}) * sp({sp}); use an sp that divides them"
    window = [getattr(config, k, None) for k in ("sliding_window", "attention_chunk_size")]
    if getattr(config, "use_sliding_window", True) and any(isinstance(w, int) and w > 0 for w in window):
        return "sliding-window / chunked attention is not built for sequence parallelism; use sp 1"
    return None


def apply_sp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Route `model`'s attention through `ulysses_attention` over the 1-D `mesh`, in place. From then
    on its forwards must take this rank's columns (`SequenceLayout.local`); `rlcore.models.forward`
    and `rlcore.step.critic` do."""
    from transformers import AttentionInterface

    problem = sp_problem(model.config, mesh.size())
    if problem is not None:
        raise ValueError(problem)
    AttentionInterface.register(ATTENTION, ulysses_attention)
    group = mesh.get_group()
    own: dict[int, Any] = {}  # a config another model shares keeps its attention: each gets a copy
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is not None and has_switch(config):
            if id(config) not in own:
                own[id(config)] = with_attention(config, ATTENTION)
            module.config = own[id(config)]
        if hasattr(module, "num_key_value_groups"):  # an attention layer
            setattr(module, _GROUP_ATTR, group)
    setattr(model, _GROUP_ATTR, group)
    return model


def sp_group(model: nn.Module) -> Any:
    """The process group `apply_sp` split `model`'s sequences over (None: not sequence-parallel)."""
    return getattr(model, _GROUP_ATTR, None)


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 to rank i, chunk j received from rank j; its adjoint is itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would copy a transposed view's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: Tensor, group: Any) -> Tensor:
    """(b, h, c, d) this rank's columns, every head -> (b, h / sp, sp * c, d) every column, its heads."""
    sp = dist.get_world_size(group)
    b, h, c, d = x.shape
    chunks = x.reshape(b, sp, h // sp, c, d).transpose(0, 1)  # (sp, b, h/sp, c, d): head group i to rank i
    got = _AllToAll.apply(chunks, group)  # (sp, b, h/sp, c, d): column block j from rank j
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * c, d)


def heads_to_seq(x: Tensor, group: Any) -> Tensor:
    """The inverse of `seq_to_heads`: (b, h / sp, sp * c, d) -> (b, h, c, d)."""
    sp = dist.get_world_size(group)
    b, hs, s, d = x.shape
    chunks = x.reshape(b, hs, sp, s // sp, d).permute(2, 0, 1, 3, 4)  # (sp, b, h/sp, c, d): columns j to rank j
    got = _AllToAll.apply(chunks, group)  # (sp, b, h/sp, c, d): head group i from rank i
    return got.transpose(0, 1).reshape(b, hs * sp, s // sp, d)


def ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention over every column for this rank's heads (a transformers attention function:
    (b, heads, c, d) in, (b, c, heads, d) out). The rows are shifted (`SequenceLayout`), so no mask."""
    group = getattr(module, _GROUP_ATTR)
    sp = dist.get_world_size(group)
    if key.shape[1] % sp:  # fewer KV heads than ranks: every query head its own KV copy
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    return heads_to_seq(out, group).transpose(1, 2).contiguous(), None


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1; backward keeps this rank's columns of the gradient (every rank computes
    the same loss from the gathered tensor, so no sum over ranks)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.narrow(1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def gather_sequence(x: Tensor, group: Any) -> Tensor:
    """(m, c, ...) this rank's columns -> (m, sp * c, ...) every column (see `_GatherSequence`)."""
    return _GatherSequence.apply(x, group)


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Rows shifted left by their leading padding and widened to a multiple of sp."""

    offset: Tensor
    """(m,) long: leading pad columns of each row (its first real token moves to column 0)."""
    width: int
    """Columns after the shift, a multiple of sp."""
    sp: int

    @staticmethod
    def of(attention: Tensor, sp: int) -> SequenceLayout:
        """The layout of rows whose real tokens (`attention` (m, s) != 0) are one contiguous block each."""
        real = attention != 0
        cols = torch.arange(real.shape[1], device=real.device)
        first = torch.where(real, cols, real.shape[1]).amin(dim=1).clamp(max=real.shape[1] - 1)  # (m,)
        used = int((real.sum(dim=1)).max().item()) if real.numel() else 0
        if bool((real.sum(dim=1) != torch.where(real, cols, -1).amax(dim=1) + 1 - first).any()):
            raise ValueError("sequence parallelism needs each row's tokens in one block (padding at the ends)")
        return SequenceLayout(offset=first, width=max(sp, -(-max(used, 1) // sp) * sp), sp=sp)

    def shift(self, x: Tensor, fill: int | float = 0) -> Tensor:
        """(m, s) in the batch's columns -> (m, width): row i's column j + offset[i] at j, `fill` past its end."""
        s = x.shape[1]  # (m, s)
        src = torch.arange(self.width, device=x.device)[None, :] + self.offset[:, None]  # (m, width)
        inside = src < s
        return torch.where(inside, x.gather(1, src.clamp(max=s - 1)), torch.full_like(src, fill, dtype=x.dtype))

    def unshift(self, y: Tensor, columns: Tensor) -> Tensor:
        """Values of shifted-layout `y` (m, width, ...) at the batch's `columns` (m, k) -> (m, k, ...)."""
        idx = (columns - self.offset[:, None]).clamp(0, self.width - 1)  # (m, k)
        idx = idx.reshape(*idx.shape, *([1] * (y.dim() - 2))).expand(*idx.shape, *y.shape[2:])
        return y.gather(1, idx)

    def local(self, x: Tensor, rank: int) -> Tensor:
        """This rank's columns of a shifted (m, width, ...) tensor."""
        c = self.width // self.sp
        return x[:, rank * c : (rank + 1) * c]
