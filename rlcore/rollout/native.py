"""The native engine: batched KV-cache sampling over a Hugging Face causal LM, on CPU or GPU.

    engine = NativeEngine(model, tokenizer)                    # shares `model` (no copy)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_tokens=64, temperature=1.0))

How it decodes (see `rlcore.rollout.base` for the fields it returns):
- the left-padded prompts are prefilled once each, in one forward pass that keeps only the last
  position's logits; the cache rows and logits are then repeated `n` times (as
  `Batch.repeat_interleave` repeats the rows, so a prompt's samples are consecutive, with its `uid`);
  every step feeds one token per row with `position_ids` continuing each row's own positions, so a
  sample sees exactly what a teacher-forced pass over prompt + response sees;
- the KV cache is preallocated for prompt + `max_tokens` positions (`PreallocatedLayer`, written in
  place instead of concatenated each step) when every layer is full attention; other models get
  `DynamicCache(config=...)`;
- for the Llama family (Llama, Qwen2, Qwen3, Mistral) the decode steps after the HF prefill are
  `rlcore.rollout.lean`'s plain-torch step over the module's own weights (one preallocated KV tensor,
  rotary table and padding bias built once; logits equal the HF forward's to fp32 rounding);
  `lean=False` keeps the HF step;
- a finished row (a stop token, a stop string, or `max_tokens`) stops costing compute: once more than
  `compact_fraction` of the batch has finished, the cache, mask and positions are indexed down to the
  live rows; the loop ends when none is live;
- tokens are drawn by `rlcore.rollout.sampling.sample_tokens` with the engine's own `torch.Generator`
  (or a fresh one seeded with `sampling.seed`), never the global RNG; their log-probs are float32
  log q under the processed distribution;
- stop strings are checked each step on the decoded tail of each live row (only as many tokens as the
  longest stop string has characters, plus one), in one `batch_decode` call.

Transformers compatibility: 5.16-5.19 name the cache argument `past_key_values`, 5.20+ `cache`; the
engine reads the forward signature once and passes the cache object it owns, so the output key does
not matter.

Sharing and weights: in a single process the engine runs the trainer's module itself (eval mode and
no_grad during `generate`, the module's mode restored after), so there is nothing to sync. Under FSDP
give it its own unsharded copy and call `load_weights` with the gathered full tensors after each
update: a sharded module cannot be used, since ranks decode different numbers of steps.
No KV cache outlives a `generate` call, so `sleep()` only has weights to free: with
`offload_on_sleep=True` on a GPU it moves the engine's own copy to CPU (never use it on a module the
trainer shares), and on CUDA it empties the allocator cache; `wake()` moves the weights back.

`compile=True` compiles the lean step (CPU inductor, dynamic rows and length: ~20-40 s once per
process, then 1.1-1.3x faster steps with 4-128 live rows; experiments/README.md, issue 17); for other
models it compiles the HF module. For GPUs: `kv_cache="static"` decodes with HF's `StaticCache` (HF
step) and full-length masks, so every decode step has the same shapes, and `compile=True,
compile_mode="reduce-overhead"` then runs it through `torch.compile` with CUDA graphs; neither has
been run on a GPU. On CPU the static cache gives the same outputs (tested).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache

from rlcore.batch import Batch
from rlcore.data.prompts import pad_token_id
from rlcore.models.exact import align_prompts, kernel_mode
from rlcore.models.families import covering
from rlcore.models.forward import ROPE_FIELD, VISION_FIELD, require_vision, takes_images, vision_inputs
from rlcore.models.moe import RouterTap, router_tap
from rlcore.models.vision import Images, feeding, placeholder_ids, suppress
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.lean import lean_decoder
from rlcore.rollout.lean_cover import full_attention_only
from rlcore.rollout.sampling import check_sampling, sample_tokens

_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer with room for `capacity` positions, written in place.

    `update` writes the new keys/values after the ones already held and returns views of the filled
    part, so a decode step copies one position instead of concatenating the whole cache.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.key_buffer = key_states.new_empty((b, h, self.capacity, dk))  # (b, h, c, d)
        self.value_buffer = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times (n samples after one prefill of each prompt)."""
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0] * repeats, *old.shape[1:]))
            new[:, :, : self.length] = old[:, :, : self.length].repeat_interleave(repeats, dim=0)
            setattr(self, name, new)
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep rows `indices` (copies only the filled positions into new buffers)."""
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((indices.shape[0], *old.shape[1:]))
            new[:, :, : self.length] = old[indices, :, : self.length]
            setattr(self, name, new)
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False
        self.keys = self.values = self.key_buffer = self.value_buffer = None


def _forward_keywords(model: torch.nn.Module) -> tuple[str, str | None]:
    """(the cache argument's name, the logits-to-keep argument's name or None) of `model.forward`."""
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    return cache_kw, keep_kw


def stop_token_ids(tokenizer: Any, model: torch.nn.Module, extra: Iterable[int] = ()) -> list[int]:
    """`extra` plus the tokenizer's EOS and the model's generation-config EOS ids (deduplicated, sorted)."""
    ids = set(extra)
    generation = getattr(model, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return sorted(ids)


class NativeEngine:
    """Batched KV-cache sampling over a Hugging Face causal LM (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        device: torch.device | str | None = None,
        generator_seed: int = 0,
        kv_cache: str = "auto",
        compact_fraction: float = 0.125,
        offload_on_sleep: bool = False,
        compile: bool = False,
        compile_mode: str | None = None,
        lean: bool = True,
        record_routes: bool = False,
    ) -> None:
        """`model` is used as is (shared). `device` defaults to the model's; if given, the model moves there.
        `kv_cache`: "auto" (preallocated when every layer is full attention, else HF DynamicCache),
        "dynamic" (HF DynamicCache), or "static" (HF StaticCache and fixed shapes for compile / CUDA
        graphs: no prefill sharing, finished rows stay in the batch).
        `compact_fraction`: drop finished rows from the batch once they are this share of it (0: at once).
        `offload_on_sleep`: move the weights to CPU in `sleep` (only for an engine owning its copy).
        `lean`: decode with `rlcore.rollout.lean` where it covers the model (Llama family, "auto" cache);
        `compile` then compiles the lean step, else the Hugging Face module.
        `record_routes`: a mixture of experts' batches carry the experts each token was routed to,
        `prompt_routes` (b*n, p, L, k) and `response_routes` (b*n, t, L, k) int16, -1 where no token
        was fed (padding, a row's last token) (`rlcore.models.moe`)."""
        if kv_cache not in ("auto", "dynamic", "static"):
            raise ValueError(f"kv_cache={kv_cache!r}: expected 'auto', 'dynamic' or 'static'")
        if not 0 <= compact_fraction <= 1:
            raise ValueError(f"compact_fraction={compact_fraction}: must be in [0, 1]")
        param = next(model.parameters(), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (param.device if param is not None else torch.device("cpu"))
        )
        if param is not None and param.device != self.device:
            model.to(self.device)
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.generator = torch.Generator(self.device).manual_seed(generator_seed)
        self.compact_fraction, self.offload_on_sleep = compact_fraction, offload_on_sleep
        self._cache_kw, self._keep_kw = _forward_keywords(model)
        self.kv_cache = kv_cache
        self._prealloc = kv_cache == "auto" and full_attention_only(getattr(model, "config", None))
        self._compacts = kv_cache != "static"  # a static cache keeps its shapes: finished rows stay
        self.mode = kernel_mode(model)  # the kernels it was made with (`make_exact` first, then the engine)
        self._lean = lean_decoder(model, mode=self.mode, compile=compile) if lean and self._prealloc else None
        self._step_fn = (
            torch.compile(model, mode=compile_mode, dynamic=kv_cache != "static")
            if compile and self._lean is None
            else model
        )
        self._vision = takes_images(model)  # its prompts carry images and M-RoPE positions (the family record)
        self._banned = torch.tensor(placeholder_ids(model), dtype=torch.long, device=self.device)
        self._tap = router_tap(model)  # a mixture of experts: generate routes by its own routers
        self._record = record_routes
        if record_routes and self._tap is None:
            raise ValueError(
                f"record_routes: {type(model).__name__} is not a mixture of experts rlcore covers "
                f"({covering('router-replay')})"
            )
        self._asleep = self._offloaded = False
        self._on_step: Callable[[Tensor], None] | None = None
        self._loads = 0  # `load_weights` calls so far: a load between decode steps restarts the decoding

    @property
    def module(self) -> torch.nn.Module:
        """The module it samples with (the trained one, colocated: pushes into it are no-ops)."""
        return self.model

    @property
    def adapters(self) -> None:
        """LoRA layers live in `module`: adapters arrive as weights."""
        return None

    @contextlib.contextmanager
    def each_step(self, hook: Callable[[Tensor], None]) -> Iterator[None]:
        """Within the block, `generate` calls `hook(sampled)` between decode steps, `sampled` (b*n,) long
        the tokens each output row has so far (j for every row once tokens 0..j-1 of every live row are
        sampled, before the forward that gives token j): a hook that loads new weights (`load_weights`)
        makes tokens j.. come from them (partial rollouts): the prompts and the tokens so far are then
        prefilled again with the new weights, so every later token, and its log-prob, is the new
        policy's exactly (the old KV would give neither version's)."""
        self._on_step = hook
        try:
            yield
        finally:
            self._on_step = None

    # -- protocol -------------------------------------------------------------------------------

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """`sampling.n` samples per prompt row, with the fields of `rlcore.rollout.base`."""
        if self._asleep:
            raise RuntimeError("NativeEngine.generate called while asleep; call wake() first")
        _check_params(sampling)
        if self._vision:
            require_vision(prompts, self.model)
        rows = prompts.repeat_interleave(sampling.n)
        out_device = prompts["input_ids"].device
        generator = self.generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        if self._tap is not None:
            self._tap.set_replay(None)  # whatever replay a trainer forward on this module left set
        if kernel_mode(self.model) is not self.mode:
            raise ValueError(f"the model runs {kernel_mode(self.model).name} kernels and this engine was made for "
                             f"{self.mode.name} ones: make the engine after make_exact")  # fmt: skip
        decoded = align_prompts(prompts, self.mode.align)  # exact: whole blocks
        routes = _RouteLog(self._tap, prompts, sampling, decoded["input_ids"].shape[1]) if self._record else None
        try:
            with torch.no_grad(), routes or contextlib.nullcontext():
                tokens, logprobs, lengths, reasons = self._decode(decoded, sampling, generator, routes)
        finally:
            self.model.train(was_training)
        t = int(lengths.max()) if lengths.numel() else 0
        mask = (torch.arange(t, device=lengths.device) < lengths[:, None]).float()  # (b*n, t)
        out = rows.with_(
            responses=tokens[:, :t].to(out_device),
            response_mask=mask.to(out_device),
            response_attention=mask.clone().to(out_device),
            rollout_logprobs=logprobs[:, :t].to(out_device),
            finish_reason=reasons,
        )
        if routes is not None:
            out = out.with_(**routes.fields(lengths - 1, t, out_device))
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full tensors, named as in the trainer's HF model, into this engine's model in place."""
        self._loads += 1
        load_named(self.model, named_tensors)

    def sleep(self) -> None:
        """Refuse `generate` until `wake`; with `offload_on_sleep` on an accelerator, move the weights to
        CPU; on CUDA, return cached allocator blocks (the last call's KV cache) to the device."""
        self._asleep = True
        if self.offload_on_sleep and self.device.type != "cpu":
            self.model.to("cpu")
            self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Undo `sleep`."""
        if self._offloaded:
            self.model.to(self.device)
            self._offloaded = False
        self._asleep = False

    def close(self) -> None:
        """Nothing to release: the engine holds only this process's tensors."""

    # -- decoding -------------------------------------------------------------------------------

    def _new_cache(self, capacity: int) -> Cache:
        config = getattr(self.model, "config", None)
        if self.kv_cache == "static":
            return StaticCache(config=config, max_cache_len=capacity)
        if self._prealloc:
            return Cache(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity))
        return DynamicCache(config=config) if isinstance(config, PretrainedConfig) else DynamicCache()

    def _forward(
        self, fn: Any, ids: Tensor, mask: Tensor, pos: Tensor, cache: Cache, *, last: bool, **vision: Tensor
    ) -> Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True, **vision}
        if last and self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        out = fn(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs)
        logits = out.logits[:, -1]  # (b, v)
        return suppress(logits, self._banned) if self._banned.numel() else logits

    def _prefill(self, ids: Tensor, mask: Tensor, pos: Tensor, cache: Cache, images: Images | None) -> Tensor:
        """The last position's logits of a prefill, its images (if any) encoded once each."""
        with feeding(self.model, images) as vision:
            return self._forward(self.model, ids, mask, pos, cache, last=True, **vision)

    def _start(self, prompts: Batch, sp: SamplingParams) -> tuple[Any, Tensor]:
        """(decoding state, last prompt logits (b*n, v)): the prompts prefilled once each by the Hugging
        Face forward, their cache rows and logits repeated n times (a prompt's samples consecutive).

        With the static cache (fixed shapes) every sample prefills its own copy instead. A vision-language
        prompt batch prefills with its images and M-RoPE positions (the vision tower runs once per prompt);
        its response continues as text from the largest prompt position + 1."""
        ids = prompts["input_ids"].to(self.device)  # (b, p)
        pos = _positions(prompts, self.device)  # (b, p)
        prompt_mask = prompts["attention_mask"].to(self.device)  # (b, p)
        n, static = sp.n, self.kv_cache == "static"
        if static and n > 1:
            if self._vision:
                raise ValueError("kv_cache='static' does not take images (each sample would prefill them)")
            ids, pos, prompt_mask = (x.repeat_interleave(n, dim=0) for x in (ids, pos, prompt_mask))
            n = 1
        images, rope, after = (
            _vision_prefill(prompts, pos, self.device) if self._vision else (None, pos, pos[:, -1:] + 1)
        )
        if self._lean is not None:
            cache = self._new_cache(ids.shape[1])
            logits = self._prefill(ids, prompt_mask, rope, cache, images)
            state = self._lean.start(cache, prompt_mask, after, n, sp.max_tokens)
            return state, logits.repeat_interleave(n, dim=0)
        cache = self._new_cache(ids.shape[1] + sp.max_tokens)
        mask = torch.cat([prompt_mask, prompt_mask.new_zeros((ids.shape[0], sp.max_tokens))], dim=1)
        logits = self._prefill(ids, mask if static else prompt_mask, rope, cache, images)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask, after = (x.repeat_interleave(n, dim=0) for x in (logits, mask, after))
        return _HFState(self, cache, mask, after, ids.shape[1]), logits

    def _decode(
        self, prompts: Batch, sp: SamplingParams, generator: torch.Generator, routes: _RouteLog | None
    ) -> tuple[Tensor, Tensor, Tensor, list[str]]:
        """(tokens, logprobs (b*n, T), lengths (b*n,), finish reasons) for `n` samples of each prompt;
        `routes` records the experts of every forward."""
        state, logits = self._start(prompts, sp)
        if routes is not None:
            routes.prefilled(torch.arange(logits.shape[0]), 0)
        b, big_t = logits.shape[0], sp.max_tokens
        tokens = torch.full((b, big_t), self.pad_id, dtype=torch.long, device=self.device)  # (b, T)
        logprobs = torch.zeros((b, big_t), dtype=torch.float32, device=self.device)
        lengths = torch.full((b,), big_t, dtype=torch.long)
        reasons = ["length"] * b
        stop_ids = torch.tensor(
            stop_token_ids(self.tokenizer, self.model, sp.stop_token_ids), device=self.device
        )
        strings = _StopStrings(self.tokenizer, sp.stop_strings)
        sample = functools.partial(
            sample_tokens,
            generator=generator,
            temperature=sp.temperature,
            top_k=sp.top_k,
            top_p=sp.top_p,
            min_p=sp.min_p,
        )
        where = torch.arange(b, device=self.device)  # original row of each batch position
        live = torch.ones(b, dtype=torch.bool, device=self.device)
        n_live = b
        for step in range(big_t):
            tok, logp = sample(logits)  # (a,), (a,)
            if n_live == live.shape[0]:  # every row live (the usual case after a compaction)
                tokens[where, step], logprobs[where, step] = tok, logp
                done = torch.isin(tok, stop_ids)  # (a,)
            else:
                out_rows = where[live]
                tokens[out_rows, step] = tok[live]
                logprobs[out_rows, step] = logp[live]
                done = torch.isin(tok, stop_ids) & live  # (a,)
            if strings:
                done |= strings.hits(tokens, where, live, step)
            if bool(done.any()):
                for r in where[done].tolist():
                    lengths[r], reasons[r] = step + 1, "stop"
                live = live & ~done
                n_live = int(live.sum())
            if n_live == 0 or step == big_t - 1:
                break
            if self._compacts and live.shape[0] - n_live > self.compact_fraction * live.shape[0]:
                keep = live.nonzero().squeeze(1)  # drop the finished rows
                state.select(keep)
                tok, where = tok[keep], where[keep]
                live = torch.ones(n_live, dtype=torch.bool, device=self.device)
            if self._pushed_at(step + 1, b):  # new weights: prompt + tokens so far recomputed with them
                state, logits = self._restart(prompts, sp, tokens[where, : step + 1], where)
                if routes is not None:
                    routes.prefilled(where.cpu(), step + 1)
            else:
                logits = state.step(tok)
                if routes is not None:
                    routes.fed(where.cpu(), step)
        return tokens.cpu(), logprobs.cpu(), lengths, reasons

    def _pushed_at(self, sampled: int, rows: int) -> bool:
        """Call the `each_step` hook, `sampled` tokens into every row; whether it loaded weights."""
        if self._on_step is None:
            return False
        loads = self._loads
        self._on_step(torch.full((rows,), sampled, dtype=torch.long))
        return self._loads != loads

    def _restart(
        self, prompts: Batch, sp: SamplingParams, sampled: Tensor, where: Tensor
    ) -> tuple[Any, Tensor]:
        """A decoding state, and the next logits, for the batch rows `where` (output rows, (a,)) whose
        tokens so far are `sampled` (a, k): their prompts followed by those tokens prefilled anew (with
        the weights the module holds now), room left for the remaining tokens."""
        rows = (where // sp.n).to(prompts["input_ids"].device)
        ids = prompts["input_ids"][rows].to(self.device)
        mask = prompts["attention_mask"][rows].to(self.device)
        pos = _positions(prompts, self.device)[rows.to(self.device)]  # (a, p)
        k = sampled.shape[1]
        after = pos[:, -1:] + torch.arange(1, k + 1, device=self.device)  # (a, k)
        context = Batch.from_dict({
            "input_ids": torch.cat([ids, sampled], dim=1),
            "attention_mask": torch.cat([mask, torch.ones_like(sampled, dtype=mask.dtype)], dim=1),
            "position_ids": torch.cat([pos, after], dim=1),
        })  # fmt: skip
        if self._vision:  # a vision-language prompt: its images, and the tokens so far as text
            rope = prompts[ROPE_FIELD][rows].to(self.device)  # (a, 3, p)
            text = rope.amax(dim=(1, 2))[:, None] + torch.arange(1, k + 1, device=self.device)  # (a, k)
            context = context.with_(
                rope_positions=torch.cat([rope, text[:, None, :].expand(-1, 3, -1)], dim=2),
                multi_modal_inputs=[prompts[VISION_FIELD][i] for i in rows.tolist()],
            )
        return self._start(context, dataclasses.replace(sp, n=1, max_tokens=sp.max_tokens - k))


class _RouteLog:
    """The experts a mixture of experts routed each token of one `generate` call to (`record_routes`):
    a context that traces the routers, and after each forward files its routes by output row."""

    def __init__(self, tap: RouterTap, prompts: Batch, sp: SamplingParams, width: int) -> None:
        """`width`: the prompt columns each prefill runs (more than `prompts`' in exact mode, whose extra
        leading padding columns are dropped from the log)."""
        self.tap, self.n, self.p, self.width = tap, sp.n, prompts["input_ids"].shape[1], width
        rows, shape = len(prompts) * sp.n, (tap.layers, tap.top_k)
        self.prompt = torch.full((rows, self.p, *shape), -1, dtype=torch.int16)
        self.response = torch.full((rows, sp.max_tokens, *shape), -1, dtype=torch.int16)
        self.padding = prompts["attention_mask"].cpu().repeat_interleave(sp.n, dim=0) == 0  # (rows, p)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _RouteLog:
        self.trace = self._stack.enter_context(self.tap.tracing())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def prefilled(self, rows: Tensor, sampled: int) -> None:
        """A prefill of the prompts (+ the first `sampled` tokens) of output rows `rows`, or of each
        prompt once for its n samples (fewer prefilled rows than `rows`)."""
        routes = self.trace.take(self.tap.layers).cpu().to(torch.int16)  # (R * (width + sampled), L, k)
        routes = routes.view(-1, self.width + sampled, *routes.shape[1:])[:, self.width - self.p :]
        if routes.shape[0] != len(rows):  # one prefill per prompt, shared by its n samples
            routes = routes.repeat_interleave(self.n, dim=0)
        self.prompt[rows] = routes[:, : self.p]
        self.response[rows, :sampled] = routes[:, self.p :]

    def fed(self, rows: Tensor, step: int) -> None:
        """A decode step that fed token `step` of output rows `rows`."""
        self.response[rows, step] = self.trace.take(self.tap.layers).cpu().to(torch.int16)

    def fields(self, last: Tensor, width: int, device: torch.device) -> dict[str, Tensor]:
        """`prompt_routes` and `response_routes` cut to `width` columns, -1 on prompt padding and from
        each row's last token (`last` (rows,): it was sampled, never fed) on."""
        response = self.response[:, :width].clone()
        response[torch.arange(width)[None, :] >= last[:, None]] = -1
        prompt = self.prompt.masked_fill(self.padding[:, :, None, None], -1)
        return {"prompt_routes": prompt.to(device), "response_routes": response.to(device)}


class _HFState:
    """The Hugging Face decode step's state: its cache, the attention mask (b, p + T) whose response
    columns are switched on one step at a time, and each row's next position (b, 1)."""

    def __init__(self, engine: NativeEngine, cache: Cache, mask: Tensor, pos: Tensor, p: int) -> None:
        self.engine, self.cache, self.mask, self.pos, self.fed = engine, cache, mask, pos, p

    def step(self, tokens: Tensor) -> Tensor:
        """Feed `tokens` (a,): the logits (a, v) of the token after each."""
        self.mask[:, self.fed] = 1  # the token fed now
        self.fed += 1
        engine = self.engine
        step_mask = self.mask if engine.kv_cache == "static" else self.mask[:, : self.fed]
        logits = engine._forward(
            engine._step_fn, tokens[:, None], step_mask, self.pos, self.cache, last=False
        )
        self.pos = self.pos + 1
        return logits

    def select(self, keep: Tensor) -> None:
        """Keep rows `keep` of the batch."""
        self.cache.batch_select_indices(keep)
        self.mask, self.pos = self.mask[keep], self.pos[keep]


class _StopStrings:
    """Checks each live row's decoded tail for the stop strings (one batch_decode per step)."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer, self.strings = tokenizer, tuple(s for s in stop_strings if s)
        self.window = max((len(s) for s in self.strings), default=0) + 1  # tokens: >= 1 character each

    def __bool__(self) -> bool:
        return bool(self.strings)

    def hits(self, tokens: Tensor, where: Tensor, live: Tensor, step: int) -> Tensor:
        """(a,) bool: live rows whose response so far ends inside a stop string's first occurrence."""
        rows = where[live].tolist()
        start = max(0, step + 1 - self.window)
        tails = tokens[rows, start : step + 1].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        hit = [any(s in text for s in self.strings) for text in texts]
        out = torch.zeros(live.shape, dtype=torch.bool, device=live.device)
        out[live] = torch.tensor(hit, dtype=torch.bool, device=live.device)
        return out


def load_named(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy full tensors into `model`'s state in place, matched by `canonical_name`; a name it lacks or a
    shape that differs raises."""
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in named_tensors:
            key = canonical_name(name)
            if key not in targets:
                raise KeyError(f"load_weights: the engine's model has no tensor {name!r} (as {key!r})")
            target = targets[key]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's is {tuple(target.shape)}"
                )
            target.copy_(tensor)


def canonical_name(name: str) -> str:
    """A parameter name without wrapper parts (`_orig_mod.`, FSDP/checkpoint wrappers, a leading `module.`)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _vision_prefill(
    prompts: Batch, pos: Tensor, device: torch.device
) -> tuple[Images | None, Tensor, Tensor]:
    """(the prefill's images, its position ids, each row's next position (b, 1)): a vision-language batch's
    images (None where no row has one) and (3, b, p) M-RoPE positions (`rlcore.data.vision`)."""
    rope = prompts[ROPE_FIELD].to(device)  # (b, 3, p)
    images = vision_inputs(prompts)
    return (
        None if images is None else images.to(device),
        rope.transpose(0, 1),
        rope.amax(dim=(1, 2))[:, None] + 1,
    )


def _positions(rows: Batch, device: torch.device) -> Tensor:
    """The rows' `position_ids`, or verl's clip(cumsum(attention_mask) - 1, 0) when absent. (b, p)"""
    if "position_ids" in rows:
        return rows["position_ids"].to(device)
    return (rows["attention_mask"].to(device).long().cumsum(dim=-1) - 1).clamp(min=0)


def _check_params(sp: SamplingParams) -> None:
    if sp.n < 1:
        raise ValueError(f"sampling.n={sp.n}: must be >= 1")
    if sp.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens={sp.max_tokens}: must be >= 1")
    check_sampling(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)
