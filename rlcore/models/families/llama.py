"""The dense Llama family: Llama, Mistral, Qwen2 and Qwen3 (q/k RMSNorm), the built-in models included."""

from __future__ import annotations

from rlcore.dist.tp_plans import LLAMA_LAYER_PLAN, QWEN3_LAYER_PLAN
from rlcore.models.families.base import Family

FAMILIES = (
    Family("llama", "Llama", lean=True, tp_plan=LLAMA_LAYER_PLAN, exact=True),
    Family("mistral", "Mistral", lean=True, tp_plan=LLAMA_LAYER_PLAN, exact=True),
    Family("qwen2", "Qwen2", lean=True, tp_plan=LLAMA_LAYER_PLAN, exact=True),
    Family("qwen3", "Qwen3", lean=True, tp_plan=QWEN3_LAYER_PLAN, exact=True),
)
