"""The record of one model family: what rlcore knows about it, and which features it has.

A family is keyed by its Hugging Face `config.model_type`. Its record says which of rlcore's own paths
cover it (the lean decode step, a tensor-parallel plan, exact mode), how its mixture of experts routes and
names its experts (`MoESpec`), and which image processor a vision-language family uses. `refusal(feature)`
is the compatibility table's row for it: None where the feature is available, else one phrase saying why
not (pre-flight prints it in its one-line refusal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rlcore.dist.tp_plans import LayerPlan

FEATURES: Mapping[str, str] = {
    "lean": "the lean decode step (else the Hugging Face step)",
    "tp": "--trainer.tp",
    "ep": "--trainer.ep",
    "router-replay": "--algo.router-replay",
    "exact": "--rollout.exact",
    "vllm": "--rollout.engine vllm",
    "selective": "--model.selective-checkpointing",
}
"""The features a family may or may not have, with the flag (or the path) that asks for each."""


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """How a mixture of experts routes (its router module) and how its checkpoints name the experts that
    transformers 5 fuses into 3-D tensors."""

    router_class: str
    """The router module's class name; it maps hidden states (N, h) to (logits (N, E), gate weights (N, k),
    experts (N, k))."""
    normalize_attr: str | None
    """The router attribute saying whether the top-k weights are renormalised (None: always)."""
    checkpoint_block: str = "mlp"
    """The MoE block's name in the checkpoint (transformers names it `mlp`)."""
    checkpoint_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """The checkpoint's per-expert gate, up and down projections."""
    lean_block: str | None = None
    """The sparse block class whose forward is the router, then the experts, and nothing else (the lean step
    packs its experts); None: the lean step calls the block as a module."""
    lean_experts: str | None = None
    """The experts class computing down(act(gate) * up) per expert from `gate_up_proj` / `down_proj`."""
    gates_over_chosen: bool = False
    """The router's gate weights are the softmax of the chosen experts' logits (gpt-oss), not the softmax
    over every expert gathered at them (`rlcore.pure.routing.replay_gates`)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family (see the module docstring)."""

    model_type: str
    """`config.model_type`."""
    name: str
    """Its name in messages and docs."""
    lean: bool = False
    """The lean decode step (`rlcore.rollout.native.lean`) reproduces its decoder layers."""
    tp_plan: LayerPlan | None = None
    """How `--trainer.tp` splits a decoder layer (`rlcore.dist.tp_plans`); None: no plan."""
    moe: MoESpec | None = None
    """Its mixture of experts; None for a dense family."""
    vision: str | None = None
    """A vision-language family's PIL image processor class in `transformers`; None for text."""
    exact: bool = False
    """Exact mode (`rlcore.models.exact`) covers it: its rotary table, attention and kernels."""
    refusals: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Feature -> why this family does not have it, where its fields alone do not say."""

    def refusal(self, feature: str) -> str | None:
        """Why this family does not have `feature` (one of `FEATURES`), or None where it does."""
        if feature not in FEATURES:
            raise KeyError(f"unknown feature {feature!r} (features: {', '.join(FEATURES)})")
        if feature in self.refusals:
            return self.refusals[feature]
        derived = {
            "lean": None if self.lean else "its layers are not the lean step's: the Hugging Face decode step",
            "tp": None if self.tp_plan is not None else "no tensor-parallel plan",
            "ep": None if self.moe is not None else "dense (no experts)",
            "router-replay": None if self.moe is not None else "dense (no router)",
            "exact": None if self.exact else "exact mode has not been built and shown for it",
            "vllm": None,
            "selective": None,
        }
        return derived[feature]
