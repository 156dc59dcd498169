"""What a run's models and rollout engine are built from, as small frozen values.

    policy = ModelSpec(path="builtin:tiny", lora_rank=8, seed=0)
    model = build_policy(policy, placement)                                        # rlcore.models.build
    engine = build_engine(policy, EngineSpec(), model, tokenizer, placement.local)  # rlcore.rollout.build

The trainer binds its config to these once (`rlcore.trainer.models`); a server or a script writes them itself.
A builder that cannot build from a spec raises `SpecError`, naming the field at fault.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtype names (--model.dtype, --model.compute-dtype) to torch dtypes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model of a run (the policy, its reference and engine copies, a teacher, a critic's backbone)."""

    path: str
    """builtin:<name>, a Hugging Face model directory, a hub id or a GGUF file."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""
    seed: int = 0
    """Seed of random initialisation: a built-in model's weights, LoRA's A."""
    lora_rank: int = 0
    """LoRA adapters of this rank on `lora_targets` (0: every parameter trains)."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (the update is B A alpha / rank)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_targets: tuple[str, ...] = ()
    """Module name suffixes that get adapters (empty: every linear layer of attention and MLP)."""
    activation_checkpointing: bool = False
    """Recompute every decoder layer's activations in the backward pass."""
    selective_checkpointing: bool = False
    """Recompute only each layer's cheap work (norms, RoPE, activations, softmax); ignored beside
    `activation_checkpointing`."""
    freeze_vision: bool = False
    """A vision-language policy's vision tower stays as loaded."""
    router_replay: Literal["off", "record", "replay"] = "off"
    """A mixture of experts: record the engine's routes, and replay them in the trainer's forwards."""
    exact: bool = False
    """Every copy that samples or scores runs the one batch-invariant forward (`rlcore.models.exact`)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def lora(self) -> dict[str, object] | None:
        """`rlcore.models.lora.apply_lora`'s keywords, or None without adapters."""
        if self.lora_rank == 0:
            return None
        return {"rank": self.lora_rank, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "targets": self.lora_targets}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """The rollout engine of a run."""

    kind: Literal["native", "vllm"] = "native"
    """native: rlcore's KV-cache sampler (CPU and GPU); vllm: `vllm.LLM` in this process."""
    seed: int = 0
    """Seed of sampling: each rank draws unseeded requests from its own stream, seed + rank."""
    max_context: int | None = None
    """vllm: the longest sequence it holds (prompt plus response, within the model's positions)."""
    compile: bool = False
    """native: `torch.compile` the decode step."""
    gpu_memory_utilization: float = 0.5
    """vllm: the share of GPU memory it takes."""
    lora_merged_copy: bool = True
    """native with a LoRA policy: sample a plain copy into which each push merges the adapters (else the
    trained module itself, adapters unmerged)."""
    sync_bucket_mb: float = 256.0
    """Weight pushes move tensors in buckets of this many MiB."""

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes(self.sync_bucket_mb)


def bucket_bytes(megabytes: float) -> int:
    """A weight push's bucket of `megabytes` MiB in bytes (at least 1: one tensor per bucket)."""
    return max(1, int(megabytes * 2**20))


class SpecError(ValueError):
    """A spec its builder cannot build; `field` names what is at fault: "path" (no model there), "exact" (no
    batch-invariant forward for it), "lora_targets" (no such modules), "kind" (the engine cannot start here)
    or "engine" (the engine cannot run this model)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
