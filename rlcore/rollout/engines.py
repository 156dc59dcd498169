"""The engine kinds: one table from a kind's name (`--rollout.engine`, `--reward.judge-engine`) to what it can do.

    kind = engine_kind("vllm")
    kind.takes_images                 # False: a vision-language run needs the native engine
    cls = engine_class(kind)          # VLLMEngine, its module imported only now

Code that must treat kinds apart asks a capability of the record, never the name: pre-flight (what can run
here, the memory estimate, the compatibility table), the judge and the rollout builders. A new kind is one
row of `ENGINES` and an engine class behind `RolloutEngine` (`rlcore.rollout.base`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineKind:
    """What one kind of rollout engine is and can do."""

    name: str
    """The flag's value (`--rollout.engine NAME`)."""
    constructor: str
    """`module:Class` of its engine, imported only when asked (`engine_class`): vLLM is an optional dependency."""
    own_weights: bool
    """Loads its own copy of the policy from a Hugging Face directory and keeps it beside the trained module
    (a built-in model is saved to a directory first; a judge must be one); else it samples a torch module."""
    own_world: bool
    """Takes the default process group as its world, so it is built inside the rollout ranks' group."""
    takes_images: bool
    """Samples a vision-language model from prompts with images."""
    compiles_on_cpu: bool
    """Compiles its kernels on a CPU whatever `--rollout.compile` says (it needs a C++ toolchain there)."""
    packs_weights: bool
    """Packs a copy of the weights for each `generate` (the native lean step), which the memory estimate counts."""
    kv_cache_env: str | None
    """The environment variable giving the KV cache it reserves up front, in GiB (1 when unset); None: its cache
    grows with each generate."""
    kernel_check: str | None
    """`module:function(head_dim, *, on_cpu) -> str | None`: why its kernels cannot run a model of that head
    dimension here (None: they can), asked before any weights load; None: no such limit."""
    lora_moe_on_cpu: bool
    """Samples a mixture of experts with LoRA adapters on a CPU."""
    feature: str | None
    """Its feature in the compatibility table (`rlcore.config.compatibility`), None if it clashes with nothing."""


ENGINES: dict[str, EngineKind] = {
    k.name: k
    for k in (
        EngineKind(name="native", constructor="rlcore.rollout.native.engine:NativeEngine", own_weights=False,
                   own_world=False, takes_images=True, compiles_on_cpu=False, packs_weights=True,
                   kv_cache_env=None, kernel_check=None, lora_moe_on_cpu=True, feature=None),
        EngineKind(name="vllm", constructor="rlcore.rollout.vllm.engine:VLLMEngine", own_weights=True,
                   own_world=True, takes_images=False, compiles_on_cpu=True, packs_weights=False,
                   kv_cache_env="VLLM_CPU_KVCACHE_SPACE", kernel_check="rlcore.rollout.vllm.support:vllm_problem",
                   lora_moe_on_cpu=False, feature="vllm"),
    )
}  # fmt: skip
"""Every engine kind by name."""


def engine_kind(name: str) -> EngineKind:
    """The record of the kind called `name` (ValueError, one line, for a name no kind has)."""
    kind = ENGINES.get(name)
    if kind is None:
        raise ValueError(f"engine {name!r}: no such kind; choose one of {', '.join(ENGINES)}")
    return kind


def _resolve(path: str) -> Any:
    """The object at `module:attribute`, its module imported now."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def engine_class(kind: EngineKind) -> type:
    """The engine class of `kind`, imported now (vLLM's class needs no vLLM until it is constructed)."""
    return _resolve(kind.constructor)


def kernel_problem(kind: EngineKind, head_dim: int | None, *, on_cpu: bool) -> str | None:
    """Why `kind`'s kernels cannot run a model of `head_dim` (None: unknown) here, or None."""
    return None if kind.kernel_check is None else _resolve(kind.kernel_check)(head_dim, on_cpu=on_cpu)
