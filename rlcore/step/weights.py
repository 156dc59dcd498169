"""Weights from the trained policy into a rollout engine: `push_weights` (one update of the engine per
call, bucketed), `engine_holds` (whether the engine samples with the policy's current weights), and a
rollout rank's end of split placement's pushes (`rlcore.dist.push`): `into_engine`, through an
`AdapterRelay` for a LoRA policy."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from rlcore.rollout.base import RolloutEngine
from rlcore.step.faults import Hooks


def push_weights(
    model: nn.Module, engine: RolloutEngine, *, bucket_bytes: int, hooks: Hooks | None = None
) -> dict[str, float]:
    """Push `model`'s full weights into `engine` as one update, gathered `bucket_bytes` at a time
    (nothing to do when the engine samples from `model` itself); returns `sync/bytes` and
    `sync/tensors` pushed. A collective under FSDP: every rank calls it."""
    if engine.module is model:
        return {"sync/bytes": 0.0, "sync/tensors": 0.0}  # the native engine samples from the trained module
    from rlcore.models.lora import adapter_params, is_lora, save_adapter

    sink = engine.adapters  # vLLM: the adapter as a LoRA request, via a directory
    if is_lora(model) and sink is not None:
        directory = sink.adapter_dir()
        save_adapter(model, directory, write=True)  # a gather under FSDP; every rank writes its engine's copy
        sink.use_adapter(directory)
        pushed = [p for _, p in adapter_params(model)]
        return {
            "sync/bytes": float(sum(p.numel() * p.element_size() for p in pushed)),
            "sync/tensors": float(len(pushed)),
        }
    from rlcore.dist.stream import WeightPush

    state = _lora_state(model, engine.module)
    with WeightPush(model, bucket_bytes=bucket_bytes, all_ranks=True, state=state) as push:
        if hooks is None or not hooks.per_bucket(engine, push):  # test-only: the old, broken per-bucket sync
            engine.load_weights(push)  # one call: vLLM reloads stacked q/k/v and gate/up groups whole
    return {"sync/bytes": float(push.bytes), "sync/tensors": float(push.tensors)}


def _lora_state(model: nn.Module, target: nn.Module | None) -> Any:
    """What a push of `model` sends an engine sampling with `target`: everything (None) for a full model;
    for a LoRA policy, the adapter tensors into an engine copy with the same adapter layers (the base is
    its own and never moves), else the base with the adapters merged in (W + scale B A)."""
    from rlcore.models.lora import adapter_params, is_lora, merged_state

    if not is_lora(model):
        return None
    return adapter_params if target is not None and is_lora(target) else merged_state


@dataclasses.dataclass(frozen=True)
class AdapterRelay:
    """A rollout rank's copy of a LoRA policy (split placement): the trainer's pushes carry the adapter
    tensors only (`rlcore.models.lora.push_state`); they land in `model` (the base with the same adapter
    layers), and the engine is refreshed from it exactly as a colocated engine is from the trained module
    (`push_weights`: the merged weights into the native engine's plain copy, the adapter as a LoRA
    request into vLLM)."""

    model: nn.Module
    bucket_bytes: int

    def load(self, engine: RolloutEngine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One push: the adapter tensors into the copy, then one update of `engine` from it."""
        from rlcore.rollout.native.engine import load_named

        load_named(self.model, named_tensors)
        push_weights(self.model, engine, bucket_bytes=self.bucket_bytes)


def into_engine(
    engine: RolloutEngine, relay: AdapterRelay | None
) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    """How a rollout rank of split placement loads a push into `engine` (one update): directly, or for a
    LoRA policy through its `relay`."""
    return engine.load_weights if relay is None else functools.partial(relay.load, engine)


def engine_holds(model: nn.Module, engine: RolloutEngine) -> bool | None:
    """Whether `engine` samples with `model`'s current weights (None: cannot tell, e.g. vLLM). A
    collective under FSDP: every rank calls it."""
    own = engine.module
    if own is model:
        return True
    if own is None:
        return None
    from rlcore.dist.stream import iter_full_state
    from rlcore.rollout.native.engine import canonical_name

    mine = own.state_dict()
    same = True
    for bucket in iter_full_state(model, all_ranks=True, state=_lora_state(model, own)):
        same &= all(
            torch.equal(mine[canonical_name(n)], t.to(mine[canonical_name(n)].device)) for n, t in bucket
        )
    return same
