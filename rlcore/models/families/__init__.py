"""What rlcore knows about each model family: one record per family (`Family`), in one table.

    family = family_of(model)            # its record (a bare one for a family rlcore has no record of)
    family.refusal("exact")              # None, or why the family does not have the feature
    family.moe                           # its routing and expert names (None for a dense family)

A family is resolved from `config.model_type` when it is asked for; every path that used to ask the
module what it is (a router class, a lean-step class, a tensor-parallel plan, an image processor) reads
the record instead. Adding a family is one file in this package and one entry in `FAMILIES`
(docs/architecture.md, "Adding a model family"). A family without a record still trains through the
Hugging Face forward and decode step, with the features a record would have to vouch for (the lean step,
tensor parallelism, routing, exact mode, selective checkpointing) refused in one line.
"""

from __future__ import annotations

from typing import Any

from rlcore.models.families import gemma3, gpt_oss, llama, moe, vision
from rlcore.models.families.base import FEATURES, Family, MoESpec

__all__ = ["FAMILIES", "FEATURES", "Family", "MoESpec", "compatibility", "covering", "family_of"]

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (*llama.FAMILIES, *moe.FAMILIES, *vision.FAMILIES, gemma3.FAMILY, gpt_oss.FAMILY)
}
"""`config.model_type` -> its record: the families rlcore covers."""


def family_of(model_or_config: Any) -> Family:
    """The record of a model (possibly wrapped) or of its config: `FAMILIES[config.model_type]`, else a
    record with no feature of its own (the Hugging Face forward and decode step)."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None) or ""
    family = FAMILIES.get(model_type)
    if family is not None:
        return family
    return Family(
        model_type,
        f"{model_type or 'this model'} (a family rlcore has no record of)",
        refusals={"selective": _UNRECORDED_SELECTIVE},
    )


_UNRECORDED_SELECTIVE = (
    "its layers have not been shown to recompute the same gradients (a layer that changes a "
    "kept product in place stops the backward); use --model.activation-checkpointing"
)


def compatibility() -> list[tuple[str, dict[str, str | None]]]:
    """The compatibility table: (family name, {feature: None or why not}) for every recorded family."""
    return [(f.name, {feature: f.refusal(feature) for feature in FEATURES}) for f in FAMILIES.values()]


def covering(feature: str) -> list[str]:
    """The model types of the recorded families that have `feature`, sorted (for messages)."""
    return sorted(t for t, f in FAMILIES.items() if f.refusal(feature) is None)
