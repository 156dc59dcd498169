"""Exact mode: a batch-invariant forward, so that the engine's sampling log-probs equal the trainer's bit for bit.

    make_exact(model)          # once, on every copy that samples or scores (the trained module, an engine's copy)
    exact_block(model)         # BLOCK when the model is exact, else None (forward.py and the engine align to it)

A token's log-prob must not depend on which other rows share its batch, on padding, on micro-batching, or
on whether its context came from a KV cache or from the same forward. Measured on this CPU (torch 2.13,
experiments/README.md, issue 41), each source of difference, and what exact mode does about it:

- matrix products: fp32 `mm`/`bmm` with fewer than ~15 rows take another kernel (up to 7e-6 apart); with
  16 or more rows the result of a row depends on that row alone (any row count, any column count, any
  position in the batch, 1 or 2 threads). Exact mode pads every product to at least `MIN_ROWS` rows.
- attention: sdpa over a KV cache and over a whole sequence sum over keys in different orders. Exact mode
  runs one attention function (`exact_attention`, registered with transformers as "rlcore_exact") for
  prefill, decode and training: scores by a padded `bmm` (a reduction over the head dimension only), a
  softmax whose max is exact in any order, and the weighted sum of values (with the normaliser as one more
  column) in fixed blocks of `BLOCK` keys, each block one product of fixed inner size, the blocks folded
  in order by `cumsum` (a sequential sum: all-masked blocks add exact zeros). The blocks sit at the same
  place relative to the tokens on both sides because both lay a sequence out with its prompt left-padded to
  a multiple of `BLOCK` columns (`aligned_prompt_width`).
- SiLU: the vectorised and the scalar tail paths of `aten.silu` differ by 1 ulp (the tail falls where the
  tensor's size puts it); exact mode computes x / (1 + exp(-x)), whose exp is position-invariant (measured).
- RMSNorm, embedding, rotary tables, log-softmax over the vocabulary, elementwise add/mul: measured
  row-invariant as they are.

The products and SiLU are switched by a `TorchDispatchMode` (`ExactKernels`) that the model's own forward
hooks enter and leave, so every forward of an exact model, trainer's or engine's, runs under it and nothing
else does. It does not change the backward's kernels (gradients need no invariance).

What it does not cover (refused by the trainer's preflight in one line): tensor and sequence parallelism
(they change a reduction across ranks), shared-prompt packing (a packed row's keys sit elsewhere; exact mode
runs plain rows instead), mixtures of experts and vision-language models (not measured yet), vLLM (no
batch-invariant mode on CPU), and the lean decode step (its products are oneDNN-packed: the engine takes
the Hugging Face step).

On CUDA the same seams take batch-invariant kernels: `ExactKernels` would route `mm`/`bmm` to fixed-tile,
non-split-K GEMMs (vLLM's batch-invariant mode overrides `aten::mm`, `addmm`, `bmm`, `_log_softmax` and
`mean` the same way, with Triton kernels; `sgemm-bi` on PyPI offers deterministic fixed-tile fp32 GEMMs),
and `exact_attention` is already written as fixed key blocks folded in order (docs/GPU.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from rlcore.batch import Batch
from rlcore.models.onednn import can_pack, pack, packed_linear

BLOCK = 16
"""Keys per block of `exact_attention`'s weighted sum (one product of inner size BLOCK each), and the
multiple a prompt's padded width is rounded to (`aligned_prompt_width`)."""

MIN_ROWS = 16
"""The fewest rows a matrix product runs with in exact mode (fp32 kernels change below ~15 rows here)."""

EXACT_ATTENTION = "rlcore_exact"
"""The attention implementation name exact mode registers with transformers."""


def exact_block(model: nn.Module) -> int | None:
    """BLOCK when `model` runs in exact mode (`make_exact`), else None."""
    config = getattr(model, "config", None)
    return BLOCK if getattr(config, "_attn_implementation", None) == EXACT_ATTENTION else None


def aligned_prompt_width(width: int) -> int:
    """`width` rounded up to a multiple of BLOCK: the prompt columns of an exact layout."""
    return -(-width // BLOCK) * BLOCK


def align_prompts(batch: Batch) -> Batch:
    """`batch` with its prompt columns (`input_ids`, `attention_mask`, `position_ids` where present) left-padded
    to `aligned_prompt_width`: the engine's and the trainer's layouts of an exact model (padding is masked,
    id 0, position 0)."""
    width = batch["input_ids"].shape[1]
    extra = aligned_prompt_width(width) - width
    if not extra:
        return batch
    fields = [k for k in ("input_ids", "attention_mask", "position_ids") if k in batch]
    return batch.with_(**{k: nn.functional.pad(batch[k], (extra, 0)) for k in fields}, overwrite=True)


def _pad_rows(x: Tensor, dim: int) -> Tensor:
    """`x` with zero rows appended along `dim` up to MIN_ROWS, contiguous."""
    extra = MIN_ROWS - x.shape[dim]
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


_PACKS = WeakIdKeyDictionary()
"""weight -> (its version, its oneDNN-packed copy made at that version) (an optimizer step or a
load bumps the version, and the next product repacks)."""


def _packed(weight: Tensor) -> Tensor | None:
    """`weight`'s packed copy (made once per version), or None where oneDNN cannot pack it."""
    if not can_pack(weight):
        return None
    hit = _PACKS.get(weight)
    if hit is None or hit[0] != weight._version:
        hit = (weight._version, pack(weight))
        _PACKS[weight] = hit
    return hit[1]


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b, (..., K) -> (..., N): exact mode's one product, for the trainer's forward and the engine's
    step alike. The rows (all leading dimensions) are padded with zeros to at least MIN_ROWS, and the
    weight is multiplied in oneDNN's packed layout where it packs (`rlcore.models.onednn`: a row's result
    then depends on that row alone, from 2 rows up, and it is faster than MKL's sgemm at every row count
    measured), else by `F.linear`."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m < MIN_ROWS:
        rows = _pad_rows(rows, 0)
    packed = _packed(weight)
    out = (
        packed_linear(rows.contiguous(), packed, bias) if packed is not None else F.linear(rows, weight, bias)
    )
    return out[:m].reshape(*x.shape[:-1], out.shape[-1])


def silu(x: Tensor) -> Tensor:
    """x / (1 + e^-x), in float32: the same bits wherever an element sits in its tensor (`aten.silu`'s
    vectorised and scalar paths differ by an ulp)."""
    z = x.float()
    return (z / (1 + torch.exp(-z))).to(x.dtype)


def _weight_of(b: Tensor) -> Tensor | None:
    """The (N, K) weight whose transpose `b` (K, N) is (how `F.linear` hands a weight to `mm`), or None."""
    base = b._base
    if base is None or base.dim() != 2 or not base.is_contiguous() or b.shape != base.shape[::-1]:
        return None
    return base if b.stride() == (1, base.stride(0)) and b.data_ptr() == base.data_ptr() else None


def _mm(func: Any, a: Tensor, b: Tensor) -> Tensor:
    weight = _weight_of(b)
    if weight is not None:
        return product(a, weight)
    m = a.shape[0]
    return func(_pad_rows(a, 0), b)[:m] if m < MIN_ROWS else func(a, b)


def _addmm(func: Any, bias: Tensor, a: Tensor, b: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    weight = _weight_of(b)
    if weight is not None and bias.dim() == 1 and beta == 1 and alpha == 1:
        return product(a, weight, bias)
    m = a.shape[0]
    if m >= MIN_ROWS:
        return func(bias, a, b, beta=beta, alpha=alpha)
    if bias.dim() == 2 and bias.shape[0] == m > 1:
        bias = _pad_rows(bias, 0)
    return func(bias, _pad_rows(a, 0), b, beta=beta, alpha=alpha)[:m]


def _bmm(func: Any, a: Tensor, b: Tensor) -> Tensor:
    m = a.shape[1]
    return func(_pad_rows(a, 1), b)[:, :m] if m < MIN_ROWS else func(a, b)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (batched) with a's rows (dim -2) padded to at least MIN_ROWS."""
    m = a.shape[-2]
    return (_pad_rows(a, -2) @ b)[..., :m, :] if m < MIN_ROWS else a @ b


def _silu(func: Any, x: Tensor) -> Tensor:
    return silu(x)


_HANDLERS = {
    torch.ops.aten.mm.default: _mm,
    torch.ops.aten.addmm.default: _addmm,
    torch.ops.aten.bmm.default: _bmm,
    torch.ops.aten.silu.default: _silu,
}
"""The aten ops exact mode replaces, each with its batch-invariant form (one table, one place)."""


class ExactKernels(TorchDispatchMode):
    """Runs `_HANDLERS`' ops in their batch-invariant form; every other op as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **(kwargs or {}))
        return handler(func, *args, **(kwargs or {}))


def _allowed(mask: Tensor | None, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """(b or 1, 1, q_len, kv_len) bool: where a query may see a key. transformers passes None for a plain
    causal layout whose queries are the last `q_len` positions."""
    if mask is not None:
        return mask if mask.dtype == torch.bool else mask == 0
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
    allowed = _allowed(attention_mask, q_len, key.shape[2], query.device)
    out = attend(query, key, value, allowed, d**-0.5 if scaling is None else scaling)  # (b, h, q, d)
    return out.transpose(1, 2).contiguous(), None


def attend(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Attention with a fixed reduction order (see the module docstring): (b, h, q, d) in the query's dtype.

    query (b, h, q, d), key and value (b, kvh, L, d) (views of a cache are read in place), allowed
    (b or 1, 1, q, L) bool. Computed in float32; query heads grouped over their kv head (GQA) without
    repeating the keys. Each block of BLOCK keys is one product of inner size BLOCK (the last one padded
    with zeros), its weights' sum one sum of BLOCK terms; the blocks are folded in order by `cumsum`."""
    b, h, q_len, d = query.shape
    kvh, kv_len = key.shape[1], key.shape[2]
    g, full = h // kvh, kv_len // BLOCK * BLOCK
    blocks = -(-kv_len // BLOCK)
    q = query.float().reshape(b, kvh, g * q_len, d)  # (b, kvh, g q, d): a kv head's query heads
    scores = _matmul(q, key.float().transpose(-1, -2)).view(b, kvh, g, q_len, kv_len) * scale
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # exact in any order
    top = torch.where(torch.isfinite(top), top, 0.0)  # a query that sees nothing gets weights 0
    weights = nn.functional.pad(torch.exp(scores - top), (0, blocks * BLOCK - kv_len))  # (.., blocks * BLOCK)
    weights = weights.view(b, kvh, g * q_len, blocks, BLOCK)
    values = value.float()
    parts = [
        _matmul(
            weights[:, :, :, : full // BLOCK].transpose(2, 3), values[:, :, :full].unflatten(2, (-1, BLOCK))
        )
    ]
    if full < kv_len:  # the last, partial block: its values padded with zero rows
        tail = nn.functional.pad(values[:, :, full:], (0, 0, 0, BLOCK - (kv_len - full)))
        parts.append(_matmul(weights[:, :, :, -1:].transpose(2, 3), tail[:, :, None]))
    total = torch.cat(parts, dim=2).cumsum(dim=2)[:, :, -1]  # (b, kvh, g q, d): blocks folded in order
    norm = weights.sum(dim=-1).cumsum(dim=-1)[..., -1:]  # (b, kvh, g q, 1): the same blocks' sums
    out = torch.where(norm > 0, total / torch.where(norm > 0, norm, 1.0), 0.0)
    return out.view(b, kvh, g, q_len, d).reshape(b, h, q_len, d).to(query.dtype)


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
    trainer's forward and the lean step's table (`rlcore.rollout.lean`) read the same values."""

    def __init__(self, rotary: nn.Module) -> None:
        self.compute = rotary.forward  # the original, bound
        self.cos: Tensor | None = None  # (positions, d) float32
        self.sin: Tensor | None = None

    def __call__(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        need = int(position_ids.max()) + 1 if position_ids.numel() else 0
        while self.cos is None or self.cos.shape[0] < need:
            start = 0 if self.cos is None else self.cos.shape[0]
            piece = torch.arange(start, start + ROPE_CHUNK, device=x.device)[None]
            cos, sin = self.compute(x.new_zeros((), dtype=torch.float32), piece)
            self.cos = cos[0] if self.cos is None else torch.cat([self.cos, cos[0]])
            self.sin = sin[0] if self.sin is None else torch.cat([self.sin, sin[0]])
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def _rotary(model: nn.Module) -> nn.Module | None:
    base = getattr(model, "model", None)
    return getattr(base, "rotary_emb", None)


def why_not_exact(model: nn.Module) -> str | None:
    """Why exact mode cannot run `model` (one phrase), or None."""
    from rlcore.models.moe import router_tap
    from rlcore.models.vision import placeholder_ids

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return f"{type(model).__name__} is not a transformers model"
    if router_tap(model) is not None:
        return "a mixture of experts is not covered yet"
    if placeholder_ids(model):
        return "a vision-language model is not covered yet"
    if _rotary(model) is None:
        return f"{type(model).__name__} has no .model.rotary_emb (a <Type>ForCausalLM with rotary positions)"
    return None


def make_exact(model: nn.Module) -> nn.Module:
    """Switch `model` (in place) to exact mode: the "rlcore_exact" attention, and `ExactKernels` around each
    of its forwards. Raises ValueError (one line) for a model it does not cover (`why_not_exact`)."""
    why = why_not_exact(model)
    if why is not None:
        raise ValueError(f"exact mode: {why}")
    if exact_block(model) is not None:
        return model
    _register()
    model.set_attn_implementation(EXACT_ATTENTION)
    rotary = _rotary(model)
    rotary.forward = RotaryTable(rotary)
    mode = ExactKernels()

    def enter(*_: Any) -> None:
        mode.__enter__()

    def leave(*_: Any) -> None:
        mode.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return model
