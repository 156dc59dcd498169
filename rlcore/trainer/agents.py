"""The trainer's multi-turn rollout from the config: the environment, tools and agent files (loaded and
checked at start-up, before any model) and the agent loop, or the openai-client agent's gateway, around the
engine."""

from __future__ import annotations

import dataclasses
from typing import Any

from configs import Config
from rlcore.gateway import agents as gateway_agents
from rlcore.rollout.agent.chat import ChatTools, load_tools, renders_roles
from rlcore.rollout.agent.env import load_env
from rlcore.rollout.agent.loop import AgentEngine, EnvOptions


@dataclasses.dataclass(frozen=True)
class AgentFiles:
    """What `--rollout.env`, `--rollout.tools` and `--rollout.agent` name, loaded."""

    env: type | None
    tools: ChatTools | None
    agent: gateway_agents.Agent | None = None


def load_agent_files(cfg: Config) -> AgentFiles | None:
    """The loaded env class, tools and agent (None for a single-turn run); a bad file raises EnvSpecError."""
    r = cfg.rollout
    if not r.multi_turn and r.agent is None:
        return None
    return AgentFiles(load_env(r.env) if r.env else None, load_tools(r.tools) if r.tools else None,
                      gateway_agents.load_agent(r.agent) if r.agent else None)  # fmt: skip


def prompt_tools(files: AgentFiles | None, tokenizer: Any) -> tuple[dict, ...]:
    """The tool schemas the prompts are rendered with: the tools', when the template has a tool role."""
    if files is None or files.tools is None or not renders_roles(tokenizer, ("tool",)):
        return ()
    return files.tools.schemas


def agent_engine(
    cfg: Config, engine: Any, tokenizer: Any, files: AgentFiles | None, vision: Any = None
) -> Any:
    """`engine` wrapped in the agent loop when the rollout is multi-turn, else `engine`; `vision`: a
    vision-language policy's image processing (its prompts' and observations' images)."""
    if files is None:
        return engine
    r = cfg.rollout
    if files.agent is not None:
        return gateway_agents.GatewayAgentEngine(engine, tokenizer, files.agent, concurrency=r.agent_concurrency,
                                                 timeout_s=r.agent_timeout_s, failure_score=cfg.reward.failure_score,
                                                 call_format=r.tool_format)  # fmt: skip
    env = None
    if files.env is not None:
        env = EnvOptions(cls=files.env, failure_score=cfg.reward.failure_score)
    return AgentEngine(engine, tokenizer, max_turns=r.max_turns, chat_tools=files.tools, call_format=r.tool_format,
                       env=env, timeout_s=r.env_timeout_s, vision=vision)  # fmt: skip
