"""The vision-language families: Qwen2-VL, Qwen2.5-VL and Qwen3-VL, which share Qwen2-VL's image
processing (patches merged 2x2) and multimodal rotary positions (`rlcore.data.vision`)."""

from __future__ import annotations

from rlcore.models.families.base import Family

_PROCESSOR = "Qwen2VLImageProcessorPil"
_REFUSALS = {
    "vllm": "rlcore does not pass images to vLLM yet",
    "selective": "its vision tower's blocks have not been shown to recompute the same gradients; use "
    "--model.activation-checkpointing",
}

FAMILIES = (
    Family("qwen2_vl", "Qwen2-VL", vision=_PROCESSOR, exact=True, refusals=_REFUSALS),
    Family("qwen2_5_vl", "Qwen2.5-VL", vision=_PROCESSOR, exact=True, refusals=_REFUSALS),
    Family("qwen3_vl", "Qwen3-VL", vision=_PROCESSOR, exact=True, refusals=_REFUSALS),
)
