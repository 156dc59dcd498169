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
  `rlcore.rollout.native.lean`'s plain-torch step over the module's own weights (one preallocated KV tensor,
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

`compile=True` compiles the lean step (CPU inductor, dynamic rows and length: ~20-40 s once per process, then
1.1-1.3x faster steps with 4-128 live rows; experiments/README.md, "A lean decode step and a bin-packed
update"); for other models it compiles the HF module. For GPUs: `kv_cache="static"` decodes with HF's
`StaticCache` (HF step) and full-length masks, so every decode step has the same shapes, and `compile=True,
compile_mode="reduce-overhead"` then runs it through `torch.compile` with CUDA graphs; neither has been run on
a GPU. On CPU the static cache gives the same outputs (tested).

Its parts live beside it: the caches and the Hugging Face step's state in `rlcore.rollout.native.kv_cache`, the
output rows and stop conditions in `rlcore.rollout.native.responses`, what a prefill is fed in
`rlcore.rollout.native.prefill_inputs`, recorded routes in `rlcore.rollout.native.route_log`, and named weight loading
in `rlcore.rollout.weight_names`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from rlcore.batch import Batch
from rlcore.data.prompts import pad_token_id
from rlcore.models.exact import align_prompts, kernel_mode
from rlcore.models.families import covering
from rlcore.models.forward import require_vision, takes_images
from rlcore.models.moe import RouterTap, router_tap
from rlcore.models.vision import Images, feeding, placeholder_ids, suppress
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.kv_cache import HFState, PreallocatedLayer, new_cache
from rlcore.rollout.native.lean import LeanDecoder, lean_decoder
from rlcore.rollout.native.lean_cover import full_attention_only
from rlcore.rollout.native.prefill_inputs import forward_keywords, positions, restart_context, vision_prefill
from rlcore.rollout.native.responses import Responses, stop_token_ids
from rlcore.rollout.native.route_log import RouteLog
from rlcore.rollout.sampling import check_sampling, sample_tokens
from rlcore.rollout.weight_names import canonical_name, load_named

__all__ = ["NativeEngine", "PreallocatedLayer", "canonical_name", "load_named", "stop_token_ids"]


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
        `lean`: decode with `rlcore.rollout.native.lean` where it covers the model (Llama family, "auto" cache);
        `compile` then compiles the lean step, else the Hugging Face module.
        `record_routes`: a mixture of experts' batches carry the experts each token was routed to,
        `prompt_routes` (b*n, p, L, k) and `response_routes` (b*n, t, L, k) int16, -1 where no token
        was fed (padding, a row's last token) (`rlcore.models.moe`)."""
        _check_options(kv_cache, compact_fraction)
        self.device = _place(model, device)
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.generator = torch.Generator(self.device).manual_seed(generator_seed)
        self.compact_fraction, self.offload_on_sleep = compact_fraction, offload_on_sleep
        self._cache_kw, self._keep_kw = forward_keywords(model)
        self.kv_cache = kv_cache
        self._prealloc = kv_cache == "auto" and full_attention_only(getattr(model, "config", None))
        self._compacts = kv_cache != "static"  # a static cache keeps its shapes: finished rows stay
        self.mode = kernel_mode(model)  # the kernels it was made with (`make_exact` first, then the engine)
        self._lean, self._step_fn = self._steps(lean, compile, compile_mode)
        self._vision = takes_images(model)  # its prompts carry images and M-RoPE positions (the family record)
        self._banned = torch.tensor(placeholder_ids(model), dtype=torch.long, device=self.device)
        self._tap = _route_tap(model, record_routes)  # a mixture of experts: routes by its own routers
        self._record = record_routes
        self._asleep = self._offloaded = False
        self._on_step: Callable[[Tensor], None] | None = None
        self._loads = 0  # `load_weights` calls so far: a load between decode steps restarts the decoding

    def _steps(self, lean: bool, compile: bool, compile_mode: str | None) -> tuple[LeanDecoder | None, Any]:
        """(the lean decoder, or None where it does not cover the model; the module the Hugging Face step
        runs, compiled when `compile` and no lean decoder)."""
        model = self.model
        decoder = lean_decoder(model, mode=self.mode, compile=compile) if lean and self._prealloc else None
        step_fn = (
            torch.compile(model, mode=compile_mode, dynamic=self.kv_cache != "static")
            if compile and decoder is None
            else model
        )
        return decoder, step_fn

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
        routes = RouteLog(self._tap, prompts, sampling, decoded["input_ids"].shape[1]) if self._record else None
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
        return new_cache(getattr(self.model, "config", None), self.kv_cache, self._prealloc, capacity)

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

    def _hf_step(self, ids: Tensor, mask: Tensor, pos: Tensor, cache: Cache) -> Tensor:
        """One Hugging Face decode step (the compiled module where `compile`): the logits (a, v)."""
        return self._forward(self._step_fn, ids, mask, pos, cache, last=False)

    def _start(self, prompts: Batch, sp: SamplingParams) -> tuple[Any, Tensor]:
        """(decoding state, last prompt logits (b*n, v)): the prompts prefilled once each by the Hugging
        Face forward, their cache rows and logits repeated n times (a prompt's samples consecutive).

        With the static cache (fixed shapes) every sample prefills its own copy instead. A vision-language
        prompt batch prefills with its images and M-RoPE positions (the vision tower runs once per prompt);
        its response continues as text from the largest prompt position + 1."""
        ids, pos, prompt_mask, n = self._prompt_tensors(prompts, sp)
        images, rope, after = (
            vision_prefill(prompts, pos, self.device) if self._vision else (None, pos, pos[:, -1:] + 1)
        )
        if self._lean is not None:
            cache = self._new_cache(ids.shape[1])
            logits = self._prefill(ids, prompt_mask, rope, cache, images)
            state = self._lean.start(cache, prompt_mask, after, n, sp.max_tokens)
            return state, logits.repeat_interleave(n, dim=0)
        return self._start_hf(ids, prompt_mask, rope, after, images, n, sp.max_tokens)

    def _prompt_tensors(self, prompts: Batch, sp: SamplingParams) -> tuple[Tensor, Tensor, Tensor, int]:
        """(ids, positions, attention mask (b', p) on the engine's device; the times each row's state is to
        be repeated): the prompts' rows, or with the static cache each row n times (then repeated once)."""
        ids = prompts["input_ids"].to(self.device)  # (b, p)
        pos = positions(prompts, self.device)  # (b, p)
        prompt_mask = prompts["attention_mask"].to(self.device)  # (b, p)
        n, static = sp.n, self.kv_cache == "static"
        if static and n > 1:
            if self._vision:
                raise ValueError("kv_cache='static' does not take images (each sample would prefill them)")
            ids, pos, prompt_mask = (x.repeat_interleave(n, dim=0) for x in (ids, pos, prompt_mask))
            n = 1
        return ids, pos, prompt_mask, n

    def _start_hf(
        self, ids: Tensor, prompt_mask: Tensor, rope: Tensor, after: Tensor, images: Images | None, n: int,
        max_tokens: int,
    ) -> tuple[HFState, Tensor]:  # fmt: skip
        """`_start` for the Hugging Face step: a cache and an attention mask with room for `max_tokens`."""
        static = self.kv_cache == "static"
        cache = self._new_cache(ids.shape[1] + max_tokens)
        mask = torch.cat([prompt_mask, prompt_mask.new_zeros((ids.shape[0], max_tokens))], dim=1)
        logits = self._prefill(ids, mask if static else prompt_mask, rope, cache, images)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask, after = (x.repeat_interleave(n, dim=0) for x in (logits, mask, after))
        return HFState(self._hf_step, static, cache, mask, after, ids.shape[1]), logits

    def _decode(
        self, prompts: Batch, sp: SamplingParams, generator: torch.Generator, routes: RouteLog | None
    ) -> tuple[Tensor, Tensor, Tensor, list[str]]:
        """(tokens, logprobs (b*n, T), lengths (b*n,), finish reasons) for `n` samples of each prompt;
        `routes` records the experts of every forward."""
        state, logits = self._start(prompts, sp)
        if routes is not None:
            routes.prefilled(torch.arange(logits.shape[0]), 0)
        b, big_t = logits.shape[0], sp.max_tokens
        out = Responses(b, big_t, self.pad_id, self.device, self.tokenizer, self.model, sp)
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
            done = out.add(step, tok, logp, where, live, n_live)
            if bool(done.any()):
                out.stop(where[done].tolist(), step)
                live = live & ~done
                n_live = int(live.sum())
            if n_live == 0 or step == big_t - 1:
                break
            if self._compacts and live.shape[0] - n_live > self.compact_fraction * live.shape[0]:
                keep = live.nonzero().squeeze(1)  # drop the finished rows
                state.select(keep)
                tok, where = tok[keep], where[keep]
                live = torch.ones(n_live, dtype=torch.bool, device=self.device)
            state, logits = self._advance(state, tok, where, step, prompts, sp, out.tokens, routes)
        return out.tokens.cpu(), out.logprobs.cpu(), out.lengths, out.reasons

    def _advance(
        self, state: Any, tok: Tensor, where: Tensor, step: int, prompts: Batch, sp: SamplingParams,
        tokens: Tensor, routes: RouteLog | None,
    ) -> tuple[Any, Tensor]:  # fmt: skip
        """(the state, the next logits) once token `step` (`tok`, for output rows `where`) is sampled: `tok`
        fed, or, where the `each_step` hook loaded new weights, the prompt + `tokens` so far recomputed."""
        if self._pushed_at(step + 1, tokens.shape[0]):  # new weights: prompt + tokens so far recomputed
            state, logits = self._restart(prompts, sp, tokens[where, : step + 1], where)
            if routes is not None:
                routes.prefilled(where.cpu(), step + 1)
            return state, logits
        logits = state.step(tok)
        if routes is not None:
            routes.fed(where.cpu(), step)
        return state, logits

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
        context = restart_context(prompts, rows, sampled, self.device, self._vision)
        return self._start(context, dataclasses.replace(sp, n=1, max_tokens=sp.max_tokens - sampled.shape[1]))


def _check_options(kv_cache: str, compact_fraction: float) -> None:
    if kv_cache not in ("auto", "dynamic", "static"):
        raise ValueError(f"kv_cache={kv_cache!r}: expected 'auto', 'dynamic' or 'static'")
    if not 0 <= compact_fraction <= 1:
        raise ValueError(f"compact_fraction={compact_fraction}: must be in [0, 1]")


def _place(model: torch.nn.Module, device: torch.device | str | None) -> torch.device:
    """The engine's device (`device`, else the model's, else the CPU), the model moved there."""
    param = next(model.parameters(), None)
    target = (
        torch.device(device)
        if device is not None
        else (param.device if param is not None else torch.device("cpu"))
    )
    if param is not None and param.device != target:
        model.to(target)
    return target


def _route_tap(model: torch.nn.Module, record_routes: bool) -> RouterTap | None:
    """The model's router tap (None: not a mixture of experts rlcore covers); `record_routes` needs one."""
    tap = router_tap(model)
    if record_routes and tap is None:
        raise ValueError(
            f"record_routes: {type(model).__name__} is not a mixture of experts rlcore covers "
            f"({covering('router-replay')})"
        )
    return tap


def _check_params(sp: SamplingParams) -> None:
    if sp.n < 1:
        raise ValueError(f"sampling.n={sp.n}: must be >= 1")
    if sp.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens={sp.max_tokens}: must be >= 1")
    check_sampling(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)
