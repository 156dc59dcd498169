"""Gemma-3 text (`gemma3_text`): sandwich norms around attention and MLP, RMSNorm scaled by (1 + w), the
embedding scaled by sqrt(hidden), GELU-tanh MLPs, and sliding-window layers between global ones, each kind
with its own rotary table. It trains through the Hugging Face forward (rows, or prompt-packed within its
window) and decodes with the Hugging Face step."""

from __future__ import annotations

from rlcore.models.families.base import Family

FAMILY = Family(
    "gemma3_text",
    "Gemma-3 text",
    refusals={
        "lean": "sandwich norms, (1 + w) RMSNorm and sliding-window layers: the Hugging Face decode step",
        "exact": "its rotary embedding takes a layer type (a sliding-window table and a global one), "
        "which exact mode's rotary table does not",
    },
)
