"""How much memory a run's model needs, estimated from its config alone (no weights load).

    shape = Shape.of(config)                                    # parameters and layer widths, meta device
    est = estimate(shape, FootprintSetup(dtype_bytes=4, lora_rank=0, micro_tokens=512, rollout_rows=64,
                                        rollout_tokens=560, checkpointing=False))
    est.peak, est.parts                                          # bytes; {"weights": ..., "activations": ...}
    tokens = micro_tokens_within(shape, budget=2 * 2**30, compute_bytes=4, checkpointing=False)

The parts, each a formula of the config (the numbers are measured on SmolLM2-135M: experiments/README.md,
"Memory at real sizes"):
- weights: every parameter at the parameter dtype;
- gradients: the trained parameters (all of them, or LoRA's A and B) at the parameter dtype, alive
  during the update only (`zero_grad(set_to_none=True)` frees them after the step);
- optimizer: AdamW's two moments, float32 or the parameter dtype, 8 or 4 bytes per trained parameter;
- activations: the tensors a micro-batch's forward saves for backward, per token and layer
  `ACTIVATION_WIDTHS` hidden and MLP widths of the compute dtype (HF Llama/Qwen2 with sdpa: two RMSNorms
  save 3 x hidden each, RoPE and attention about 4 x hidden, the MLP 4 x its width; on SmolLM2 the saved
  tensors measured 1.7 MB per fed token, `perf/mem/saved_tensors_mb`, against 1.8 MB by this formula
  without the logits' gradient). With activation checkpointing a layer keeps its input only, and
  one layer at a time is recomputed; with selective checkpointing `SELECTIVE_WIDTHS`;
- logits: the micro-batch's logits and their gradient in the compute dtype, 2 x vocabulary x 4 bytes per
  token (x 2 in bf16; the log-softmax works on chunks of positions in float32);
- rollout: the lean engine's packed copy of the weights (one per `generate`) and the KV cache of every
  row at its full length; an engine copy kept throughout (LoRA's merged copy, or an unsharded copy beside
  FSDP2's shards) counts always.
The peak is the state that lives throughout (weights, optimizer, the process itself) plus the larger of
the update's (gradients, activations, logits) and the rollout's transients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlcore.models.recompute import counting

PROCESS_BYTES = 700 * 2**20
"""The process before any model: Python, torch, the tokenizer and data (measured 0.6-0.7 GiB RSS)."""
ACTIVATION_WIDTHS = (13.0, 4.0)
"""Saved values per token and layer: this many hidden widths, plus this many MLP widths."""
SELECTIVE_WIDTHS = (5.0, 2.0)
"""The same under selective checkpointing (`rlcore.models.recompute`), plus the K and V widths: the layer's
input, q, k, v, attention's output, the output projection's and the MLP's three products (SmolLM2-135M
measured 4,764 values per token and layer against 6,336 by this formula; 9,568 without it, against 13,632)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate reads of a model: its parameter count and layer widths."""

    params: int
    layers: int
    hidden: int
    mlp: int
    """The MLP width a token passes through (a mixture of experts: the routed experts' together)."""
    vocab: int
    kv_width: int
    """Keys and values per token and layer together: 2 x KV heads x head dim."""

    @staticmethod
    def of(config: Any) -> Shape:
        """The shape of a Hugging Face config; parameters counted on the meta device (exact, no memory)."""
        from rlcore.models.policy import auto_class

        with torch.device("meta"):
            model = auto_class(config).from_config(config)
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        routed = getattr(text, "moe_intermediate_size", None)
        mlp = routed * text.num_experts_per_tok if routed else text.intermediate_size
        return Shape(
            params=sum(p.numel() for p in model.parameters()),
            layers=text.num_hidden_layers,
            hidden=text.hidden_size,
            mlp=mlp,
            vocab=text.vocab_size,
            kv_width=2 * getattr(text, "num_key_value_heads", heads) * head_dim,
        )

    def lora_params(self, rank: int) -> int:
        """A and B of every default LoRA target: rank x (in + out) per linear layer."""
        q_and_o, kv = 2 * (self.hidden + self.hidden), 2 * (self.hidden + self.kv_width // 2)
        mlp = 3 * (self.hidden + self.mlp)
        return rank * self.layers * (q_and_o + kv + mlp)


@dataclasses.dataclass(frozen=True)
class FootprintSetup:
    """The run's choices the estimate depends on."""

    dtype_bytes: int
    """Parameter bytes (4 float32, 2 bfloat16)."""
    lora_rank: int
    micro_tokens: int
    """Tokens of the largest update micro-batch (rows x trimmed width)."""
    rollout_rows: int
    rollout_tokens: int
    """Prompt + response positions of a rollout row."""
    checkpointing: bool
    selective: bool = False
    """Selective checkpointing (`SELECTIVE_WIDTHS`); `checkpointing` wins over it."""
    compute_bytes: int = 4
    """Activation bytes (the compute dtype)."""
    engine_copy: bool = True
    """Whether the engine packs its own copy of the weights for a `generate` (the lean native engine)."""
    shards: int = 1
    """Ranks FSDP2 shards the weights, gradients and optimizer over (the engine's copy stays whole)."""
    engine_copy_bytes: int = 0
    """A copy of the weights the engine keeps throughout (LoRA's merged copy; an unsharded copy under FSDP2)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    parts: dict[str, int]
    """Bytes by part (module docstring)."""
    peak: int


def activation_bytes_per_token(shape: Shape, compute_bytes: int, checkpointing: bool, selective: bool = False) -> int:
    """Saved-for-backward bytes per token of a micro-batch, the logits and their gradient included."""
    per_layer = (ACTIVATION_WIDTHS[0] * shape.hidden + ACTIVATION_WIDTHS[1] * shape.mlp) * compute_bytes
    if checkpointing:
        layers = shape.layers * shape.hidden * compute_bytes + per_layer
    elif selective:
        kept = SELECTIVE_WIDTHS[0] * shape.hidden + shape.kv_width + SELECTIVE_WIDTHS[1] * shape.mlp
        layers = shape.layers * kept * compute_bytes
    else:
        layers = shape.layers * per_layer
    return int(layers + 2 * compute_bytes * shape.vocab)  # the logits and their gradient


def micro_tokens_within(
    shape: Shape, *, budget: int, compute_bytes: int, checkpointing: bool, selective: bool = False
) -> int:
    """The most tokens a micro-batch may hold for its activations and logits to stay within `budget` bytes."""
    return max(1, budget // activation_bytes_per_token(shape, compute_bytes, checkpointing, selective))


def estimate(shape: Shape, setup: FootprintSetup) -> Estimate:
    """The run's peak memory in bytes, and its parts (module docstring)."""
    trained = shape.lora_params(setup.lora_rank) if setup.lora_rank else shape.params
    moments = 8 if setup.dtype_bytes == 4 or setup.lora_rank else 2 * setup.dtype_bytes
    per_token = activation_bytes_per_token(shape, setup.compute_bytes, setup.checkpointing, setup.selective)
    shards = max(1, setup.shards)
    parts = {
        "process": PROCESS_BYTES,
        "weights": (shape.params * setup.dtype_bytes + (trained * 4 if setup.lora_rank else 0)) // shards,
        "optimizer": trained * moments // shards,
        "gradients": trained * (4 if setup.lora_rank else setup.dtype_bytes) // shards,
        "activations": setup.micro_tokens * per_token,
        "engine_copy": setup.engine_copy_bytes,
        "engine_weights": shape.params * setup.dtype_bytes if setup.engine_copy else 0,
        "kv_cache": setup.rollout_rows * setup.rollout_tokens * shape.layers * shape.kv_width * setup.compute_bytes,
    }
    update = parts["gradients"] + parts["activations"]
    rollout = parts["engine_weights"] + parts["kv_cache"]
    held = parts["process"] + parts["weights"] + parts["engine_copy"] + parts["optimizer"]
    return Estimate(parts=parts, peak=held + max(update, rollout))


class SavedBytes:
    """The bytes autograd saves for backward inside a block, measured: each distinct storage once, the
    model's parameters left out (the activations and logits of one micro-batch's forward).

        with SavedBytes(model) as saved:
            loss = forward(model, micro)
        saved.total    # bytes

    Tensors that activation checkpointing recomputes are not saved, so they are not counted; the outputs a
    selectively checkpointed layer keeps (`rlcore.models.recompute`) are."""

    def __init__(self, model: torch.nn.Module) -> None:
        local = (getattr(p, "_local_tensor", p) for p in model.parameters())  # a DTensor's shard
        self._seen = {ptr for ptr in map(_storage_ptr, local) if ptr is not None}
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._kept = counting(self._pack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = _storage_ptr(t)
        if ptr is not None and ptr not in self._seen:
            self._seen.add(ptr)
            self.total += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        self._kept.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._kept.__exit__(*exc)
        self._hooks.__exit__(*exc)


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where `t`'s storage lives, or None for a tensor without a plain one (meta, a subclass, a freed one)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
