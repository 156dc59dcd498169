"""Exact mode: a batch-invariant forward, so that the engine's sampling log-probs equal the trainer's bit for bit.

    make_exact(model)          # once, on every copy that samples or scores (the trained module, an engine's copy)
    mode = kernel_mode(model)  # EXACT_MODE after make_exact, else DEFAULT_MODE: a value the engine, the lean
                               # step and the forward layouts take (mode.align: the columns prompts end on)

A token's log-prob must not depend on which other rows share its batch, on padding, on micro-batching, on
prompt packing, or on whether its context came from a KV cache or from the same forward. Each source of
difference was measured alone on this CPU (torch 2.13; experiments/exact_sources.py, the table in
experiments/README.md, "Bitwise on-policy"); what exact mode does about each:

- matrix products: MKL's fp32 sgemm takes another kernel below ~15 rows (up to 7e-6 apart), and the lean
  decode step multiplied by oneDNN's packed kernel, which sums in another order again. Exact mode runs
  every product through one kernel on both sides (`product`): oneDNN's packed product (a weight packed once
  per trainer forward and per `generate`; row-invariant from 2 rows on AVX2 and AVX-512 CPUs, and faster
  than MKL's sgemm at every row count measured), its rows laid out as `exact_kernels.KernelRows` says: on at
  least `MIN_ROWS` rows, or where this CPU's kernels block rows by their count (bf16 on AMX), in fixed
  tiles. Which layout holds is measured for the model's shapes before it runs (`exact_check.calibrate`);
  where none does, `make_exact` refuses in one line naming the CPU's instructions. Inside the trainer's Hugging Face forward the
  `mm`/`addmm` of a weight are routed there by a `TorchDispatchMode` (`ExactKernels`), which the model's
  own forward hooks enter and leave.
  A mixture of experts' grouped products (`_grouped_mm`, each expert on its tokens: few rows each) run
  expert by expert through the same `product` (measured before: 2.5e-6 fp32, 0.10 bf16 on tiny-moe); the
  lean step calls a MoE block inside an `ExactKernels` of its own (`under_kernels`), so the engine's
  experts are the trainer's. Recorded routes (`rlcore.models.moe`) are laid out with the prompt columns.
- attention: sdpa over a KV cache and over a whole sequence sum over keys in different orders. Exact mode
  runs one function (`attend`, registered with transformers as "rlcore_exact") for prefill, decode and
  training: scores by products of at least MIN_ROWS rows (a reduction over the head dimension only), a
  softmax whose max is exact in any order, and the weighted sum of values in fixed blocks of `BLOCK` keys,
  each block one product of inner size BLOCK, the blocks folded in order (a sequential sum: masked blocks
  add exact zeros), the normaliser summed block by block alike. A vision tower's full (not causal)
  attention over one image runs through it too. The blocks sit at the same
  place relative to a sequence's tokens on both sides because both lay a prompt out ending on a multiple
  of BLOCK columns (`align_prompts`; a packed row puts each prompt's end and each response's start on a
  multiple, `rlcore.models.shared_prompt.pack_plan`).
- rotary positions: `cos`/`sin` take a scalar path for the elements that end a vectorised run, so a
  position's value depends on the tensor's size. Exact mode looks them up in one table built in fixed
  pieces (`RotaryTable`), read by the trainer's forward and the lean step alike; multimodal positions
  (M-RoPE) read each column at its own component's position.
- vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): run one image at a time (`_per_image`), so an image's
  features are computed in the same shapes whichever images share the forward (its patch embedding's
  convolution, rotary table and activations are not otherwise covered); measured 0 apart with the
  other pieces alone at the sizes tried, kept so by construction.
- SiLU: likewise 1 ulp between the vectorised and the scalar path; exact mode computes x / (1 + exp(-x)),
  whose exp is position-invariant (measured).
- RMSNorm (the Hugging Face arithmetic, which the lean step copies in exact mode), embedding, log-softmax
  over the vocabulary, elementwise add/mul: measured row-invariant as they are.
The backward keeps its kernels (gradients need no invariance): the products' own, and for attention
plain attention's, recomputed by sdpa from q, k and v (`_ExactAttend`).

Not covered (refused in one line by the trainer's preflight or `make_exact`): tensor and sequence
parallelism (they split a reduction across ranks), expert parallelism (its experts multiply by another
path), vLLM (no batch-invariant mode on CPU), the agent loop (each turn is prefilled in its own layout),
autocast (the engine does not autocast).

On CUDA the same seams take batch-invariant kernels (experiments/README.md, "Bitwise on-policy", its GPU
plan): `product` would call fixed-tile, no-split-K GEMMs (`sgemm-bi`'s `deterministic_linear`, or cuBLASLt
with split-K off, as vLLM's batch-invariant mode does on Hopper), and `attend` is already fixed key blocks
folded in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlcore import columns
from rlcore.batch import Batch
from rlcore.dist.attention import has_switch, set_attention
from rlcore.models.exact_check import calibrate
from rlcore.models.exact_kernels import (
    BLOCK,
    MIN_ROWS,
    ExactKernels,
    batched_product,
    fold,
    packed_or_plain,
    product,
    silu,
    stacks_exactly,
    under_kernels,
)
from rlcore.models.families import covering, family_of
from rlcore.models.vision import vision_tower

__all__ = [
    "BLOCK",
    "DEFAULT_MODE",
    "EXACT_ATTENTION",
    "EXACT_MODE",
    "MIN_ROWS",
    "ExactKernels",
    "KernelMode",
    "RotaryTable",
    "align_prompts",
    "aligned_prompt_width",
    "attend",
    "exact_attention",
    "kernel_mode",
    "left_pad_prompts",
    "make_exact",
    "packed_or_plain",
    "product",
    "silu",
    "stacks_exactly",
    "under_kernels",
    "why_not_exact",
]  # fmt: skip

EXACT_ATTENTION = "rlcore_exact"
"""The attention implementation name exact mode registers with transformers."""


@dataclasses.dataclass(frozen=True)
class KernelMode:
    """Which kernels a model runs: the default ones, or exact mode's (`make_exact` installs them). Chosen once,
    when the model is made, and passed to what lays out its inputs: the native engine, its lean step
    (`rlcore.rollout.native.lean.LEAN_KERNELS`) and the forward layouts (`rlcore.models.forward.model_inputs`)."""

    name: str
    align: int
    """The multiple of columns every prompt ends on and every response starts on (1: anywhere)."""


DEFAULT_MODE = KernelMode("default", 1)
EXACT_MODE = KernelMode("exact", BLOCK)

_MODE_ATTR = "_rlcore_kernel_mode"


def kernel_mode(model: nn.Module) -> KernelMode:
    """The kernel mode `make_exact` recorded on `model` (DEFAULT_MODE where it did not run), seen through a
    `torch.compile` wrapper (LoRA adapters go in place: `rlcore.models.lora.apply_lora` returns the model)."""
    inner = getattr(model, "_orig_mod", model)
    return inner.__dict__.get(_MODE_ATTR, DEFAULT_MODE)


def aligned_prompt_width(width: int, align: int = BLOCK) -> int:
    """`width` rounded up to a multiple of `align` (BLOCK: the prompt columns of an exact layout)."""
    return -(-width // align) * align


def align_prompts(batch: Batch, align: int = BLOCK) -> Batch:
    """`batch` with its prompt columns left-padded to a multiple of `align` (exact mode's: BLOCK,
    `aligned_prompt_width`): the engine's and the trainer's layouts of an exact model (`left_pad_prompts`)."""
    width = batch["input_ids"].shape[1]
    return left_pad_prompts(batch, aligned_prompt_width(width, align) - width) if align > 1 else batch


def left_pad_prompts(batch: Batch, extra: int) -> Batch:
    """`batch` with `extra` more padding columns before its prompts, each prompt field padded as the batch
    schema says (`rlcore.columns`: id 0 here, masked, position 0, no route, M-RoPE position 0)."""
    return columns.left_pad_prompts(batch, extra, pad_id=0)


def _allowed(mask: Tensor | None, q_len: int, kv_len: int, device: torch.device, causal: bool = True) -> Tensor:
    """(b or 1, 1, q_len, kv_len) bool: where a query may see a key. transformers passes None for a plain
    causal layout whose queries are the last `q_len` positions, or for a vision tower's full attention
    over one image (`causal` False)."""
    if mask is not None:
        return mask if mask.dtype == torch.bool else mask == 0
    if not causal:
        return torch.ones((1, 1, q_len, kv_len), dtype=torch.bool, device=device)
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]


def exact_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """`attend` as transformers calls an attention function: query (b, h, q, d), key and value
    (b, kvh, L, d), a bool mask (b, 1, q, L) or None (plain causal) -> ((b, q, h, d), None)."""
    q_len, d = query.shape[2:]
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    allowed = _allowed(attention_mask, q_len, key.shape[2], query.device, causal=causal is not False)
    scale = d**-0.5 if scaling is None else scaling
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        out = _ExactAttend.apply(query, key, value, allowed, scale)
    else:
        out = attend(query, key, value, allowed, scale)  # (b, h, q, d)
    return out.transpose(1, 2).contiguous(), None


class _ExactAttend(torch.autograd.Function):
    """`attend` forward; the backward of plain attention (sdpa), recomputed from q, k and v: gradients need
    no invariance, and autograd through `attend`'s per-block products and slices cost more than the
    forward (measured: a zero-filled gradient of the whole weights tensor per key block)."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(query, key, value, allowed)
        ctx.scale = scale
        return attend(query, key, value, allowed, scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, allowed = ctx.saved_tensors
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # a query that sees nothing: output 0, grad 0
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=ctx.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip
            wanted = [t for t in (q, k, v) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in (q, k, v)), None, None)


def attend(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Attention with a fixed reduction order (see the module docstring): (b, h, q, d) in the query's dtype.

    query (b, h, q, d), key and value (b, kvh, L, d) (views of a cache are read in place), allowed
    (b or 1, 1, q, L) bool. Computed in float32; query heads grouped over their kv head (GQA) without
    repeating the keys. Each block of BLOCK keys is one product of inner size BLOCK (the last one padded
    with zeros), its weights' sum one sum of BLOCK terms; the blocks are folded in order. A block's
    product runs only on the queries from the first to the last that sees one of its keys (`_seen`):
    the others' weights there are exact zeros, which add nothing (a causal forward skips half). Blocks
    seen by the same queries (all of a decode step's) go in one batched product (`_runs`)."""
    b, h, q_len, d = query.shape
    kvh, kv_len = key.shape[1], key.shape[2]
    g, blocks = h // kvh, -(-kv_len // BLOCK)
    q = (query.float() * scale).reshape(b, kvh, g * q_len, d)  # (b, kvh, g q, d): a kv head's query heads
    scores = batched_product(q, key.float().transpose(-1, -2)).view(b, kvh, g, q_len, kv_len)
    scores.masked_fill_(~allowed[:, :, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # exact in any order
    top = torch.where(torch.isfinite(top), top, 0.0)  # a query that sees nothing gets weights 0
    weights = torch.exp(scores.sub_(top))
    values = value.float()
    if blocks * BLOCK != kv_len:  # the last block padded: weights 0 on zero rows of values
        weights = nn.functional.pad(weights, (0, blocks * BLOCK - kv_len))
        values = nn.functional.pad(values, (0, 0, 0, blocks * BLOCK - kv_len))
    weights = weights.view(b, kvh, g, q_len, blocks, BLOCK)
    blocked = values.view(b, kvh, blocks, BLOCK, d)
    total = values.new_zeros((b, kvh, g, q_len, d))
    for lo, hi, first, end in _runs(_seen(allowed, blocks)):  # ((0 + p0) + p1) + ... per query, in block order
        r, n = hi - lo, end - first  # n blocks seen by the same queries (a decode step: all), one product
        w = weights[:, :, :, lo:hi, first:end].permute(0, 1, 4, 2, 3, 5).reshape(b, kvh, n, g * r, BLOCK)
        for part in batched_product(w, blocked[:, :, first:end]).unbind(2):  # (b, kvh, g r, d) per block
            total[:, :, :, lo:hi] += part.view(b, kvh, g, r, d)
    sums = weights.sum(dim=-1, keepdim=True).view(b, kvh, g * q_len, blocks, 1)
    norm = fold(list(sums.unbind(3))).view(b, kvh, g, q_len, 1)  # the blocks' weight sums, in order
    out = torch.where(norm > 0, total / torch.where(norm > 0, norm, 1.0), 0.0)
    return out.reshape(b, h, q_len, d).to(query.dtype)


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(first query, last + 1, first block, last block + 1) of each run of consecutive key blocks that the
    same (non-empty) range of queries sees: their products go in one batched product (a product's rows do
    not depend on the batch around them)."""
    runs: list[tuple[int, int, int, int]] = []
    for j, (lo, hi) in enumerate(ranges):
        if hi <= lo:
            continue
        if runs and runs[-1][:2] == (lo, hi) and runs[-1][3] == j:
            runs[-1] = (lo, hi, runs[-1][2], j + 1)
        else:
            runs.append((lo, hi, j, j + 1))
    return runs


def _seen(allowed: Tensor, blocks: int) -> list[tuple[int, int]]:
    """Per key block, (first, last + 1) of the queries that see a key in it in some row ((0, 0): none)."""
    q_len, kv_len = allowed.shape[-2:]
    padded = nn.functional.pad(allowed, (0, blocks * BLOCK - kv_len))
    seen = padded.view(*padded.shape[:-1], blocks, BLOCK).any(dim=-1).flatten(0, -3).any(dim=0)  # (q, blocks)
    first = seen.int().argmax(dim=0)
    last = q_len - seen.flip(0).int().argmax(dim=0)
    any_ = seen.any(dim=0)
    return list(zip(torch.where(any_, first, 0).tolist(), torch.where(any_, last, 0).tolist(), strict=True))


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)


ROPE_CHUNK = 256
"""Positions per piece of `RotaryTable`: each piece's cos and sin are computed alone, in one shape."""


class RotaryTable:
    """A rotary embedding's cos and sin looked up by position, from a table built ROPE_CHUNK positions at a
    time by the module's own forward (float32), so that a position's values are the same bits whatever
    else a forward holds (`cos`/`sin` take another path for the elements that end a vectorised run, and
    where those fall depends on the tensor's size). Replaces the module's forward (`make_exact`), so the
    trainer's forward and the lean step's table (`rlcore.rollout.native.lean`) read the same values.

    Multimodal positions (M-RoPE: position_ids (c, b, s), one component per time, height and width) read
    each column of the table at the position of the component that owns it (`owners`)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.compute = rotary.forward  # the original, bound
        self.cos: Tensor | None = None  # (positions, d) float32
        self.sin: Tensor | None = None
        self.owner: Tensor | None = None  # (d,) long: the M-RoPE component each column reads

    def __call__(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        self._grow(int(position_ids.max()) + 1 if position_ids.numel() else 0, x.device)
        assert self.cos is not None and self.sin is not None
        if position_ids.dim() == 2:
            return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)
        owner = self.owners(position_ids.shape[0], x.device)
        index = position_ids[owner].permute(1, 2, 0).reshape(-1, owner.shape[0])  # (b s, d)
        b, s = position_ids.shape[1:]
        cos, sin = (t.gather(0, index).view(b, s, -1).to(x.dtype) for t in (self.cos, self.sin))
        return cos, sin

    def _grow(self, need: int, device: torch.device) -> None:
        while self.cos is None or self.cos.shape[0] < need:
            start = 0 if self.cos is None else self.cos.shape[0]
            piece = torch.arange(start, start + ROPE_CHUNK, device=device)[None]
            cos, sin = self.compute(torch.zeros((), dtype=torch.float32, device=device), piece)
            self.cos = cos[0] if self.cos is None else torch.cat([self.cos, cos[0]])
            self.sin = sin[0] if self.sin is None else torch.cat([self.sin, sin[0]])

    def owners(self, components: int, device: torch.device) -> Tensor:
        """(d,) long: which of `components` position components each column's angle comes from, found by
        moving one component at a time (its columns' sines leave 0)."""
        if self.owner is None:
            moved = []
            for c in range(components):
                position = torch.zeros((components, 1, 1), dtype=torch.long, device=device)
                position[c] = 1
                _, sin = self.compute(torch.zeros((), dtype=torch.float32, device=device), position)
                moved.append(sin.reshape(-1) != 0)
            moved_by = torch.stack(moved)  # (components, d)
            if not bool((moved_by.sum(dim=0) == 1).all()):
                raise ValueError("exact mode: a rotary embedding whose columns mix position components")
            self.owner = moved_by.int().argmax(dim=0)
        return self.owner


def _rotary(model: nn.Module) -> nn.Module | None:
    """The language model's rotary embedding (`model.model.rotary_emb`, or a vision-language model's
    `model.model.language_model.rotary_emb`), or None."""
    base = getattr(model, "model", None)
    return getattr(base, "rotary_emb", None) or getattr(getattr(base, "language_model", None), "rotary_emb", None)


def why_not_exact(model: nn.Module) -> str | None:
    """Why exact mode cannot run `model` (one phrase), or None."""
    config = getattr(model, "config", None)
    if config is None or not has_switch(config):
        return f"{type(model).__name__} is not a transformers model"
    family = family_of(model)
    why = family.refusal("exact")
    if why is not None:  # the families exact mode was built and shown for: rlcore.models.families
        return f"{family.name}: {why} (exact mode covers {', '.join(covering('exact'))})"
    if _rotary(model) is None:
        return (f"{type(model).__name__} has no rotary embedding at .model.rotary_emb or "
                ".model.language_model.rotary_emb (a transformers causal LM with rotary positions)")
    return None


def make_exact(model: nn.Module) -> nn.Module:
    """Switch `model` (in place) to exact mode: the "rlcore_exact" attention, and `ExactKernels` around each
    of its forwards, its products in the row layout this CPU was measured to keep row-invariant for them
    (`exact_check.calibrate`). Raises ValueError (one line) for a model it does not cover (`why_not_exact`)
    or a CPU whose kernels no layout makes row-invariant."""
    why = why_not_exact(model)
    if why is not None:
        raise ValueError(f"exact mode: {why}")
    if kernel_mode(model) is EXACT_MODE:
        return model
    calibrate(model)  # this CPU's row layout for the model's products, or ValueError
    _register()
    set_attention(model, EXACT_ATTENTION)
    rotary = _rotary(model)
    rotary.forward = RotaryTable(rotary)
    tower = vision_tower(model)
    if tower is not None:
        tower.forward = _per_image(tower.forward)
    modes: list[ExactKernels] = []  # one per forward in flight (fresh packs each time)

    def enter(*_: Any) -> None:
        modes.append(ExactKernels())
        modes[-1].__enter__()

    def leave(*_: Any) -> None:
        modes.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    object.__setattr__(model, _MODE_ATTR, EXACT_MODE)  # a plain attribute: the value `kernel_mode` returns
    return model


def _per_image(encode: Callable[..., Any]) -> Callable[..., Any]:
    """A vision tower's forward run one image at a time, its outputs concatenated as the tower's own: an
    image's features are then computed in the same shapes whichever images share its forward (the
    tower's patch rotary table, its activations' vectorised tails and its attention's chunks follow the
    forward's total patch count), so they are the same bits in the engine and in every trainer forward."""

    def call(pixel_values: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
        patches = grid_thw.prod(dim=-1).tolist()
        outs = [encode(x, grid_thw=g[None], **kwargs) for x, g in zip(pixel_values.split(patches), grid_thw, strict=True)]
        return outs[0] if len(outs) == 1 else type(outs[0])(**{k: _joined([o[k] for o in outs]) for k in outs[0]})

    return call


def _joined(parts: list[Any]) -> Any:
    """Per-image outputs as one: tensors concatenated on dim 0, lists of tensors element by element."""
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return type(parts[0])(torch.cat(layer) for layer in zip(*parts, strict=True))
