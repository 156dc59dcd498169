"""Multi-turn rollouts over any engine (`loop.run_agent`): tools and their chat-template format, text
environments, the calls made concurrently with deadlines, images, and the batch assembled at the end."""

from rlcore.rollout.agent.loop import AgentEngine, observe, parse_tool_call, run_agent
from rlcore.rollout.agent.tools import TOOLS, Tool, ToolError, ToolFormat, calculator, python_tool

__all__ = [
    "TOOLS", "AgentEngine", "Tool", "ToolError", "ToolFormat", "calculator", "observe", "parse_tool_call",
    "python_tool", "run_agent",
]  # fmt: skip
