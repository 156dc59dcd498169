"""Model-side passes over rolled-out batches: micro-batching, trimming, log-probs and entropies.

    old, ent = compute_logprobs(model, batch, temperature=1.0, max_tokens=8192, with_entropy=True)
    for micro, rows in micro_batches(batch, max_tokens=8192):   # the update's gradient pass
        inputs = model_inputs(model, micro, share_prompts=True)  # plain rows, or one row per prompt
        logits = response_logits(model, inputs)                 # (m, r, v), model dtype
        logprob = token_logprobs(logits, inputs.labels)          # (m, r) float32

A rolled-out batch (see `rlcore.rollout.base`) holds the left-padded prompt (`input_ids`,
`attention_mask`) and the right-padded response (`responses`, `response_attention`,
`response_mask`). The model reads `[prompt | response]` with attention `attention_mask ++
response_attention` and position ids `cumsum(attention) - 1` clamped at 0 (verl's convention).

Padding removal is by trimming: a micro-batch keeps only the prompt columns and response columns
some row of it uses (left-padded prompts lose their leading all-pad columns, responses their
trailing ones), and the model computes logits only for the response positions (`logits_to_keep`).
With token-budget dynamic batching (`max_tokens`), rows are sorted by length (a prompt's samples
kept together) and packed greedily so that rows x trimmed width stays within the budget; outputs are written back through the row
indices, so the caller sees the original order. Packed varlen sequences (flash-attention) are not
implemented: trimming works with every attention implementation, CPU included.

Shared prompts (`share_prompts`, see `rlcore.models.shared_prompt`): where the rows of a micro-batch
repeat a prompt (GRPO's n samples), the forward can run bin-packed rows of [prompt | its responses]
blocks, each prompt computed once per packed row that holds its responses, with a 4D mask (sdpa or
eager attention); `response_logits` gathers each row's logits back, so callers see (m, r, v) either
way.

Exact mode (`rlcore.models.exact`): the prompt part is laid out in whole blocks of `exact.BLOCK` columns
(left-padded as the engine pads it) and packed segments start on a block, so that a sequence's log-probs
are the engine's bit for bit in any micro-batch and either layout.

Memory: logits exist for one micro-batch at a time, in the model's dtype, response positions only
in the row layout and every position of the packed rows (their prompt copies too; both bounded by
the token budget: budget x vocab); log-probs and entropies never make a second full
float32 (m, r, v) copy: `rlcore.pure.token_logprobs` and `token_entropy` work on position chunks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlcore.batch import Batch
from rlcore.columns import cut_columns
from rlcore.data.vision import response_rope_positions
from rlcore.dist.attention import CUSTOM_MASK, attention_of
from rlcore.dist.fsdp import model_mesh
from rlcore.dist.reduce import all_reduce_int
from rlcore.dist.tp import vocab_group, vocab_parallel_entropy, vocab_parallel_logprobs
from rlcore.dist.ulysses import sp_group
from rlcore.models.exact import EXACT_ATTENTION, KernelMode, align_prompts, kernel_mode
from rlcore.models.fields import (  # noqa: F401  (SEQUENCE_FIELDS, ROUTE_FIELDS...: imported from here)
    RESPONSE_ROPE_FIELD,
    ROPE_FIELD,
    ROUTE_FIELDS,
    SEQUENCE_FIELDS,
    VISION_FIELD,
    model_fields,
    require_vision,
    takes_images,
)
from rlcore.models.layouts import Layout, adapted, layout_of
from rlcore.models.moe import router_tap
from rlcore.models.shared_prompt import aligned, choose_plan, pack_plan, prompt_groups, worth_packing
from rlcore.models.vision import Images, images_of, placeholder_ids, suppress
from rlcore.pure.logprobs import token_logprobs
from rlcore.pure.losses import entropy as _entropy

_CHUNK_BYTES = 64 * 2**20  # float32 logits per entropy chunk

@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelInputs:
    """Trimmed model inputs of one micro-batch (m rows, s = p' + r columns), plain or prompt-packed."""

    input_ids: Tensor
    """(m, s) long: trimmed prompt followed by the trimmed response; packed: (G, L), one row per prompt."""
    attention_mask: Tensor
    """(m, s) long: 1 on real tokens; packed: (G, 1, L, L) bool, True where a query may see a key."""
    position_ids: Tensor
    """(m, s) long: cumsum(attention_mask) - 1, clamped at 0; packed: (G, L), restarting per response;
    a vision-language model's (3, m, s) M-RoPE positions (`rlcore.data.vision`)."""
    labels: Tensor
    """(m, r) long: the response tokens whose log-probs the last r + 1 logits predict."""
    gather: Tensor | None = None
    """Packed only: (m, r) indices into the flattened kept logits, the position predicting each token."""
    keep: int = 0
    """Packed only: `logits_to_keep` of the packed forward."""
    token_kind: Tensor | None = None
    """(tokens,) int8, `input_ids` flattened row by row: 0 padding, 1 prompt, 2 response."""
    routes: Tensor | None = None
    """(tokens, L, k) long, like `token_kind`: the experts the rollout routed each token to (-1: none
    recorded), from the batch's `prompt_routes` / `response_routes` (`rlcore.models.moe`); None
    without them."""
    vision: Images | None = None
    """The rows' images (`vision_inputs`), or None."""

    @property
    def packed(self) -> bool:
        """Whether these are prompt-packed inputs (`rlcore.models.layouts.Packed`), else rows."""
        return self.gather is not None


def _row_lengths(batch: Batch) -> tuple[Tensor, Tensor]:
    """(prompt tokens, response width) per row, on CPU: real prompt tokens, last used response column + 1."""
    prompt = batch["attention_mask"].detach().to("cpu", torch.long).sum(dim=-1)  # (b,)
    used = batch["response_attention"].detach().to("cpu") != 0  # (b, t)
    cols = torch.arange(1, used.shape[1] + 1)  # (t,)
    response = torch.where(used, cols, 0).amax(dim=-1) if used.shape[1] else torch.zeros_like(prompt)
    return prompt, response  # (b,), (b,)


@dataclasses.dataclass(frozen=True)
class _Trimmed:
    """A micro-batch's sequence tensors cut to the columns some row uses."""

    ids_p: Tensor  # (m, p') prompt ids
    attn_p: Tensor  # (m, p') prompt attention
    responses: Tensor  # (m, r)
    attn_r: Tensor  # (m, r) response attention
    routes: tuple[Tensor, Tensor] | None  # recorded routes (prompt, response), or None
    rope: Tensor | None  # (m, 3, p') the prompt's M-RoPE positions (a vision-language model), or None
    response_rope: Tensor | None = None  # (m, 3, r) the response's, where it holds images, or None


def _trimmed(batch: Batch, *, align: int = 1, vision: bool = False) -> _Trimmed:
    """The batch's prompt, response, recorded routes and (`vision`) M-RoPE positions, cut to the columns some
    row uses; the prompt part left-padded or cut to a multiple of `align` columns (a kernel mode's,
    `KernelMode.align`)."""
    batch = align_prompts(batch, align)
    attn_p = batch["attention_mask"].long()  # (m, p)
    attn_r = batch["response_attention"].long()  # (m, t)
    prompt_used = attn_p.any(dim=0)  # (p,)
    first = int(torch.argmax(prompt_used.int()).item()) if bool(prompt_used.any()) else attn_p.shape[1] - 1
    first = (first // align) * align  # whole blocks of prompt columns (`align_prompts` made the width a multiple)
    response_used = attn_r.any(dim=0)  # (t,)
    width = int(response_used.nonzero().max().item()) + 1 if bool(response_used.any()) else 0
    cut = cut_columns(batch, first, width)  # every per-token field, as the batch schema lays it out
    routes = (cut[ROUTE_FIELDS[0]], cut[ROUTE_FIELDS[1]]) if ROUTE_FIELDS[0] in cut else None
    rope = cut[ROPE_FIELD] if vision else None
    response_rope = cut[RESPONSE_ROPE_FIELD] if vision and RESPONSE_ROPE_FIELD in cut else None
    return _Trimmed(cut["input_ids"], attn_p[:, first:], cut["responses"], attn_r[:, :width], routes, rope,
                    response_rope)  # fmt: skip


def sequence_tensors(batch: Batch, *, vision: bool = False) -> ModelInputs:
    """Model inputs for `batch`'s rows, trimmed to the columns some row uses (see the module docstring);
    `vision`: a vision-language model's (`takes_images`), with the rows' images and M-RoPE positions."""
    return _row_inputs(_trimmed(batch, vision=vision), vision_inputs(batch) if vision else None)


def vision_inputs(batch: Batch) -> Images | None:
    """A vision-language batch's images as one forward takes them (`rlcore.models.vision.Images`: each
    distinct image once, in the order of their placeholder runs), or None where no row has one."""
    return images_of(batch[VISION_FIELD])


def _row_inputs(t: _Trimmed, vision: Images | None = None) -> ModelInputs:
    input_ids = torch.cat([t.ids_p, t.responses], dim=1)  # (m, s)
    attention = torch.cat([t.attn_p, t.attn_r], dim=1)  # (m, s)
    position_ids = (attention.cumsum(dim=-1) - 1).clamp(min=0)  # (m, s)
    if t.rope is not None:  # M-RoPE: the prompt's own, the response's continuing as text
        response = t.response_rope
        if response is None:
            response = response_rope_positions(t.rope, t.attn_p, position_ids[:, t.ids_p.shape[1] :])
        position_ids = torch.cat([t.rope, response], dim=2).transpose(0, 1)  # (3, m, s)
    return ModelInputs(
        input_ids=input_ids, attention_mask=attention, position_ids=position_ids, labels=t.responses,
        token_kind=_kinds(t.attn_p, t.attn_r).reshape(-1), routes=_row_routes(t.routes), vision=vision,
    )  # fmt: skip


def _kinds(attn_p: Tensor, attn_r: Tensor) -> Tensor:
    """(m, s) int8: 0 padding, 1 prompt, 2 response."""
    return torch.cat([(attn_p != 0).to(torch.int8), (attn_r != 0).to(torch.int8) * 2], dim=1)


def _row_routes(routes: tuple[Tensor, Tensor] | None) -> Tensor | None:
    """(m * s, L, k) long: the prompt's and the response's recorded routes, row by row."""
    if routes is None:
        return None
    rows = torch.cat(routes, dim=1).long()  # (m, s, L, k)
    return rows.reshape(-1, *rows.shape[2:])


def _packable_hidden(model: nn.Module) -> int | None:
    """The hidden size when `model` takes a custom 4D mask (sdpa or eager attention), else None."""
    config = getattr(model, "config", None)
    if attention_of(config) not in (*CUSTOM_MASK, EXACT_ATTENTION):
        return None
    return getattr(config, "hidden_size", None)


def _window(model: nn.Module) -> float:
    """The longest packed row `model` can take: a custom mask replaces its sliding-window or chunked
    attention mask, which is the same only while every query-key distance stays inside the window."""
    config = model.config
    limits = [getattr(config, k, None) for k in ("sliding_window", "attention_chunk_size")]
    return min([v for v in limits if isinstance(v, int) and v > 0], default=float("inf"))


def model_inputs(
    model: nn.Module, batch: Batch, *, share_prompts: bool = True, mode: KernelMode | None = None
) -> ModelInputs:
    """`sequence_tensors(batch)`, or with `share_prompts` the prompt-packed inputs where they are cheaper,
    laid out for the kernel `mode` (default: `kernel_mode(model)`; exact mode's prompts end on a block).

    Packing applies when some prompt repeats in `batch`, the model takes a 4D mask (and is not
    sequence-parallel: `rlcore.dist.ulysses` attends without a mask), the packed rows
    fit its sliding window (if any), and `shared_prompt.worth_packing` says so; the log-probs are the
    same either way (to rounding).
    """
    align = (kernel_mode(model) if mode is None else mode).align  # where prompts end and responses start
    hidden = _packable_hidden(model) if share_prompts and sp_group(model) is None else None
    vision = takes_images(model)
    if vision:
        require_vision(batch, model)
    t = _trimmed(batch, align=align, vision=vision)
    if vision:  # a vision-language model: rows (packing images is not measured yet)
        return _row_inputs(t, vision_inputs(batch))
    ids_p, attn_p, attn_r = t.ids_p, t.attn_p, t.attn_r
    left_padded = bool((attn_p[:, 1:] >= attn_p[:, :-1]).all()) and bool(attn_p[:, -1].all())
    if hidden is not None and len(batch) > 1 and left_padded:
        group = prompt_groups(ids_p, attn_p)
        if int(group.max()) + 1 < len(batch):
            prompt_len = [aligned(n, align) for n in attn_p.sum(dim=1).tolist()]
            response_len = [aligned(n, align) for n in attn_r.sum(dim=1).tolist()]
            plan, width = choose_plan(prompt_len, response_len, group.tolist(), hidden)
            row_width = ids_p.shape[1] + attn_r.shape[1]
            if width <= _window(model) and worth_packing(len(batch), row_width, len(plan), width, hidden):
                return _packed_inputs(t, plan, width, align)
    return _row_inputs(t)


def _packed_inputs(t: _Trimmed, plan: list, width: int, align: int = 1) -> ModelInputs:
    """The prompt-packed inputs of `plan` (`shared_prompt.pack_plan`). Each packed column's source,
    a flat index into the row layout [prompt | response], is packed as if it were a token id (+ 1:
    padding packs as 0), so the tokens, their kinds and their routes follow the same layout."""
    ids_p, attn_p, responses, attn_r, routes = t.ids_p, t.attn_p, t.responses, t.attn_r, t.routes
    m, p = ids_p.shape
    index = torch.arange(1, m * (p + responses.shape[1]) + 1, device=ids_p.device).view(m, -1)
    source, allowed, pos, gather = pack_plan(index[:, :p], attn_p, index[:, p:], attn_r, plan, width, align)
    source = source - 1  # (G, L): -1 at padding
    real, at = source >= 0, source.clamp(min=0)
    ids = torch.where(real, torch.cat([ids_p, responses], dim=1).reshape(-1)[at], 0)
    kind = torch.where(real, _kinds(attn_p, attn_r).reshape(-1)[at], 0).to(torch.int8)
    packed_routes = None
    if routes is not None:
        row_routes = _row_routes(routes)  # (m * s, L, k)
        packed_routes = torch.where(real.reshape(-1, 1, 1), row_routes[at.reshape(-1)], -1)
    return ModelInputs(
        input_ids=ids, attention_mask=allowed, position_ids=pos, labels=responses, gather=gather,
        keep=width, token_kind=kind.reshape(-1), routes=packed_routes,
    )  # fmt: skip


def response_logits(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """Logits predicting each response token: (m, r, v) in the model's output dtype. A mixture of
    experts routes by `inputs.routes` when given (`rlcore.models.moe`), until its next forward."""
    layout = layout_of(model, inputs)
    return layout.per_token(_logits(model, layout), lambda z, _labels: z)


def _logits(model: nn.Module, layout: Layout) -> Tensor:
    """One forward of `model` in `layout`, its adapters entered: (rows, kept positions, v) logits, a
    vision-language model's placeholders suppressed."""
    feed = layout.feed(model)
    with adapted(model, layout) as extra:
        out = model(input_ids=feed.input_ids, attention_mask=feed.attention_mask, position_ids=feed.position_ids,
                    use_cache=False, logits_to_keep=feed.keep, **extra)  # fmt: skip
    return _suppressed(model, out.logits)


def response_logprobs(
    model: nn.Module,
    inputs: ModelInputs,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `inputs.labels` (m, r) float32, with grad when enabled, and with `entropy` the
    entropies (m, r) (differentiable only with `entropy_grad`), in the layout `layout_of` picks
    (`rlcore.models.layouts`: rows, prompt-packed, or a sequence-parallel model's own columns)."""
    layout = layout_of(model, inputs)
    logits = _logits(model, layout)  # (m, kept, v), or (m, kept, v / tp) split by vocabulary
    logprob = layout.per_token(logits, lambda z, labels: _logprobs(model, z, labels, temperature))  # (m, r)
    if not entropy:
        return logprob, None
    return logprob, layout.per_token(logits, lambda z, _labels: _entropies(model, z, temperature, entropy_grad))


def _suppressed(model: nn.Module, logits: Tensor) -> Tensor:
    """`logits` with a vision-language model's placeholder tokens suppressed (`placeholder_ids`), in place."""
    banned = placeholder_ids(model)
    return suppress(logits, torch.tensor(banned)) if banned else logits


def _logprobs(model: nn.Module, logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    vocab = vocab_group(model)
    if vocab is not None:  # tensor parallel: this rank's vocabulary shard of the logits
        return vocab_parallel_logprobs(logits, labels, vocab, temperature=temperature)
    return token_logprobs(logits, labels, temperature=temperature)


def _entropies(model: nn.Module, logits: Tensor, temperature: float, grad: bool) -> Tensor:
    vocab = vocab_group(model)
    if vocab is not None:
        if grad:
            return vocab_parallel_entropy(logits, vocab, temperature=temperature)
        with torch.no_grad():
            return vocab_parallel_entropy(logits.detach(), vocab, temperature=temperature)
    if grad:
        return token_entropy(logits, temperature=temperature)
    with torch.no_grad():
        return token_entropy(logits.detach(), temperature=temperature)


def _scaled_entropy(logits: Tensor, temperature: float) -> Tensor:
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # scale after the upcast (bf16 logits)
    return _entropy(z if temperature == 1.0 else z / temperature)


def token_entropy(logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, (m, r, v) -> (m, r) float32, chunk by chunk.

    At most `chunk_size` positions (default ~64 MiB of float32) are upcast at a time. With grad, each
    chunk is checkpointed: backward recomputes its softmax, so no chunk's float32 copy is kept.
    """
    v = max(1, logits.shape[-1])
    chunk = chunk_size or max(1, _CHUNK_BYTES // (4 * v))
    flat = logits.reshape(-1, logits.shape[-1])  # (m * r, v)
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for i in range(0, flat.shape[0], chunk):
        piece = flat[i : i + chunk]
        if grad:
            parts.append(checkpoint(_scaled_entropy, piece, temperature, use_reentrant=False))
        else:
            parts.append(_scaled_entropy(piece, temperature))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def _split_rows(rows: list[Tensor], count: int) -> list[Tensor]:
    """Halve the largest pieces until there are `count` pieces or none has two rows."""
    rows = list(rows)
    while len(rows) < count:
        biggest = max(range(len(rows)), key=lambda i: len(rows[i]))
        if len(rows[biggest]) < 2:
            break
        piece = rows.pop(biggest)
        half = (len(piece) + 1) // 2
        rows[biggest:biggest] = [piece[:half], piece[half:]]
    return rows


def _budget_order(prompt: Tensor, response: Tensor, group: Tensor) -> list[int]:
    """Rows by their prompt group's longest row (longest first), a group's rows together, longest first."""
    total = prompt + response  # (b,)
    longest = torch.zeros(int(group.max()) + 1, dtype=total.dtype).scatter_reduce(0, group, total, "amax")
    order = torch.argsort(total, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]
    return order[torch.argsort(longest[group[order]], descending=True, stable=True)].tolist()


def _token_budget_groups(prompt: Tensor, response: Tensor, group: Tensor, max_tokens: int) -> list[Tensor]:
    """Rows in `_budget_order`, packed while rows x (max prompt + max response) <= budget."""
    groups: list[list[int]] = []
    cur: list[int] = []
    max_p = max_r = 0
    for i in _budget_order(prompt, response, group):
        p, r = int(prompt[i]), int(response[i])
        new_p, new_r = max(max_p, p), max(max_r, r)
        if cur and (len(cur) + 1) * (new_p + new_r) > max_tokens:
            groups.append(cur)
            cur, new_p, new_r = [], p, r
        cur.append(i)
        max_p, max_r = new_p, new_r
    if cur:
        groups.append(cur)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def micro_batches(
    batch: Batch, *, micro_batch_size: int | None = None, max_tokens: int | None = None, min_count: int = 1
) -> list[tuple[Batch, Tensor]]:
    """Split `batch` into micro-batches: a list of (micro Batch, row indices into `batch`).

    `max_tokens` (token-budget dynamic batching, takes precedence): rows sorted by length, longest
    first, the samples of one prompt kept together (sorted by their longest, for shared-prompt
    packing), and packed greedily while rows x trimmed width (prompt + response columns) <= max_tokens;
    a row longer than the budget goes alone. Else `micro_batch_size` consecutive rows; else one piece.
    `min_count`: split the largest pieces until there are at least that many (all ranks must run as
    many passes under FSDP); if the rows run out, padding pieces follow: one copy of row 0 with
    `response_mask` zeroed and indices of length 0 — run them, drop their outputs.
    Results go back to the original order with `out[rows] = micro_out[: len(rows)]`.
    """
    n = len(batch)
    if n == 0:
        raise ValueError("micro_batches: the batch has no rows")
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
        group = prompt_groups(batch["input_ids"], batch["attention_mask"]).cpu()
        rows = _token_budget_groups(*_row_lengths(batch), group, max_tokens)
    elif micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        rows = list(torch.arange(n).split(micro_batch_size))
    else:
        rows = [torch.arange(n)]
    rows = _split_rows(rows, min_count)
    out = [(batch[r], r) for r in rows]
    if len(out) < min_count:
        pad = batch[:1]
        if "response_mask" in pad:
            pad = pad.with_(response_mask=torch.zeros_like(pad["response_mask"]), overwrite=True)
        out += [(pad, torch.zeros(0, dtype=torch.long))] * (min_count - len(out))
    return out


def aligned_micro_batches(
    batch: Batch, mesh, *, micro_batch_size: int | None = None, max_tokens: int | None = None
) -> list[tuple[Batch, Tensor]]:
    """`micro_batches` with the same count on every rank of `mesh` (the largest count; a collective)."""
    pieces = micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    count = all_reduce_int(len(pieces), mesh, op="max")
    if count == len(pieces):
        return pieces
    return micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, min_count=count)


@torch.no_grad()
def compute_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of `batch`'s responses under `model`: ((b, t) float32, (b, t) | None).

    Both are 0 where `response_mask` is 0, in the batch's row order. Runs without grad, micro-batched
    (`micro_batch_size` rows, or a `max_tokens` budget) and trimmed, each prompt computed once for
    its samples where that pays (`share_prompts`); under FSDP every rank of the model's mesh must call
    it (the micro-batch count is agreed with one collective).
    """
    work = batch.select(*model_fields(model, batch))
    mask = batch["response_mask"]
    b, t = mask.shape
    logprobs = torch.zeros(b, t, dtype=torch.float32, device=mask.device)
    entropies = torch.zeros(b, t, dtype=torch.float32, device=mask.device) if with_entropy else None
    pieces = aligned_micro_batches(
        work, model_mesh(model), micro_batch_size=micro_batch_size, max_tokens=max_tokens
    )
    mode = kernel_mode(model)  # once for the pass
    for micro, rows in pieces:
        inputs = model_inputs(model, micro, share_prompts=share_prompts, mode=mode)
        lp, ent = response_logprobs(model, inputs, temperature=temperature, entropy=with_entropy)  # (m, r)
        r, k = lp.shape[1], len(rows)
        rows = rows.to(mask.device)
        logprobs[rows, :r] = lp[:k].float()
        if entropies is not None:
            entropies[rows, :r] = ent[:k].float()
    tap = router_tap(model)
    if tap is not None:  # the replay ends with the pass (a later forward routes by its own routers)
        tap.set_replay(None)
    keep = mask != 0
    logprobs = torch.where(keep, logprobs, 0.0)
    if entropies is not None:
        entropies = torch.where(keep, entropies, 0.0)
    return logprobs, entropies
