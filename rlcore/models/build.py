"""Building a run's models from a `ModelSpec` (rlcore.models.specs): the trained policy, its frozen reference,
the engine's own copy, a distillation teacher; sharding over a placement; the final Hugging Face export.

    spec = ModelSpec(path="builtin:tiny", seed=0)
    model = build_policy(spec, placement)           # placement: rlcore.dist.placement.place(...)
    reference = build_reference(spec, placement)    # None with LoRA (the policy, adapters off)

Every builder raises `SpecError` naming the spec's field at fault (a missing model: "path").
"""

from __future__ import annotations

from typing import Any

from rlcore.models.policy import load_model, load_tokenizer
from rlcore.models.specs import ModelSpec, SpecError


def load_tokenizer_of(spec: ModelSpec) -> Any:
    """The model's tokenizer, loaded without its weights."""
    try:
        return load_tokenizer(spec.path)
    except ValueError as e:  # a missing or broken model directory
        raise SpecError("path", str(e)) from None


def load_vision_of(spec: ModelSpec, tokenizer: Any) -> Any:
    """The model's image processing (`rlcore.models.vision`) for its loaded `tokenizer`, None for a
    text-only model; no weights load."""
    from rlcore.models.policy import load_vision

    try:
        return load_vision(spec.path, tokenizer)
    except ValueError as e:
        raise SpecError("path", str(e)) from None


def load(spec: ModelSpec, dist: Any) -> Any:
    """The model at `spec.path` on this rank's device (`dist.device`), in its exact forward with `spec.exact`."""
    try:
        model = load_model(spec.path, dtype=spec.torch_dtype, seed=spec.seed)
    except ValueError as e:  # a missing or broken model directory
        raise SpecError("path", str(e)) from None
    model = model.to(dist.device)
    if spec.exact:  # every copy that samples or scores runs the one batch-invariant forward
        from rlcore.models.exact import make_exact

        try:
            make_exact(model)
        except ValueError as e:
            raise SpecError("exact", str(e)) from None
    return model


def _routed(model: Any, spec: ModelSpec) -> Any:
    """`model` with its routers replaying recorded routes per `spec.router_replay` (a mixture of experts;
    a dense model as is)."""
    from rlcore.models.moe import router_tap

    tap = router_tap(model)
    if tap is not None:
        tap.replays = spec.router_replay == "replay"
    return model


def build_policy(spec: ModelSpec, placement: Any) -> Any:
    """The trained policy, split over the placement's axes (`shard`)."""
    model = _routed(load(spec, placement.local), spec)
    model.train()
    if spec.freeze_vision:
        from rlcore.models.vision import vision_tower

        vision_tower(model).requires_grad_(False)
    if spec.lora_rank > 0:
        model = _with_lora(model, spec)
    if spec.activation_checkpointing or spec.selective_checkpointing:
        from rlcore.dist.fsdp import apply_activation_checkpointing
        from rlcore.models.recompute import selective_contexts

        selective = not spec.activation_checkpointing  # (selective only: keep the products' outputs)
        apply_activation_checkpointing(model, context_fn=selective_contexts if selective else None)
    return shard(model, placement)


def shard(model: Any, placement: Any) -> Any:
    """`model` split in place over the placement's axes: tensor parallel (rlcore.dist.tp, by the family's plan), then Ulysses
    attention (rlcore.dist.ulysses), expert parallel (rlcore.dist.ep), then FSDP2 over the shard mesh
    (the experts left to ep); a plain module for one process."""
    if placement.tp_mesh is not None:
        from rlcore.models.parallel import apply_family_tp

        apply_family_tp(model, placement.tp_mesh)
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


def _with_lora(model: Any, spec: ModelSpec) -> Any:
    """The model with the spec's LoRA adapters (only they train)."""
    from rlcore.models.lora import apply_lora

    try:
        return apply_lora(
            model, rank=spec.lora_rank, alpha=spec.lora_alpha, dropout=spec.lora_dropout, targets=spec.lora_targets,
            seed=spec.seed,
        )  # fmt: skip
    except ValueError as e:
        raise SpecError("lora_targets", str(e)) from None


def build_engine_copy(spec: ModelSpec, dist: Any) -> Any:
    """The policy an engine samples from when it cannot share the trained module (a rollout rank of
    split placement, or every rank under FSDP): in eval mode, refreshed by weight pushes, never trained.
    Its parameters keep `requires_grad` (the engine runs under no_grad): on CPU a linear layer takes
    another kernel for a weight without it, and sampling would then differ from the trained module's
    forward by ~1e-6 in log-prob (measured), where it now matches it exactly."""
    model = load(spec, dist)
    if spec.lora_rank > 0:  # the same adapter layers: pushes then move the adapter tensors only
        model = _with_lora(model, spec)
    return model.eval()


def build_reference(spec: ModelSpec, placement: Any) -> Any:
    """A frozen copy of the starting policy, sharded like it, never updated (None with LoRA: the
    reference is then the policy with its adapter disabled, `rlcore.step.stages.reference`)."""
    if spec.lora_rank > 0:
        return None
    model = _routed(load(spec, placement.local), spec)
    model.eval().requires_grad_(False)
    return shard(model, placement)


def build_teacher(spec: ModelSpec, placement: Any) -> Any:
    """On-policy distillation's teacher: frozen, in eval mode, sharded like the policy (`spec.path`,
    `spec.dtype` and `spec.seed` are read; it routes by its own routers)."""
    try:
        model = load_model(spec.path, dtype=spec.torch_dtype, seed=spec.seed)
    except ValueError as e:
        raise SpecError("path", str(e)) from None
    model = model.to(placement.local.device).eval().requires_grad_(False)
    from rlcore.models.moe import router_tap

    tap = router_tap(model)
    if tap is not None:  # a mixture-of-experts teacher routes by its own router, never the student's routes
        tap.replays = False
    return shard(model, placement)


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
