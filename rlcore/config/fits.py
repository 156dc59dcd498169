"""Say no before the kernel does: refuse a run whose estimated peak memory exceeds what this process can have.

    check_fits(cfg, world_size=2, on_cpu=True, prompt_tokens=212)   # before any weights load: one line, or nothing

The estimate is `rlcore.models.footprint`'s, from the model's config.json, the run's flags (dtype, LoRA,
checkpointing, the micro-batch, the rollout batch, the engine: vLLM's own weights and its
`VLLM_CPU_KVCACHE_SPACE`) and the longest kept prompt (so it runs once the prompts
are tokenized). The limit is the memory this process can still get:
the kernel's available memory (MemAvailable) plus what the process holds already, within a cgroup's limit
when one is set, shared by the ranks on this host. A refusal names the estimate and its largest parts, the
limit, and the flags that would make the run fit by the same estimate. `--trainer.no-memory-check`
skips it (an estimate is not a measurement). On an accelerator the estimate is not made: its memory is
the device's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from configs import Config, ConfigError
from rlcore.dist import memory
from rlcore.models.footprint import FootprintSetup, Shape, estimate
from rlcore.rollout.engines import engine_kind

GIB = 2**30
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def check_fits(cfg: Config, *, world_size: int, on_cpu: bool, prompt_tokens: int) -> None:
    """Raise a one-line ConfigError when the run's estimated peak exceeds `available_bytes()` on any rank
    (a collective under torchrun: every rank calls it and decides alike)."""
    if not cfg.trainer.memory_check or not on_cpu:
        return
    from rlcore.config.model_checks import model_shape
    from rlcore.dist.reduce import world_max

    shape = model_shape(cfg.model.path)  # a path with no readable config.json: its one line, as loading says
    if shape is None:  # a family the estimate cannot read: no estimate
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        limit = available_bytes() // max(1, local)
    except OSError:  # not Linux: no estimate of what the process can have
        limit = 2**62
    est = estimate(shape, setup_of(cfg, shape, world_size, prompt_tokens))
    need, parts = est.peak, est.parts
    if world_max([int(need > limit)])[0] == 0:
        return
    largest = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
    fixes = fitting(cfg, shape, world_size=world_size, prompt_tokens=prompt_tokens, limit=limit)
    hint = (f"these flags would fit it: {'; '.join(fixes)}" if fixes else
            "no single flag makes it fit (try them together, or more ranks)")  # fmt: skip
    raise ConfigError(
        f"--model.path {cfg.model.path}: the run needs about {need / GIB:.1f} GiB at its peak ({largest} GiB), "
        f"more than the {limit / GIB:.1f} GiB this process can have; {hint}; --trainer.no-memory-check runs anyway"
    )


def setup_of(cfg: Config, shape: Shape, world_size: int, prompt_tokens: int) -> FootprintSetup:
    """The estimate's view of a run on one of `world_size` ranks (FSDP2 shards the trained state) whose
    longest prompt has `prompt_tokens` tokens."""
    a, r = cfg.algo, cfg.rollout
    row = prompt_tokens + (r.max_tokens or 512)
    micro = a.max_tokens_per_micro_batch or a.micro_batch_size * row
    rows = -(-cfg.data.batch_size * r.n // world_size)
    bf16 = {"float32": 4, "bfloat16": 2}
    kind = engine_kind(r.engine)
    lora_copy = cfg.model.lora_rank > 0 and r.lora_merged_copy and not r.exact
    copy = kind.own_weights or world_size > 1 or lora_copy  # vLLM holds its own weights too
    env = kind.kv_cache_env  # the KV cache reserved up front, 1 GiB by default (rlcore's)
    reserved_kv = 0 if env is None else int(float(os.environ.get(env, "1")) * GIB)
    return FootprintSetup(dtype_bytes=bf16[cfg.model.dtype], lora_rank=cfg.model.lora_rank,
                         micro_tokens=min(micro, rows * row), rollout_rows=rows, rollout_tokens=row,
                         checkpointing=cfg.model.activation_checkpointing, selective=cfg.model.selective_checkpointing,
                         compute_bytes=bf16[cfg.model.compute_dtype],
                         shards=world_size, engine_copy=kind.packs_weights,
                         engine_copy_bytes=(shape.params * bf16[cfg.model.dtype] if copy else 0) + reserved_kv)  # fmt: skip


def fitting(cfg: Config, shape: Shape, *, world_size: int, prompt_tokens: int, limit: int) -> list[str]:
    """The `alternatives` a refusal may suggest: those pre-flight would not refuse (the compatibility table,
    the model family's record) whose estimated peak is within `limit` bytes."""
    return [flag for flag, c in alternatives(cfg)
            if _allowed(c) and estimate(shape, setup_of(c, shape, world_size, prompt_tokens)).peak <= limit]  # fmt: skip


def _allowed(cfg: Config) -> bool:
    """Whether pre-flight's feature checks let `cfg` run (`clash_of`, `check_family`)."""
    from rlcore.config.compatibility import clash_of
    from rlcore.config.model_checks import check_family

    if clash_of(cfg) is not None:
        return False
    try:
        check_family(cfg)
    except ConfigError:
        return False
    return True


def alternatives(cfg: Config) -> list[tuple[str, Config]]:
    """The memory-saving flags a refusal may suggest, each with the config it gives."""
    m, a = cfg.model, cfg.algo
    out = []
    if m.lora_rank == 0:
        out.append(("--model.lora-rank 16", dataclasses.replace(cfg, model=dataclasses.replace(m, lora_rank=16))))
    elif cfg.rollout.lora_merged_copy:
        off = dataclasses.replace(cfg.rollout, lora_merged_copy=False)
        out.append(("--rollout.no-lora-merged-copy", dataclasses.replace(cfg, rollout=off)))
    if m.dtype == "float32":
        out.append(("--model.dtype bfloat16", dataclasses.replace(cfg, model=dataclasses.replace(m, dtype="bfloat16"))))
    if not (m.activation_checkpointing or m.selective_checkpointing):
        on = dataclasses.replace(m, selective_checkpointing=True)  # the same speed, about half the activations
        out.append(("--model.selective-checkpointing", dataclasses.replace(cfg, model=on)))
    if not m.activation_checkpointing:
        on = dataclasses.replace(m, activation_checkpointing=True)
        out.append(("--model.activation-checkpointing", dataclasses.replace(cfg, model=on)))
    smaller = max(1, (a.max_tokens_per_micro_batch or 4096) // 4)
    out.append((f"--algo.max-tokens-per-micro-batch {smaller}",
                dataclasses.replace(cfg, algo=dataclasses.replace(a, max_tokens_per_micro_batch=smaller))))  # fmt: skip
    return out


def available_bytes() -> int:
    """The memory this process can still get, plus what it holds (module docstring)."""
    held = int((memory.resident_mb() or 0.0) * 2**20)
    available = _meminfo("MemAvailable") + held
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            used = _cgroup_usage(path)
            available = min(available, int(text) - used + held)
    return available


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key}")


def _cgroup_usage(limit: Path) -> int:
    current = limit.with_name("memory.current" if limit.name == "memory.max" else "memory.usage_in_bytes")
    try:
        return int(current.read_text().strip())
    except (OSError, ValueError):
        return 0
