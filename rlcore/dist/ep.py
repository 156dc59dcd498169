"""Expert parallelism: each rank holds 1/ep of every MoE layer's experts; tokens go to them by all-to-all.

    ep_mesh = DeviceMesh("cpu", arange(W).reshape(W // ep, ep), mesh_dim_names=("ep_replicate", "ep"))
    apply_ep(model, ep_mesh)                        # then apply_fsdp(model, mesh, ignored_params=expert_params(model))

The ep ranks are data-parallel ranks (as in torchtitan, EP borrows them): each brings its own tokens.
In every MoE layer the fused expert tensors (`gate_up_proj` (E, 2i, h), `down_proj` (E, h, i), the
layout of all four families of `rlcore.models.moe`) become DTensors sharded on the expert dimension
over the `ep` axis, and replicated over `ep_replicate` (the W / ep groups of ep ranks) when there is
more than one group. FSDP2 shards everything else and leaves these alone. The router runs as before on
each rank's own tokens (replay included); then the experts' forward:

    1. sort the (token, slot) pairs by expert: the experts of rank r are [r E/ep, (r+1) E/ep)
    2. all-to-all the per-expert counts, then the hidden states (uneven splits)
    3. each local expert's SwiGLU MLP on the rows it received, from every rank
    4. all-to-all the outputs back, scale by the gate weights, sum each token's top-k (as the model does)

Gradients: the all-to-all's backward is the reverse all-to-all, so an expert shard's gradient sums the
tokens of every rank of its group; across groups it is Partial and `rlcore.step.update` sums it to the
parameter's placement before the norm (as for tensor parallelism's replicated halves). With FSDP2's sum
reduction for the rest, every gradient is the gradient of the global loss, as without ep.

Every rank of a group must run the same forwards in the same order (the all-to-alls are collectives);
the trainer already aligns micro-batch counts across data-parallel ranks for FSDP2. Weight pushes,
checkpoints and the export see the experts as DTensors and gather them whole (`full_tensor`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

EXPERT_TENSORS = ("gate_up_proj", "down_proj")
"""The fused expert parameters of an experts module (E, 2i, h) and (E, h, i)."""


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of `model`: those holding a 3-D `gate_up_proj` and `down_proj`, in order."""
    return [m for m in model.modules() if all(_is_fused(getattr(m, name, None)) for name in EXPERT_TENSORS)]


def _is_fused(p: Any) -> bool:
    return isinstance(p, nn.Parameter) and p.dim() == 3


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The fused expert parameters of `model` (what FSDP2 leaves to expert parallelism)."""
    return {getattr(m, name) for m in expert_modules(model) for name in EXPERT_TENSORS}


def num_experts(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)  # mixtral: num_local_experts


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE layer's experts of `model` over `mesh`'s last axis (`ep`), replicated over a
    leading `ep_replicate` axis if there is one, and route their tokens by all-to-all (module docstring).
    In place; returns `model`."""
    placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
    grads = (Partial(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
    group = mesh.get_group(mesh.ndim - 1)
    for experts in expert_modules(model):
        for name in EXPERT_TENSORS:
            p = getattr(experts, name)
            shard = distribute_tensor(p.detach(), mesh, placements)
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        experts.forward = functools.partial(_ep_forward, experts, group, grads)  # the instance's forward
    return model


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits along dim 0; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = x.new_empty((sum(out_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_sizes, in_sizes = ctx.sizes
        back = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_sizes, out_sizes, group=ctx.group)
        return back, None, None, None


def _ep_forward(
    experts: nn.Module, group: Any, grads: tuple[Any, ...], hidden_states: Tensor, top_k_index: Tensor,
    top_k_weights: Tensor,
) -> Tensor:  # fmt: skip
    """The experts' output (N, h) for this rank's tokens `hidden_states` (N, h) routed to `top_k_index`
    (N, k) with `top_k_weights` (N, k), the experts spread over `group` (module docstring, steps 1-4)."""
    gate_up = _local(experts.gate_up_proj, grads)  # (E / ep, 2i, h)
    down = _local(experts.down_proj, grads)  # (E / ep, h, i)
    ranks, local = dist.get_world_size(group), gate_up.shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (N k,): the pairs by expert, so by destination rank
    counts = torch.bincount(flat, minlength=ranks * local)  # (E,)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # (ep * E/ep,): source rank major
    sizes = _Sizes(torch.cat([counts, received]).tolist(), ranks, local)  # the one host sync
    rows = _AllToAll.apply(hidden_states[order // k], sizes.recv, sizes.send, group)  # by source, then expert
    by_expert = _expert_major(received.view(ranks, local), sizes.total)  # rows -> expert-major order
    out = _local_experts(experts, rows[by_expert], gate_up, down, sizes.per_expert)
    back = _AllToAll.apply(out[torch.argsort(by_expert)], sizes.send, sizes.recv, group)  # (N k, h), `order`
    weighted = back * top_k_weights.reshape(-1)[order, None]
    final = torch.zeros_like(hidden_states)
    return final.index_add(0, order // k, weighted.to(final.dtype))


class _Sizes:
    """The row counts of one exchange, on the host: `send[r]` rows to rank r, `recv[s]` from rank s,
    `per_expert[e]` for local expert e from all ranks, `total` received."""

    def __init__(self, counts: list[int], ranks: int, local: int) -> None:
        mine, theirs = counts[: ranks * local], counts[ranks * local :]  # [r * local + e], [s * local + e]
        self.send = [sum(mine[r * local : (r + 1) * local]) for r in range(ranks)]
        self.recv = [sum(theirs[s * local : (s + 1) * local]) for s in range(ranks)]
        self.per_expert = [sum(theirs[e::local]) for e in range(local)]
        self.total = sum(self.recv)


def _local(p: Tensor, grads: tuple[Any, ...]) -> Tensor:
    """This rank's shard of an expert parameter, its gradient declared as `grads` (Partial across
    groups: each group's tokens give a part)."""
    return p.to_local(grad_placements=grads) if isinstance(p, DTensor) else p


def _expert_major(counts: Tensor, total: int) -> Tensor:
    """The permutation taking `total` rows laid out by source rank then expert (`counts` (sources,
    experts)) to expert then source: index i of the result is the row that goes i-th (no host sync)."""
    flat = counts.flatten()
    starts = (flat.cumsum(0) - flat).view_as(counts)  # each block's first row
    sizes, firsts = counts.t().flatten(), starts.t().flatten()  # blocks in expert-major order
    offsets = torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes, output_size=total)
    rows = torch.arange(total, device=counts.device)
    return torch.repeat_interleave(firsts, sizes, output_size=total) + rows - offsets


def _local_experts(
    experts: nn.Module, rows: Tensor, gate_up: Tensor, down: Tensor, sizes: list[int]
) -> Tensor:
    """Each local expert's MLP on its consecutive block of `rows` (`sizes` rows each), as the model's
    own experts compute it: act(x W_gate^T) * (x W_up^T), then W_down."""
    outs = []  # unbind: one backward node per tensor (indexing gate_up[e] would fill a whole-shard
    # gradient per expert: measured 60% of a step with 16 local experts)
    pairs = zip(rows.split(sizes), gate_up.unbind(0), down.unbind(0), strict=True)
    for x, w_gate_up, w_down in pairs:  # an expert with no rows still runs: its gradient is then 0,
        gate, up = nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
        outs.append(nn.functional.linear(experts.act_fn(gate) * up, w_down))  # not None on one rank only
    return torch.cat(outs)


__all__ = ["EXPERT_TENSORS", "apply_ep", "expert_modules", "expert_params", "num_experts"]
