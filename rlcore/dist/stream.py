"""Full (unsharded) weights, streamed in size-bounded buckets: engine weight sync and Hugging Face export.

    for bucket in iter_full_state(model):             # every rank iterates; only rank 0 gets tensors
        save(bucket)                                  # [(hf_name, full tensor), ...]
    iter_full_state(model, all_ranks=True)            # every rank gets them (one engine per rank)
    with WeightPush(model, bucket_bytes=...) as push: # one logical engine update, streamed:
        engine.load_weights(push)                     #   the engine reloads everything in one call
    push.bytes, push.tensors                          # what was sent
    save_hf_pretrained(model, tokenizer, run / "final")   # safetensors + config + tokenizer

Names are the model's own (Hugging Face) state-dict names: `fully_shard` adds no wrapper modules.
A parameter shared by several names (tied `lm_head.weight` / `model.embed_tokens.weight`) is sent
once, under its first name; `from_pretrained` re-ties it from `tie_word_embeddings` in the config.
Non-persistent buffers (rotary `inv_freq`) are not part of the state and are not sent.

A weight push is one call of the engine's `load_weights` over a flat stream of every tensor, never one
call per bucket: vLLM stacks q/k/v and gate/up into one parameter, and a reload given half of such a
group leaves that layer wrong (the issue-24 bug). Buckets bound how much is gathered at a time, never
what the engine reloads together.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlcore.dist.mesh import group_rank

BUCKET_BYTES = 256 * 2**20


def _full_tensor(t: Tensor) -> Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call it in the same order)."""
    if not isinstance(t, DTensor):
        return t.detach()
    local = t.to_local()
    comm_device = t.device_mesh.device_type
    if local.device.type != comm_device:  # CPU-offloaded shards: gather on the mesh's device
        t = DTensor.from_local(
            local.to(comm_device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return t.detach().full_tensor()


def unique_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of the model's state dict in order, each tensor once: a tied parameter under its
    first name only (what a push or an export sends; DTensors as they are, nothing gathered)."""
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            yield name, value


def iter_full_state(
    model: nn.Module,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    all_ranks: bool = False,
    group: Any = None,
    state: Callable[[nn.Module], Iterable[tuple[str, Tensor]]] | None = None,
) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of (name, full tensor), about `bucket_bytes` each, on the first rank of `group` (default:
    rank 0; on every rank with `all_ranks`, for engines that each rank runs); empty lists elsewhere.

    Every rank must consume the iterator to the end (it runs one gather per tensor); all ranks get
    the same number of buckets. Tensors keep their dtype and device (the parameters' device).
    """
    is_main = all_ranks or group_rank(group) == 0
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, value in (state or unique_state)(model):
        full = _full_tensor(value)
        size += full.numel() * full.element_size()
        if is_main:
            bucket.append((name, full))
        del full
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if size or bucket:
        yield bucket


class WeightPush:
    """One push of a model's full weights: iterate it for `(name, full tensor)` pairs, in state-dict
    order, gathered a bucket of about `bucket_bytes` at a time (a collective under FSDP: every rank
    must iterate it to the end, in the same order; `all_ranks` as in `iter_full_state`).

    Leaving the `with` block drains what the consumer did not read (so every rank runs every gather)
    and raises if anything was left: an engine that skips tensors would run on a half-updated policy.
    `bytes` and `tensors` count what was handed out. `state` as in `iter_full_state` (a LoRA push: the
    adapter's tensors only).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        all_ranks: bool = True,
        state: Callable[[nn.Module], Iterable[tuple[str, Tensor]]] | None = None,
    ) -> None:
        self._buckets = iter_full_state(model, bucket_bytes=bucket_bytes, all_ranks=all_ranks, state=state)
        self.bytes = 0
        self.tensors = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for bucket in self._buckets:
            for name, tensor in bucket:
                self.bytes += tensor.numel() * tensor.element_size()
                self.tensors += 1
                yield name, tensor

    def __enter__(self) -> WeightPush:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        left = sum(len(bucket) for bucket in self._buckets)  # finish the gathers every rank runs
        if exc_type is None and left:
            raise RuntimeError(f"the engine's load_weights left {left} tensors of the push unread")


def _model_class_name(model: nn.Module) -> str:
    """The Hugging Face class behind an FSDP2 wrapper (FSDPLlamaForCausalLM -> LlamaForCausalLM)."""
    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
    return cls.__name__


def save_hf_pretrained(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    bucket_bytes: int = 2 * 2**30,
    every_rank: bool = False,
    group: Any = None,
    state: Callable[[nn.Module], Iterable[tuple[str, Tensor]]] | None = None,
) -> Path | None:
    """Write a `from_pretrained`-loadable directory from `model` (every rank of `group` calls, default
    all; its first rank writes, or every rank to its own `out_dir` with `every_rank`, e.g. a node-local
    directory for an engine).

    One safetensors file per bucket (`model.safetensors` when there is one, else
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`), the config (with the
    architecture and dtype of the saved weights), the generation config and the tokenizer.
    `state` gives the (name, tensor) pairs to write (default `unique_state`; a LoRA model's export
    passes `rlcore.models.lora.merged_state`). Returns the directory where it was written, None elsewhere.
    """
    out = Path(out_dir)
    is_main = every_rank or group_rank(group) == 0
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    files: list[tuple[Path, list[str]]] = []
    dtype = None
    buckets = iter_full_state(
        model, bucket_bytes=bucket_bytes, all_ranks=every_rank, group=group, state=state
    )
    for k, bucket in enumerate(buckets):
        if not is_main:
            continue
        path = out / f"part-{k:05d}.safetensors"
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
        dtype = dtype or next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
        save_file(tensors, path, metadata={"format": "pt"})
        files.append((path, list(tensors)))
    if is_main:
        _finish_files(out, files)
        config = copy.deepcopy(model.config)
        config.architectures = [_model_class_name(model)]
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    if not every_rank and dist.is_available() and dist.is_initialized():  # the others wait for the writer
        dist.barrier(group=group)
    return out if is_main else None


def _finish_files(out: Path, files: list[tuple[Path, list[str]]]) -> None:
    """Give the part files their Hugging Face names, with an index when there are several."""
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if len(files) == 1:
        files[0][0].rename(out / "model.safetensors")
        return
    weight_map, total = {}, 0
    for k, (path, names) in enumerate(files):
        target = out / f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        path.rename(target)
        weight_map |= dict.fromkeys(names, target.name)
        total += target.stat().st_size  # bytes on disk (tensors plus a small header per file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def gathered_state(model: nn.Module) -> dict[str, Tensor]:
    """All of `iter_full_state` in one dict on CPU (rank 0; empty elsewhere). For tests and small models."""
    return {name: t.to("cpu") for bucket in iter_full_state(model) for name, t in bucket}


__all__ = [
    "BUCKET_BYTES",
    "WeightPush",
    "gathered_state",
    "iter_full_state",
    "save_hf_pretrained",
    "unique_state",
]
