"""Rollout: the engine protocol, the native KV-cache engine and sampling; the multi-turn agent loop in
`rlcore.rollout.agent`.

    from rlcore.rollout import NativeEngine, SamplingParams
    from rlcore.rollout.agent import run_agent
    engine = NativeEngine(model, tokenizer)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_tokens=64))
    agent_rollouts = run_agent(engine, prompts, SamplingParams(n=8, max_tokens=96), tokenizer)

The vLLM engine lives in `rlcore.rollout.vllm.engine` and is imported only when asked for (vllm is
an optional dependency).
"""

from rlcore.rollout.base import RolloutEngine, SamplingParams
from rlcore.rollout.native.engine import NativeEngine, stop_token_ids
from rlcore.rollout.sampling import processed_logits, processed_logprobs, sample_tokens

__all__ = [
    "NativeEngine",
    "RolloutEngine",
    "SamplingParams",
    "processed_logits",
    "processed_logprobs",
    "sample_tokens",
    "stop_token_ids",
]
