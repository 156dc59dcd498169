"""OpenAI's gpt-oss (`gpt_oss`): a mixture of experts whose router and experts have biases (the experts'
gate and up interleaved in one fused tensor), attention sinks, and alternating sliding-window layers. Its
router has the transformers 5 signature (logits, gate weights renormalised over the top k, experts), so
routing is recorded and replayed as for the other mixtures of experts; it decodes with the Hugging Face
step."""

from __future__ import annotations

from rlcore.models.families.base import Family, MoESpec

FAMILY = Family(
    "gpt_oss",
    "gpt-oss",
    moe=MoESpec("GptOssTopKRouter", None, gates_over_chosen=True),
    refusals={
        "lean": "attention sinks and biased experts: the Hugging Face decode step",
        "ep": "its fused experts (gate and up interleaved, with biases) are not split by rlcore.dist.ep",
        "vllm": "its fused experts (gate and up interleaved, with biases) are not mapped to vLLM's names",
        "exact": "attention sinks are not in exact mode's attention",
        "selective": "its experts add their biases in place into the grouped products' outputs, which selective "
        "checkpointing keeps for the recomputation; use --model.activation-checkpointing",
    },
)
