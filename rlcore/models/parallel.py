"""Whether a model's family and shapes split over tensor- or expert-parallel ranks (one line naming what
does not), and a model split by its family's tensor-parallel plan.

    problem = tp_problem(model.config, tp) or ep_problem(model.config, ep)   # None, or one line
    apply_family_tp(model, mesh["tp"])                                      # rlcore.dist.tp with the family's plan
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlcore.dist.ep import num_experts
from rlcore.dist.tp import apply_tp
from rlcore.models.families import covering, family_of


def tp_problem(config: Any, tp: int) -> str | None:
    """One line on why `config` cannot be split `tp` ways (None if it can)."""
    if tp == 1:
        return None

    family = family_of(config)
    if family.tp_plan is None:
        return f"no tensor-parallel plan for model_type {family.model_type!r} (plans: {', '.join(covering('tp'))})"
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name} {size}" for name, size in sizes.items() if size % tp]
    if bad:
        return f"{', '.join(bad)} not divisible by tp({tp}); use a tp that divides them"
    return None


def ep_problem(config: Any, ep: int) -> str | None:
    """One line saying why `config`'s model cannot be split over `ep` expert-parallel ranks, or None."""
    if ep == 1:
        return None
    family = family_of(config)
    why = family.refusal("ep")
    if why is not None and family.moe is None:
        return f"expert parallelism needs a mixture of experts ({', '.join(covering('ep'))}); {family.model_type} is dense"
    if why is not None:
        return f"{family.name}: {why}"
    experts = num_experts(config)
    if experts % ep:
        return (
            f"its {experts} experts per layer do not divide over {ep} ranks; use an ep that divides {experts}"
        )
    return None


def apply_family_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split `model` over the 1-D `mesh` by its family's plan (`rlcore.dist.tp.apply_tp`), in place;
    ValueError (one line) where it cannot be split that way."""
    problem = tp_problem(model.config, mesh.size())
    if problem is not None:
        raise ValueError(problem)
    return apply_tp(model, mesh, family_of(model).tp_plan)
