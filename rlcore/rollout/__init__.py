"""Rollout: the engine protocol, the native KV-cache engine, sampling, and the multi-turn agent loop.

    from rlcore.rollout import NativeEngine, SamplingParams, run_agent
    engine = NativeEngine(model, tokenizer)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_tokens=64))
    agent_rollouts = run_agent(engine, prompts, SamplingParams(n=8, max_tokens=96), tokenizer)

The vLLM engine lives in `rlcore.rollout.vllm.engine` and is imported only when asked for (vllm is
an optional dependency).
"""

from rlcore.rollout.agent.loop import AgentEngine, observe, parse_tool_call, run_agent
from rlcore.rollout.agent.tools import TOOLS, Tool, ToolError, ToolFormat, calculator, python_tool
from rlcore.rollout.base import RolloutEngine, SamplingParams
from rlcore.rollout.native.engine import NativeEngine, stop_token_ids
from rlcore.rollout.sampling import processed_logits, processed_logprobs, sample_tokens

__all__ = [
    "TOOLS",
    "AgentEngine",
    "NativeEngine",
    "RolloutEngine",
    "SamplingParams",
    "Tool",
    "ToolError",
    "ToolFormat",
    "calculator",
    "observe",
    "parse_tool_call",
    "processed_logits",
    "processed_logprobs",
    "python_tool",
    "run_agent",
    "sample_tokens",
    "stop_token_ids",
]
