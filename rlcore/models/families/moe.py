"""The mixtures of experts: Qwen3-MoE, Qwen2-MoE (with its shared expert), Mixtral and OLMoE, as
`from_pretrained` builds them in transformers 5 (a `<Family>TopKRouter` per MoE layer)."""

from __future__ import annotations

from rlcore.models.families.base import Family, MoESpec

FAMILIES = (
    Family("qwen3_moe", "Qwen3-MoE", lean=True, exact=True,
           moe=MoESpec("Qwen3MoeTopKRouter", "norm_topk_prob", lean_block="Qwen3MoeSparseMoeBlock",
                       lean_experts="Qwen3MoeExperts")),
    Family("qwen2_moe", "Qwen2-MoE", lean=True, exact=True,
           moe=MoESpec("Qwen2MoeTopKRouter", "norm_topk_prob")),  # its shared expert: the block runs whole
    Family("mixtral", "Mixtral", lean=True, exact=True,
           moe=MoESpec("MixtralTopKRouter", None, checkpoint_block="block_sparse_moe",
                       checkpoint_experts=("w1", "w3", "w2"),
                       lean_block="MixtralSparseMoeBlock", lean_experts="MixtralExperts")),
    Family("olmoe", "OLMoE", exact=True,  # q/k normalised over all heads at once: the Hugging Face step
           moe=MoESpec("OlmoeTopKRouter", "norm_topk_prob")),
)  # fmt: skip
