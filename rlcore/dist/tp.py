"""Tensor parallelism of a Hugging Face decoder with DTensor (`parallelize_module`), Megatron style.

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    apply_tp(model, mesh["tp"], plan)               # a family's plan (rlcore.dist.tp_plans); then
                                                    # apply_fsdp(model, mesh["dp_shard"]) composes

Per decoder layer (the Llama family: llama, mistral, qwen2, qwen3): q/k/v and gate/up are split
column-wise (each rank holds `heads / tp` attention heads, `kv_heads / tp` KV heads and `intermediate /
tp` MLP columns, and computes them on the replicated input); o and down are split row-wise, their
partial outputs summed across the tp ranks. Embeddings and norms stay replicated. An untied lm_head
is split by vocabulary (column-wise), so each rank holds its shard of the logits, never the whole:
`vocab_parallel_logprobs` / `vocab_parallel_entropy` reduce the log-sum-exp, the label's logit and
the expected logit over the tp ranks ((positions,) tensors, not (positions, vocab)), and their
backward is local (`rlcore.models.forward` uses them when `vocab_group(model)` is set). A lm_head tied
to the embeddings stays whole (full logits on every rank). Attention reshapes with
`-1` heads, so the layers run unchanged on their local heads; Qwen3's per-head q/k norms hold their
weight as a replicated DTensor over the head-sharded input, so its gradient sums every rank's heads.
Backward all-reduces the input gradients of the column-wise layers (DTensor does it), so the replicated
parameters get the full gradient on every tp rank. A family's record names its plan
(`rlcore.models.families`; the plans: `rlcore.dist.tp_plans`).

LoRA layers (`rlcore.models.lora`) split with their base layer, by `ADAPTER_PLANS`. The base layer splits
as the plan says. On a column-wise layer, A (r x in) is replicated and B (out x r) is split column-wise
like the base: each rank computes x A^T whole (r columns: cheap) and its own output columns of B, with
no extra collective forward. On a row-wise layer, A is split by its input like the base and B is
replicated: the partial x A^T (r wide, not out wide) is summed over the tp ranks, and B then adds the
replicated output. The other pairing would move out-wide activations instead (out/r times the bytes).
The replicated halves get Partial gradients, summed once to their parameter's placement before the
norm and the optimizer read them (`rlcore.step.update`; under FSDP2 its reduction does it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: Any) -> nn.Module:
    """Split every decoder layer of `model` over the 1-D `mesh` (see the module docstring), in place."""
    if mesh.size() == 1:
        return model
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for layer in _layers(model):
        parallelize_module(layer, mesh, _layer_plan(layer, plan))
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(head, nn.Linear) and (embed is None or head.weight is not embed.weight):
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})  # logits: this rank's vocabulary
        setattr(model, _VOCAB_ATTR, mesh.get_group())
    for name, p in model.named_parameters():  # some styles re-wrap a frozen parameter (a LoRA base) as trainable
        p.requires_grad_(name not in frozen)
    return model


class _Replicated(ParallelStyle):
    """Every parameter of the module a replicated DTensor; a plain input taken as replicated; the output
    a DTensor, or its local tensor with `use_local_output`."""

    def __init__(self, *, use_local_output: bool) -> None:
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                if isinstance(x, Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def local(_: nn.Module, output: Tensor, __: DeviceMesh) -> Tensor:
            return output.to_local() if self.use_local_output and isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=replicated, output_fn=local)


ADAPTER_PLANS: dict[type[ParallelStyle], tuple[Callable[[], ParallelStyle], Callable[[], ParallelStyle]]] = {
    ColwiseParallel: (functools.partial(_Replicated, use_local_output=False), ColwiseParallel),
    RowwiseParallel: (functools.partial(RowwiseParallel, use_local_output=False),
                      functools.partial(_Replicated, use_local_output=True)),
}  # fmt: skip
"""How a LoRA layer's (A, B) split, by its base layer's style (see the module docstring)."""


def _layer_plan(layer: nn.Module, plan: Mapping[str, Callable[[], ParallelStyle]]) -> dict[str, ParallelStyle]:
    """`plan` for one decoder layer, a LoRA layer's entry replaced by its base layer's and adapters'."""
    out: dict[str, ParallelStyle] = {}
    for name, make in plan.items():
        style, module = make(), layer.get_submodule(name)
        adapters = getattr(module, "lora_A", None)
        if adapters is None or not hasattr(module, "base_layer"):
            out[name] = style
            continue
        if type(style) not in ADAPTER_PLANS:
            raise ValueError(f"{name}: no LoRA split for a {type(style).__name__} layer")
        split_a, split_b = ADAPTER_PLANS[type(style)]
        out[f"{name}.base_layer"] = style
        for adapter in adapters:
            out[f"{name}.lora_A.{adapter}"], out[f"{name}.lora_B.{adapter}"] = split_a(), split_b()
    return out


def _layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None) or getattr(model, "backbone", model)  # a causal LM, or a critic
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: not a Llama-family decoder")
    return list(layers)


# ---------------------------------------------------------------- vocab-parallel log-probs

_VOCAB_ATTR = "_rlcore_vocab_group"
_CHUNK = 2**22  # float32 logits per chunk of positions (16 MiB)


def vocab_group(model: nn.Module) -> Any:
    """The tp group `model`'s lm_head splits the vocabulary over (None: the logits are whole)."""
    return getattr(model, _VOCAB_ATTR, None)


def _position_chunks(n: int, v: int) -> list[slice]:
    step = max(1, _CHUNK // max(1, v))
    return [slice(i, i + step) for i in range(0, n, step)]


def _global_lse(z2: Tensor, group: Any) -> Tensor:
    """log-sum-exp over the whole vocabulary of (n, v_local) scaled logits: (n,) on every tp rank."""
    local = torch.cat([torch.logsumexp(z2[rows].float(), dim=-1) for rows in _position_chunks(*z2.shape)])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.logsumexp(torch.stack(parts), dim=0)


def _vocab_start(v_local: int, group: Any) -> int:
    """The first vocabulary id of this rank's shard (DTensor's even split, the last shard shorter)."""
    sizes = torch.tensor([v_local])
    parts = [torch.empty_like(sizes) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, sizes, group=group)
    return int(sum(int(p) for p in parts[: dist.get_rank(group)]))


class _VocabParallelLogprobs(torch.autograd.Function):
    """log softmax(z)[label] of logits split by vocabulary over `group`, z = logits / temperature.
    Every tp rank computes the same loss from the result, so the backward is local: (onehot - p) / T
    on this rank's columns, scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, temperature: float, group: Any) -> Tensor:
        v = logits.shape[-1]
        z2, y = logits.reshape(-1, v), labels.reshape(-1).long()  # (n, v_local), (n,)
        lse = _global_lse(z2 / temperature if temperature != 1.0 else z2, group)  # (n,)
        start = _vocab_start(v, group)
        mine = (y >= start) & (y < start + v)
        picked = z2.gather(1, (y - start).clamp(0, v - 1)[:, None]).squeeze(1).float() / temperature
        picked = torch.where(mine, picked, 0.0)
        dist.all_reduce(picked, group=group)  # the label's logit, from the rank that holds it
        ctx.save_for_backward(logits, y, lse, mine)
        ctx.temperature, ctx.start = temperature, start
        return (picked - lse).reshape(labels.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, y, lse, mine = ctx.saved_tensors
        v, t = logits.shape[-1], ctx.temperature
        z2 = logits.reshape(-1, v)
        grad = torch.empty_like(z2)
        scale = grad_out.reshape(-1).float() / t  # (n,)
        for rows in _position_chunks(*z2.shape):
            d = -torch.exp(z2[rows].float() / t - lse[rows, None])  # -p, (k, v_local)
            hit = mine[rows]
            d[hit.nonzero().squeeze(1), (y[rows] - ctx.start)[hit]] += 1.0  # onehot - p
            grad[rows] = (d * scale[rows, None]).to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / temperature) split by vocabulary: H = lse - sum p z, the sum reduced
    over `group`; backward (local): dH/dz_k = -p_k (log p_k + H), divided by the temperature."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, temperature: float, group: Any) -> Tensor:
        v, t = logits.shape[-1], temperature
        z2 = logits.reshape(-1, v)
        lse = _global_lse(z2 / t if t != 1.0 else z2, group)
        expected = torch.cat([
            (torch.exp(z2[rows].float() / t - lse[rows, None]) * (z2[rows].float() / t)).sum(-1)
            for rows in _position_chunks(*z2.shape)
        ])  # fmt: skip
        dist.all_reduce(expected, group=group)
        entropy = lse - expected
        ctx.save_for_backward(logits, lse, entropy)
        ctx.temperature = t
        return entropy.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, lse, entropy = ctx.saved_tensors
        v, t = logits.shape[-1], ctx.temperature
        z2 = logits.reshape(-1, v)
        grad = torch.empty_like(z2)
        scale = grad_out.reshape(-1).float() / t
        for rows in _position_chunks(*z2.shape):
            logp = z2[rows].float() / t - lse[rows, None]
            grad[rows] = (-torch.exp(logp) * (logp + entropy[rows, None]) * scale[rows, None]).to(grad.dtype)
        return grad.reshape(logits.shape), None, None


def vocab_parallel_logprobs(
    logits: Tensor, labels: Tensor, group: Any, *, temperature: float = 1.0
) -> Tensor:
    """`rlcore.pure.token_logprobs` of logits whose last dim is this rank's vocabulary shard: (...) float32."""
    return _VocabParallelLogprobs.apply(logits, labels, temperature, group)


def vocab_parallel_entropy(logits: Tensor, group: Any, *, temperature: float = 1.0) -> Tensor:
    """The entropy per position of logits split by vocabulary: (...) float32 (see `_VocabParallelEntropy`)."""
    return _VocabParallelEntropy.apply(logits, temperature, group)
