"""Multi-turn through the model's chat template: tools from a file, their calls in the template's format,
every observation rendered by the template as the next messages.

    tools = load_tools("my_tools.py")                     # public functions -> JSON schemas
    renderer = ChatRenderer(tokenizer, tools.schemas)
    renderer.prompt_ids(messages)                          # apply_chat_template(..., tools=schemas)
    renderer.observation_ids(new_messages, sampled_text)   # only the new messages' tokens
    TOOL_CALL_FORMATS["hermes"].parse(text)               # [ToolCall(name, arguments, error)]

Observation tokens come from rendering the new messages alone, after a fixed two-message anchor
conversation (`[user, assistant(ANCHOR)]`): the text after the anchor's content is the closing of an
assistant turn, the new messages and the next generation prompt. What the model already sampled of
that closing (its end-of-turn token) is cut, so the sampled tokens are never re-encoded. Whether the
template is prefix-stable for a conversation (re-rendering it whole gives the tokens the policy saw;
Qwen3, which drops past `<think>` blocks, is not) is `ChatRenderer.reencodes`, reported as the
metric `agent/retokenize_mismatch`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcore.rewards.custom import import_file
from rlcore.rollout.agent.env import EnvSpecError, Message

TOOLS_FLAG = "--rollout.tools"
ANCHOR = "rlcore-anchor-c0ntent"
"""The content of the anchor assistant message; any text a template keeps verbatim would do."""
_ANCHOR_TURNS = ({"role": "user", "content": "rlcore-anchor-user"}, {"role": "assistant", "content": ANCHOR})


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: `error` is set (and name/arguments may be empty) when it could not be parsed."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: `marker` in a turn's text means the turn calls tools."""

    marker: str
    parse: Callable[[str], list[ToolCall]]


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """The calls `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of `text` (Hermes, Qwen2.5/3)."""
    calls = []
    for match in _HERMES_CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall("", {}, "unclosed <tool_call>: end it with </tool_call>"))
            continue
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"invalid tool call JSON ({e.msg} at char {e.pos})"))
            continue
        calls.append(_checked_call(payload))
    return calls


def _checked_call(payload: Any) -> ToolCall:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall("", {}, 'a tool call is {"name": "...", "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(payload["name"], {}, "the tool call's 'arguments' must be a JSON object")
    return ToolCall(payload["name"], arguments)


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(marker="<tool_call>", parse=parse_hermes),
}
"""Tool-call formats by name (`--rollout.tool-format`); add an entry for a model that writes others."""


@dataclasses.dataclass(frozen=True)
class ChatTools:
    """The tools of `--rollout.tools`: functions by name and their JSON schemas for the template."""

    functions: dict[str, Callable[..., Any]]
    schemas: tuple[dict[str, Any], ...]


def load_tools(spec: str) -> ChatTools:
    """The public functions defined in the file `spec`, with schemas from their signatures and docstrings
    (transformers' `get_json_schema`: type hints and a Google-style `Args:` section)."""
    from transformers.utils import get_json_schema

    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise EnvSpecError(f"{TOOLS_FLAG} {spec!r}: file {path} not found")
    module = import_file(TOOLS_FLAG, spec, path, EnvSpecError)
    functions = {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == module.__name__
    }
    if not functions:
        raise EnvSpecError(
            f"{TOOLS_FLAG} {spec!r}: {path.name} defines no public function to offer as a tool"
        )
    schemas = []
    for name, fn in functions.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # transformers' docstring / type-hint errors
            detail = " ".join(str(e).split())
            raise EnvSpecError(f"{TOOLS_FLAG} {spec!r}: tool {name!r}: {detail} (a tool needs type hints and a "
                               "docstring with an Args: line per parameter)") from None  # fmt: skip
    return ChatTools(functions, tuple(schemas))


def call_tool(tools: ChatTools, call: ToolCall, *, max_chars: int) -> tuple[Message, bool]:
    """(the `tool` message answering `call`, whether it is an error); a failing tool is an observation."""
    try:
        if call.error is not None:
            raise ValueError(call.error)
        if call.name not in tools.functions:
            raise ValueError(f"unknown tool {call.name!r}; tools: {', '.join(sorted(tools.functions))}")
        result = tools.functions[call.name](**call.arguments)
        content = result if isinstance(result, str) else json.dumps(result, default=str)
        error = False
    except Exception as e:
        content, error = f"error: {e}" if str(e) else f"error: {type(e).__name__}", True
    if len(content) > max_chars:
        content = content[:max_chars] + "..."
    return {"role": "tool", "name": call.name, "content": content}, error


@dataclasses.dataclass(frozen=True)
class ChatRenderer:
    """Renders prompts, observations and whole conversations with the tokenizer's chat template."""

    tokenizer: Any
    schemas: tuple[dict[str, Any], ...] = ()

    def _render(self, messages: list[Message], *, generation_prompt: bool, continued: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=list(self.schemas) or None,
            add_generation_prompt=generation_prompt,
            continue_final_message=continued,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        """The token ids of rendered text (the template wrote its special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_text(self, messages: list[Message]) -> str:
        """`messages` rendered with the generation prompt."""
        return self._render(messages, generation_prompt=True)

    def conversation_text(self, messages: list[Message]) -> str:
        """`messages` rendered whole, without a generation prompt."""
        return self._render(messages, generation_prompt=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The tokens of `messages` with the generation prompt (the context of the first turn)."""
        return self.encode(self.prompt_text(messages))

    def continued_ids(self, messages: list[Message]) -> list[int]:
        """The tokens of `messages` whose last, an assistant message, the model goes on writing (transformers'
        `continue_final_message`: no end of turn after it, no generation prompt)."""
        return self.encode(self._render(messages, generation_prompt=False, continued=True))

    def observation_text(self, messages: list[Message], sampled_text: str) -> str:
        """The text that follows a turn whose decoded tokens (special tokens kept) are `sampled_text`:
        the rest of the assistant turn's closing, `messages`, the next generation prompt."""
        text = self._render([*_ANCHOR_TURNS, *messages], generation_prompt=True)
        tail = text[text.rindex(ANCHOR) + len(ANCHOR) :]
        done = next(
            (k for k in range(min(len(tail), len(sampled_text)), 0, -1) if sampled_text.endswith(tail[:k])), 0
        )
        return tail[done:]

    def observation_ids(self, messages: list[Message], sampled_text: str) -> list[int]:
        return self.encode(self.observation_text(messages, sampled_text))

    def reencodes(self, messages: list[Message], token_ids: list[int]) -> bool:
        """Whether rendering `messages` whole (assistant turns as their decoded text) and encoding it gives
        `token_ids` (the context the policy saw) as a prefix: the template is prefix-stable here."""
        rendered = self.encode(self.conversation_text(messages))
        return rendered[: len(token_ids)] == token_ids


def renders_roles(tokenizer: Any, roles: tuple[str, ...]) -> bool:
    """Whether `tokenizer` has a chat template that renders messages of `roles` verbatim after an
    assistant turn (what the agent loop's observations need)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = [{"role": role, "name": "probe", "content": f"probe-{role}"} for role in roles]
    try:
        text = ChatRenderer(tokenizer)._render([*_ANCHOR_TURNS, *probe], generation_prompt=True)
    except Exception:  # jinja's raise_exception for an unknown role, and the like
        return False
    tail = text.split(ANCHOR)[-1] if ANCHOR in text else ""
    return all(f"probe-{role}" in tail for role in roles)
