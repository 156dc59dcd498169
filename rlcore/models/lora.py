"""LoRA adapters on a Hugging Face model, with `peft`: only the adapters train, the base is the reference.

    model = apply_lora(model, rank=16, alpha=32, dropout=0.0, targets=())   # () = every attention/MLP linear
    with adapter_disabled(model):            # the base model: the KL reference, no second copy
        ref_logits = model(input_ids).logits
    save_adapter(model, "final/adapter")     # loads with peft.PeftModel.from_pretrained(base, dir)
    for name, tensor in merged_state(model): # base weights + B A * alpha / r, Hugging Face names

`apply_lora` wraps the targeted `nn.Linear` layers in place (`peft.get_peft_model`) and returns the
Hugging Face module itself, now holding `peft` LoRA layers: the trainer, the engine and the forward
passes keep calling it as before. A mixture of experts' fused 3-D expert tensors (`experts.gate_up_proj`
(E, 2i, h), `experts.down_proj` (E, h, i)) take adapters too, one low-rank pair per expert (peft's
`target_parameters`: A (E r, in), B (out, E r); the delta of expert e is B_e A_e x alpha / r, folded
into the weight for each forward); they are targeted by those two names, and by default. Base weights
are frozen (`requires_grad=False`), so the optimizer (`build_optimizer`) and the checkpoints (DCP
without frozen parameters) hold the adapters only.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from rlcore.models.vision import is_vision_config

_WRAPPED = re.compile(r"(\.base_layer)+\.")

ADAPTER = "default"
"""The adapter's name inside peft's layers (parameters `lora_A.default.weight`, ...)."""


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    seed: int | None = None,
) -> nn.Module:
    """`model` with LoRA adapters on `targets` (module name suffixes; empty: every linear layer of the
    attention and MLP blocks, peft's "all-linear", which leaves the output head alone). ValueError
    naming a target the model does not have. `seed`: A's initial draw from its own generator state
    (the global one left as it was), so the adapters start alike whatever ran before (under tensor
    parallelism an engine copy is built first; None: from the global state, as peft does)."""
    from peft import LoraConfig, get_peft_model

    if rank <= 0:
        raise ValueError(f"LoRA rank {rank}: must be >= 1")
    missing = missing_targets(model, targets)
    if missing:
        raise ValueError(
            f"LoRA targets {missing} are not linear layers of the model; it has {_target_names(model)}"
        )
    chosen = list(targets) or _default_targets(model)
    modules, params = _split_targets(chosen)
    modules = _language_only(model, modules)
    if params and dropout > 0:
        raise ValueError(
            f"the expert tensors {params} take no LoRA dropout (their adapter folds into the weight); "
            "use --model.lora-dropout 0, or target linear layers only"
        )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=modules,
        target_parameters=params or None,
        bias="none",
    )
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = get_peft_model(model, config).get_base_model()
    for module in model.modules():
        if type(module) is _peft_linear():
            module.__class__ = _in_place_linear()
    return model


def _default_targets(model: nn.Module) -> str | list[str]:
    """peft's "all-linear"; for a mixture of experts its `nn.Linear` layers by name and its fused
    expert tensors (`EXPERT_TARGETS`)."""
    experts = _expert_targets(model)
    if not experts:
        return "all-linear"
    return [name for name in _linear_names(model) if name != "lm_head"] + experts


def _language_only(model: nn.Module, modules: str | list[str]) -> str | list[str]:
    """A vision-language model's targets restricted to its language model (a regex over module names, as
    peft matches one; "all-linear" is every linear layer there); a text model's as given."""
    language = getattr(getattr(model, "model", None), "language_model", None)
    if language is None or not is_vision_config(getattr(model, "config", None)):
        return modules
    names = _linear_names(language) if modules == "all-linear" else list(modules)
    return rf"(.*\.)?language_model\..*\.({'|'.join(map(re.escape, names))})"


EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
"""The target names of a mixture of experts' fused expert tensors (module `experts`, parameter)."""


def _expert_targets(model: nn.Module) -> list[str]:
    """The `EXPERT_TARGETS` `model` holds (a dense model: none)."""
    from rlcore.dist.ep import expert_modules

    return list(EXPERT_TARGETS) if expert_modules(model) else []


def _split_targets(targets: str | list[str]) -> tuple[str | list[str], list[str]]:
    """(module targets, parameter targets) of `targets` for peft's `target_modules` / `target_parameters`."""
    if isinstance(targets, str):
        return targets, []
    params = [t for t in targets if t in EXPERT_TARGETS]
    return [t for t in targets if t not in params], params


def _linear_names(model: nn.Module) -> list[str]:
    """The names (last component, sorted, once each) of `model`'s `nn.Linear` layers."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def _target_names(model: nn.Module) -> list[str]:
    """What `apply_lora` can target in `model`: its linear layers' names, then its expert tensors."""
    return _linear_names(model) + _expert_targets(model)


def _peft_linear() -> type[nn.Module]:
    from peft.tuners.lora import Linear

    return Linear


@functools.cache
def _in_place_linear() -> type[nn.Module]:
    """peft's LoRA `Linear` whose plain forward adds the adapter into the base output in place."""

    class InPlaceLoraLinear(_peft_linear()):
        """`lora.Linear` with the adapter added in place: x W^T + b, then += scale (x A^T) B^T in one
        `addmm_` (the product scaled inside the GEMM). peft's `result + B(A x) * scale` allocates three
        output-sized tensors per projection and call, whose freed blocks fragment the heap (about 2 GB
        of extra resident memory in a SmolLM2 update). Any other case (mixed adapter batches, merged or
        disabled adapters, variants such as DoRA, an adapter bias, mixed dtypes) is peft's own forward."""

        def forward(self, x: Tensor, *args: object, **kwargs: object) -> Tensor:
            adapters = [a for a in self.active_adapters if a in self.lora_A]
            if kwargs or args or self.merged or self.disable_adapters or not _plain(self, adapters, x):
                return super().forward(x, *args, **kwargs)
            result = self.base_layer(x)
            flat = result.view(-1, result.shape[-1])
            for name in adapters:
                low = self.lora_A[name](self.lora_dropout[name](x))  # (..., r)
                flat.addmm_(
                    low.view(-1, low.shape[-1]), self.lora_B[name].weight.t(), alpha=self.scaling[name]
                )
            return result

    return InPlaceLoraLinear


def _plain(layer: nn.Module, adapters: list[str], x: Tensor) -> bool:
    """Vanilla adapters (no variant, no bias) in x's dtype on a base output in x's dtype, all plain
    tensors (split by tensor parallelism, the adapters are DTensors whose layers run through their
    module calls: peft's forward)."""
    from torch.distributed.tensor import DTensor

    base = layer.get_base_layer().weight
    return (
        not isinstance(x, DTensor)
        and not isinstance(base, DTensor)
        and all(
            name not in layer.lora_variant
            and not layer.lora_bias.get(name, False)
            and layer.lora_A[name].weight.dtype == x.dtype == layer.lora_B[name].weight.dtype
            for name in adapters
        )
        and base.dtype == x.dtype
    )


def missing_targets(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """The targets that name no `nn.Linear` of `model` (by the last part of its module name) and no
    expert tensor of it."""
    names = set(_target_names(model))
    return [t for t in targets if t not in names]


def is_lora(model: nn.Module) -> bool:
    """Whether `model` holds LoRA layers (`apply_lora`)."""
    return any(_is_lora_layer(m) for m in model.modules())


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block `model` computes as its base model (every LoRA layer skips its adapter)."""
    layers = [m for m in model.modules() if _is_lora_layer(m)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def base_name(name: str) -> str:
    """A parameter's name in the base model: `x.q_proj.base_layer.weight` -> `x.q_proj.weight` (nested
    wrappers too: two expert tensors of one module, `x.experts.base_layer.base_layer.down_proj`)."""
    return _WRAPPED.sub(".", name)


def base_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(base name, tensor) of the base model alone (the adapters left out, nothing merged), each tied
    tensor once: what an engine that applies the adapter itself (vLLM) starts from."""
    from rlcore.dist.stream import unique_state

    for name, value in unique_state(model):
        if ".lora_" not in name:
            yield base_name(name), value


def merged_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(base name, tensor) of the base model with every adapter merged into its weight (W + scale B A),
    each tied tensor once; the adapter's own parameters are left out."""
    from rlcore.dist.stream import unique_state

    adapted = {id(_adapted(m)): m for m in model.modules() if _is_lora_layer(m)}
    for name, value in unique_state(model):
        if ".lora_" in name:
            continue
        layer = adapted.get(id(value))
        if layer is not None:
            with torch.no_grad():
                value = value.detach() + layer.get_delta_weight(ADAPTER).to(value.dtype)
        yield base_name(name), value.detach()


def _adapted(layer: nn.Module) -> Tensor:
    """The base parameter a LoRA layer adapts: a linear layer's weight, or an expert tensor."""
    get_param = getattr(layer, "get_param", None)  # peft's ParamWrapper (`target_parameters`)
    return get_param() if get_param is not None else layer.get_base_layer().weight


def adapter_params(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of the adapter's parameters, in order (what a LoRA weight push moves; DTensors as
    they are: `rlcore.dist.stream.iter_full_state` gathers them)."""
    for name, p in model.named_parameters():
        if ".lora_" in name:
            yield name, p


def push_state(model: nn.Module) -> Callable[[nn.Module], Iterator[tuple[str, Tensor]]] | None:
    """What a weight push of `model` sends: a LoRA policy's adapter tensors only (the receivers hold the
    base), else everything (None)."""
    return adapter_params if is_lora(model) else None


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors under peft's saved names (`base_model.model.<module>.lora_A.weight`), whole
    (a collective under FSDP: every rank calls it)."""
    from rlcore.dist.stream import _full_tensor

    return {
        "base_model.model." + name.replace(f".{ADAPTER}.", "."): _full_tensor(p).to("cpu").contiguous()
        for name, p in adapter_params(model)
    }


def save_adapter(
    model: nn.Module, directory: str | Path, *, base: str | None = None, write: bool = True
) -> Path:
    """Write the adapter as peft does (`adapter_config.json`, `adapter_model.safetensors`): loads with
    `peft.PeftModel.from_pretrained(base_model, directory)`. `base`: the base model's path or id. Under
    FSDP every rank calls it (the adapter is gathered) and the one with `write` writes."""
    tensors = adapter_state(model)
    out = Path(directory)
    if not write:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER]
    if base is not None:
        config.base_model_name_or_path = base
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
