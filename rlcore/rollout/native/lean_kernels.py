"""The arithmetic of the lean decode step (`rlcore.rollout.native.lean`), as values: the step calls these and
branches on no mode.

    shape.kernels.product(x, w, b)      # x W^T + b
    shape.kernels.attend(shape, q, k, v, keys, values, bias)

Two sets exist, chosen once per decoder from the model's kernel mode (`LEAN_KERNELS`):
- `DEFAULT`: fused RMSNorms, products on weights that may be packed into oneDNN's layout (run on a
  bucketed row count, `row_bucket`, so oneDNN's per-shape caches stay small), and attention over the
  cache beside the new token's own key (a softmax over both, nothing written);
- `EXACT`: the trainer's forward's arithmetic bit for bit (`rlcore.models.exact`): `exact.product`, the
  Hugging Face RMSNorm, `exact.attend` over the cache with the new key written into it first, and
  `exact.silu`.

They live apart from the step so that the step reads as the model's layers, and each kernel can be read,
and tested, on its own. `LeanShape` (sizes, epsilons, the activation and the kernels) is the static part
every kernel and the step take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlcore.models import exact
from rlcore.models.onednn import packed_linear
from rlcore.rollout.native.lean_cover import Layer
from rlcore.rollout.native.lean_weights import exact_weights


@dataclasses.dataclass(frozen=True)
class LeanShape:
    """The static part of a lean step: sizes, epsilons and the activation."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    eps: float
    qk_eps: float | None
    """Epsilon of Qwen3's per-head q/k RMSNorm; None when the model has none."""
    act: Callable[[Tensor], Tensor]
    kernels: LeanKernels
    """The step's arithmetic: `DEFAULT`, or `EXACT` (exact mode, `rlcore.models.exact`), chosen once."""

    @property
    def qkv_widths(self) -> tuple[int, int, int]:
        """The widths of q, k and v in a fused projection's output."""
        return self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim


def _fused_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _hf_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The Hugging Face RMSNorm's arithmetic: float32, then the weight times the normalised input cast back."""
    z = x.float()
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return weight * z.to(x.dtype)


def _attend_exact(
    shape: LeanShape, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, bias: Tensor
) -> Tensor:
    """`exact.attend` of one query per row over the cache, whose last position (L - 1) receives the new
    token's key and value first: the one attention the trainer's forward runs. (a, heads * d)."""
    keys[:, :, -1], values[:, :, -1] = k, v
    out = exact.attend(q[:, :, None], keys, values, (bias == 0)[:, None, None], shape.scaling)
    return out.reshape(q.shape[0], -1)


def linear_product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x W^T + b; W may be packed by `pack_weights` (an opaque oneDNN tensor).

    A packed product runs on `row_bucket` rows (x padded with zeros, the extra rows dropped): oneDNN
    and ideep cache one primitive per input shape, each holding buffers (0.6 MB for a 576 x 576
    weight, 6 MB for SmolLM2's head), so a decode that shrinks one row at a time would grow memory
    by the number of distinct row counts a run ever sees."""
    if not w.is_mkldnn:
        return F.linear(x, w, b)
    a = x.shape[0]
    extra = row_bucket(a) - a
    padded = F.pad(x, (0, 0, 0, extra)) if extra else x
    return packed_linear(padded, w, b)[:a]


def row_bucket(rows: int) -> int:
    """`rows` rounded up to a power of two up to 16, then on a ladder of 4 steps per octave (20, 24, 28,
    32, 40, ...): 13 distinct values up to 64 rows, 25 up to 512. Below 16 rows the product is bound by
    reading the weight, so the extra rows cost little (SmolLM2's projections and head: 23-47 ms for
    any of 1-16 rows, measured); above, they are under 25% of the rows."""
    if rows <= 16:
        return 1 << (rows - 1).bit_length()
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def _attend(
    shape: LeanShape, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, bias: Tensor
) -> Tensor:
    """Attention of one query per row over the cached keys and its own: (a, heads * d).

    q (a, heads, d); k, v (a, kv_heads, d) of the new token; keys, values (a, kv_heads, L, d);
    query heads are grouped over their kv head (GQA) without repeating the cache."""
    a, g, d = q.shape[0], shape.heads // shape.kv_heads, shape.head_dim
    q4 = q.reshape(a, shape.kv_heads, g, d) * shape.scaling  # (a, kvh, g, d)
    cached = torch.matmul(q4, keys.transpose(-1, -2)) + bias[:, None, None, :]  # (a, kvh, g, L)
    own = (q4 * k[:, :, None, :]).sum(-1, keepdim=True)  # (a, kvh, g, 1)
    p = torch.softmax(torch.cat((cached, own), dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(p[..., :-1], values) + p[..., -1:] * v[:, :, None, :]  # (a, kvh, g, d)
    return out.reshape(a, shape.heads * d)


@dataclasses.dataclass(frozen=True)
class LeanKernels:
    """The arithmetic of a lean step, as a value (`DEFAULT` or `EXACT`): the step calls these, and branches
    on no mode."""

    name: str
    product: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    """x W^T + b (W plain or packed)."""
    norm: Callable[[Tensor, Tensor, float], Tensor]
    """RMSNorm (x, weight, eps)."""
    attend: Callable[..., Tensor]
    """One query per row over the cache (`_attend`'s signature)."""
    silu: Callable[[Tensor], Tensor]
    in_place: int
    """1: the new token's key and value are written into the cache and attended there; 0: beside it."""
    packs: bool
    """The decoder may pack the weights into oneDNN's layout at each `start`."""
    prepare: Callable[[tuple[Layer, ...], Tensor], tuple[tuple[Layer, ...], Tensor]] | None
    """The layers' and head's tensors as the kernels take them (None: as they are)."""


DEFAULT = LeanKernels("default", linear_product, _fused_norm, _attend, F.silu, in_place=0, packs=True,
                      prepare=None)  # fmt: skip
"""Fused norms, packed products, the cache attended beside the new key."""

EXACT = LeanKernels("exact", exact.product, _hf_norm, _attend_exact, exact.silu, in_place=1, packs=False,
                    prepare=exact_weights)  # fmt: skip
"""The trainer's forward's arithmetic, bit for bit (`rlcore.models.exact`)."""

LEAN_KERNELS: dict[exact.KernelMode, LeanKernels] = {exact.DEFAULT_MODE: DEFAULT, exact.EXACT_MODE: EXACT}
"""A model's kernel mode -> the lean step's arithmetic."""
