"""A lean decode step for the Llama family: one token per row in plain torch over the module's own weights.

    decoder = lean_decoder(model, mode=kernel_mode(model))  # None for an architecture it does not cover
    state = decoder.start(cache, prompt_mask, positions, repeats, max_tokens)   # after an HF prefill
    logits = state.step(tokens)           # (a,) -> (a, v); the KV cache grows by one position
    state.select(keep)                    # drop finished rows

Why: a Hugging Face decode step is ~30 module calls per layer plus mask and cache bookkeeping rebuilt
every step; with few live rows (the long tail of a rollout) that overhead is all the step costs. This
step is the same arithmetic with nothing around it:
- the weights are the module's own tensors, read when `start` is called, so an optimizer step or a
  load between calls is seen (a load between steps restarts the decoding: the engine prefills the
  prompts and the tokens so far again, with the new weights);
- the KV cache is one preallocated tensor `(layers, 2, rows, kv_heads, capacity, head_dim)`; a step
  attends over the cached positions plus the new token's own key (a softmax over both), then writes
  every layer's new key and value in one copy;
- positions and the padding mask are built once: the rotary cos/sin table comes from the model's own
  `rotary_emb` at positions 0..capacity-1 and is indexed by each row's position; prompt padding is an
  additive -inf bias over the cached positions, response positions are always visible;
- the step function is pure (`lean_step`: weights and tensors in, logits and new keys out), so
  `torch.compile` can take it whole (`compile=True`: CPU inductor, dynamic rows and length);
- on CPU (uncompiled) `start` packs each projection's weight and the head into oneDNN's blocked
  layout once per `generate` (`pack_weights`): MKL's sgemm repacks the weight at every call, which
  at a few dozen rows costs more than the product (SmolLM2-135M, 29 rows: 143 ms of matmuls per step
  with MKL, 52 ms packed; the packing, ~0.3 s per call, is a copy of the projections, freed with the
  state). q, k and v are packed as one weight, and gate and up as one (unless a LoRA adapter sits on
  them): 4 products per layer instead of 7. A packed product runs on a bucketed row count
  (`row_bucket`), so oneDNN's per-shape primitive caches stay small. The packed products are float32
  (bf16 for bf16 weights) with another summation order: logits within 1e-5 of the Hugging Face
  forward's as before.

Covered: `rlcore.rollout.native.lean_cover` (`unsupported` says why not; `lean_decoder` then returns None and
the engine keeps the Hugging Face step). The logits equal the Hugging Face forward's to float32
rounding (tests/test_lean_decode.py: <= 1e-5 at every step).

In exact mode (`rlcore.models.exact`) the step runs the trainer's arithmetic instead: `exact.product` for
every product (q/k/v and gate/up fused only where that is checked to give the unfused bits), the Hugging
Face RMSNorm, `exact.attend` over the cache, `exact.silu`, and a MoE block inside `exact.under_kernels`,
so its logits are the trainer's bit for bit (`LeanShape.kernels`: `EXACT`).

A mixture of experts' MoE layers call their router module (its hooks fire as in the Hugging Face step, so
recorded routes work unchanged), then, packed, run each hit expert's two products on oneDNN-packed copies
(`rlcore.rollout.native.lean_moe`); a block it does not cover (a shared expert, adapters on the experts) and the
unpacked step run the block's own forward on the step's rows. Measured: experiments/README.md, "The MoE
decode step".

The step's arithmetic (`DEFAULT`, `EXACT`, `LeanShape`) lives in `rlcore.rollout.native.lean_kernels`, and how the
module's tensors are read and laid out for it (`pack_weights`, exact mode's fusing) in
`rlcore.rollout.native.lean_weights`; the names callers use are re-exported here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlcore.models import exact
from rlcore.models.onednn import can_pack
from rlcore.rollout.native.lean_cover import LAYER_FIELDS, Layer, sparse_block, unsupported
from rlcore.rollout.native.lean_kernels import (
    DEFAULT,
    EXACT,
    LEAN_KERNELS,
    LeanKernels,
    LeanShape,
    row_bucket,
)
from rlcore.rollout.native.lean_kernels import linear_product as _product
from rlcore.rollout.native.lean_moe import PackedExperts, experts_mlp
from rlcore.rollout.native.lean_weights import layer_tensors, pack_weights

__all__ = [
    "DEFAULT",
    "EXACT",
    "LEAN_KERNELS",
    "LeanDecoder",
    "LeanKernels",
    "LeanShape",
    "LeanState",
    "_product",
    "can_pack",
    "lean_decoder",
    "lean_step",
    "pack_weights",
    "row_bucket",
    "unsupported",
]


def lean_decoder(
    model: torch.nn.Module, *, mode: exact.KernelMode = exact.DEFAULT_MODE, compile: bool = False, pack: bool = True
) -> LeanDecoder | None:
    """The lean decoder of `model`, or None when `unsupported(model)` says why not (or when `compile` is
    asked of a mixture of experts, whose sparse blocks are modules with hooks: the engine then compiles
    the Hugging Face module)."""
    if unsupported(model, mode) is not None or (compile and any(map(sparse_block, model.model.layers))):
        return None
    return LeanDecoder(model, mode=mode, compile=compile, pack=pack)


def _shape(model: torch.nn.Module, mode: exact.KernelMode) -> LeanShape:
    attn = model.model.layers[0].self_attn
    config = model.config
    dense = [layer.mlp for layer in model.model.layers if sparse_block(layer) is None]
    act = dense[0].act_fn if dense else torch.nn.SiLU()  # (no dense MLP: unused)
    q_norm = getattr(attn, "q_norm", None)
    kernels = LEAN_KERNELS[mode]  # the kernel mode, as the step's arithmetic
    return LeanShape(
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        scaling=float(attn.scaling),
        eps=float(config.rms_norm_eps),
        qk_eps=None if q_norm is None else float(q_norm.variance_epsilon),
        act=_activation(act, kernels),
        kernels=kernels,
    )


def _activation(act: Callable[[Tensor], Tensor], kernels: LeanKernels) -> Callable[[Tensor], Tensor]:
    """The MLP's activation as a function: SiLU (torch's or transformers' module) as the kernels' SiLU
    (exact mode's is what the trainer's forward runs); another activation as its module."""
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return kernels.silu
    return act


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_step(
    shape: LeanShape,
    embed: Tensor,
    layers: tuple[Layer, ...],
    norm: Tensor,
    head: Tensor,
    tokens: Tensor,
    rope: Tensor,
    bias: Tensor,
    kv: Tensor,
) -> tuple[Tensor, Tensor]:
    """One decode step: (logits (a, v), new keys and values (layers, 2, a, kv_heads, head_dim)).

    tokens (a,) long: the token fed to each row; rope (a, 2, head_dim): cos and sin at each row's
    position; bias (a, L): 0 or -inf over the L cached positions (prompt padding); kv (layers, 2, a,
    kv_heads, L, head_dim): the cache. Pure: nothing is written (exact mode: L includes the new
    position, which each layer writes before it attends).
    """
    x = F.embedding(tokens, embed)  # (a, width)
    cos, sin = rope[:, None, 0], rope[:, None, 1]  # (a, 1, d)
    news = []
    for i, layer in enumerate(layers):
        x, new = _layer_step(shape, layer, x, cos, sin, bias, kv[i, 0], kv[i, 1])
        news.append(new)  # (2, a, kv_heads, d)
    x = _norm(shape, x, norm)
    return shape.kernels.product(x, head, None), torch.stack(news)


def _layer_step(
    shape: LeanShape, layer: Layer, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, keys: Tensor,
    values: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One decoder layer over x (a, width) and its cached `keys`, `values` (a, kv_heads, L, d): (its output
    (a, width), the new token's key and value (2, a, kv_heads, d))."""
    n1, wq, bq, wk, bk, wv, bv, qn, kn, wo, bo, n2, wg, bg, wu, bu, wd, bd = layer[: len(LAYER_FIELDS)]
    lq, lk, lv, lo, lg, lu, ld, sparse = layer[len(LAYER_FIELDS) :]
    prod = shape.kernels.product
    h = _norm(shape, x, n1)
    q, k, v = _rotated_qkv(shape, h, (wq, bq, wk, bk, wv, bv), (lq, lk, lv), (qn, kn), (cos, sin))
    x = x + _linear(shape.kernels.attend(shape, q, k, v, keys, values, bias), wo, bo, lo, prod)
    h = _norm(shape, x, n2)
    if isinstance(sparse, PackedExperts):  # a MoE layer: its router module, packed experts
        x = x + experts_mlp(sparse, h, _product)
    elif sparse is not None:  # a MoE layer: its own sparse block, on (a, 1, width)
        x = x + sparse(h[:, None])[:, 0]
    else:
        x = x + _dense_mlp(shape, h, wg, bg, wu, bu, wd, bd, (lg, lu, ld))
    return x, torch.stack((k, v))


def _rotated_qkv(
    shape: LeanShape, h: Tensor, weights: tuple[Any, ...], loras: tuple[Any, Any, Any], norms: tuple[Any, Any],
    rope: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """q (a, heads, d), k and v (a, kv_heads, d) of the normed input h (a, width): projected (fused into one
    weight when k's is None, pack_weights), q and k normed per head where the model has such norms (Qwen3),
    then rotated by `rope` (cos, sin) at each row's position."""
    (wq, bq, wk, bk, wv, bv), (lq, lk, lv), (qn, kn), (cos, sin) = weights, loras, norms, rope
    a, prod = h.shape[0], shape.kernels.product
    if wk is None:  # q, k and v fused into one weight (pack_weights)
        q, k, v = _linear(h, wq, bq, lq, prod).split(shape.qkv_widths, dim=-1)
    else:
        q, k, v = _linear(h, wq, bq, lq, prod), _linear(h, wk, bk, lk, prod), _linear(h, wv, bv, lv, prod)
    q = q.view(a, shape.heads, shape.head_dim)
    k, v = (t.view(a, shape.kv_heads, shape.head_dim) for t in (k, v))
    if qn is not None and kn is not None and shape.qk_eps is not None:
        q, k = _norm(shape, q, qn, shape.qk_eps), _norm(shape, k, kn, shape.qk_eps)
    qk = torch.cat((q, k), dim=1)  # (a, heads + kv_heads, d)
    qk = qk * cos + _rotate_half(qk) * sin
    return qk[:, : shape.heads], qk[:, shape.heads :], v


def _norm(shape: LeanShape, x: Tensor, weight: Tensor, eps: float | None = None) -> Tensor:
    """RMSNorm over the last dimension by the kernels' norm (`eps`: the layer norm's, `shape.eps`, unless given)."""
    return shape.kernels.norm(x, weight, shape.eps if eps is None else eps)


def _dense_mlp(shape: LeanShape, h: Tensor, wg: Tensor, bg: Any, wu: Any, bu: Any, wd: Tensor, bd: Any,
               loras: tuple[Any, Any, Any]) -> Tensor:  # fmt: skip
    """down(act(gate h) * up h); gate and up fused into one weight when `wu` is None (pack_weights)."""
    lg, lu, ld = loras
    prod = shape.kernels.product
    if wu is None:
        gate, up = _linear(h, wg, bg, lg, prod).chunk(2, dim=-1)
    else:
        gate, up = _linear(h, wg, bg, lg, prod), _linear(h, wu, bu, lu, prod)
    return _linear(shape.act(gate) * up, wd, bd, ld, prod)


def _linear(
    x: Tensor, w: Tensor, b: Tensor | None, lora: tuple[Tensor, Tensor, float] | None,
    product: Callable[[Tensor, Tensor, Tensor | None], Tensor] = _product,
) -> Tensor:  # fmt: skip
    """x W^T + b by `product` (W plain or oneDNN-packed), plus a LoRA adapter's scale (x A^T) B^T (peft's
    order) by F.linear (exact mode has no adapters here: `lean_cover.unsupported`)."""
    y = product(x, w, b)
    if lora is None:
        return y
    a, b_, scale = lora
    return y + F.linear(F.linear(x, a), b_) * scale


class LeanDecoder:
    """The lean step bound to one model (its tensors are read at each `start`)."""

    def __init__(
        self, model: torch.nn.Module, *, mode: exact.KernelMode = exact.DEFAULT_MODE, compile: bool = False,
        pack: bool = True,
    ) -> None:
        """`mode`: the model's kernel mode (`rlcore.models.exact.kernel_mode`), as the step's arithmetic
        (`LEAN_KERNELS`); `pack`: pack the weights at each `start` where `can_pack` (never when compiled)."""
        self.model = model
        self.mode = mode
        self.shape = _shape(model, mode)
        self.compiled = compile
        self.pack = pack and not compile and self.shape.kernels.packs
        self.step_fn: Callable[..., tuple[Tensor, Tensor]] = (
            torch.compile(lean_step, dynamic=True) if compile else lean_step
        )

    def start(
        self, cache: Any, prompt_mask: Tensor, positions: Tensor, repeats: int, max_tokens: int
    ) -> LeanState:
        """The decoding state after an HF prefill into `cache` (layers holding `key_buffer`/`value_buffer`
        of the b prompts, `length` positions): each prompt's rows repeated `repeats` times.

        prompt_mask (b, p) 0/1; positions (b, 1): each prompt's next position."""
        p, b = cache.layers[0].length, cache.layers[0].key_buffer.shape[0]
        kv = self._prefilled_kv(cache.layers, repeats, max_tokens)  # (frees the prefill's buffers)
        bias = torch.zeros((b, p + max_tokens), dtype=kv.dtype, device=kv.device)
        bias[:, :p].masked_fill_(prompt_mask == 0, float("-inf"))
        top = int(positions.max()) + max_tokens + 1
        table = self._rope_table(top, kv)  # (top, 2, d)
        return LeanState(
            self,
            self.weights(),
            kv,
            bias.repeat_interleave(repeats, dim=0).clone(),  # its own 2-D storage, as after `select`
            positions.reshape(-1).repeat_interleave(repeats),
            table,
            p,
        )

    def _prefilled_kv(self, layers: list[Any], repeats: int, max_tokens: int) -> Tensor:
        """The KV cache (layers, 2, b * repeats, kv_heads, p + max_tokens, d) holding the prefill's p positions
        of each prompt, repeated `repeats` times; the prefill's buffers are freed."""
        p = layers[0].length
        b, kvh, _, d = layers[0].key_buffer.shape
        kv = self.cache(layers[0].key_buffer, len(layers), b * repeats, (kvh, p + max_tokens, d))
        for i, layer in enumerate(layers):
            for j, buffer in enumerate((layer.key_buffer, layer.value_buffer)):
                kv[i, j, :, :, :p] = buffer[:, :, :p].repeat_interleave(repeats, dim=0)
            layer.reset()  # free the prefill's buffers
        return kv

    def weights(self) -> tuple[Any, ...]:
        """(embedding, layers, final norm, head): the module's tensors now, packed where `pack` says."""
        base = self.model.model
        layers, head = tuple(layer_tensors(layer) for layer in base.layers), self.model.lm_head.weight
        if self.shape.kernels.prepare is not None:  # exact: the trainer's kernels, per projection
            layers, head = self.shape.kernels.prepare(layers, head)
            return base.embed_tokens.weight, layers, base.norm.weight, head
        if self.pack and can_pack(head):
            layers, head = pack_weights(layers, head)
        return base.embed_tokens.weight, layers, base.norm.weight, head

    def cache(self, like: Tensor, layers: int, rows: int, tail: tuple[int, ...] | torch.Size) -> Tensor:
        """An uninitialised KV cache (layers, 2, rows, *tail). Compiled (dynamic shapes), it is laid out so
        that the step does not compile again once finished rows are dropped in place: rows outermost, so
        its strides do not depend on the row count, with one spare row, so its storage's row count never
        equals the batch's (which dynamo would assume for every later call). Eager, it is contiguous (the
        rows-outer layout measured ~10% slower there: bench_rollout longtail, 2-core EPYC)."""
        if not self.compiled:
            return like.new_empty((layers, 2, rows, *tail))
        return like.new_empty((rows + 1, layers, 2, *tail)).permute(1, 2, 0, 3, 4, 5)[:, :, :rows]

    def _rope_table(self, top: int, like: Tensor) -> Tensor:
        """(top, 2, d): the model's rotary cos and sin at positions 0..top-1."""
        positions = torch.arange(top, device=like.device)[None]  # (1, top)
        cos, sin = self.model.model.rotary_emb(like, position_ids=positions)  # (1, top, d) each
        return torch.stack((cos[0], sin[0]), dim=1)


class LeanState:
    """One `generate` call's decoding state: the KV cache, padding bias, positions and length."""

    def __init__(
        self,
        decoder: LeanDecoder,
        weights: tuple[Any, ...],
        kv: Tensor,
        bias: Tensor,
        positions: Tensor,
        table: Tensor,
        length: int,
    ) -> None:
        self.decoder, self.weights = decoder, weights
        self.kv, self.bias, self.positions, self.table, self.length = kv, bias, positions, table, length

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` (a,) at each row's next position: the logits (a, v) of the token after it."""
        n, own = self.length, self.decoder.shape.kernels.in_place  # 1: the new position is attended in place
        logits, new = self.decoder.step_fn(
            self.decoder.shape,
            *self.weights,
            tokens.clone(),  # never a view: a compiled step guards on a view's base (a second compile)
            self.table[self.positions],
            self.bias[:, : n + own],
            self.kv[:, :, :, :, : n + own],
        )
        self.kv[:, :, :, :, n] = new
        self.length, self.positions = n + 1, self.positions + 1
        return logits

    def select(self, keep: Tensor) -> None:
        """Keep rows `keep` (a') of the batch. Ascending rows (the engine's) move down in place, the filled
        positions only: no new cache, whose fresh pages cost more than the copy; others are gathered."""
        n, rows = self.length, keep.tolist()
        if any(later <= earlier for earlier, later in itertools.pairwise(rows)):
            kv = self.decoder.cache(self.kv, self.kv.shape[0], len(rows), self.kv.shape[3:])
            kv[:, :, :, :, :n] = self.kv[:, :, keep, :, :n]
        else:  # row j <- row r >= j, in increasing j: no source is overwritten before it is read
            for j, r in enumerate(rows):
                if r != j:
                    self.kv[:, :, j, :, :n] = self.kv[:, :, r, :, :n]
            kv = self.kv[:, :, : len(rows)]
        self.kv, self.bias, self.positions = kv, self.bias[keep], self.positions[keep]
