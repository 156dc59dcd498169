"""Translation between OpenAI bodies and token ids: rendering chat messages, SamplingParams, and the choices
of a response built from recorded `Call`s. No I/O; the server (`rlcore.gateway.server`) calls these.

Rendering goes through the tokenizer's own chat template (`rlcore.rollout.agent.chat.ChatRenderer`), with the
request's `tools` as schemas; a completion's text is decoded from the sampled ids (special tokens
skipped, cut before a matched `stop` string, as OpenAI returns it), and tool calls are parsed from it
with rlcore's parser for the model's format (`rlcore.rollout.agent.chat.TOOL_CALL_FORMATS`). The sampled ids
themselves are what the gateway records: nothing here feeds back into training.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from rlcore.gateway.record import Call
from rlcore.gateway.schema import ApiError, ChatBody, CompletionBody, Message, SamplingBody
from rlcore.rollout.agent.chat import ChatRenderer, ToolCallFormat
from rlcore.rollout.base import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingLimits:
    """What bounds a request's sampling."""

    max_context: int
    """Prompt + completion tokens the model takes; a longer prompt is a 400, `max_tokens` is clamped to the room."""
    default_max_tokens: int = 256
    """`max_tokens` when a request gives none."""
    max_n: int = 64
    """Samples one request may ask (`n`); more is a 400 (one request must not fill the engine's batch)."""


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as chat-template messages: text parts joined, `developer` as `system`, tool-call
    arguments as dicts (as Hugging Face templates expect them)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "id": c.id, "function": {"name": c.function.name,
                                                              "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]  # fmt: skip
        if m.role == "tool":
            message |= {"name": m.name or "", "tool_call_id": m.tool_call_id}
        out.append(message)
    return out


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def uses_tools(body: ChatBody) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def chat_prompt(tokenizer: Any, body: ChatBody) -> list[int]:
    """The prompt ids of a chat request: its messages (and tools) through the model's chat template."""
    schemas = tuple(t.model_dump(exclude_none=True) for t in body.tools or ()) if uses_tools(body) else ()
    renderer, messages = ChatRenderer(tokenizer, schemas), template_messages(body.messages)
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise ApiError(400, "continue_final_message: the last message must be an assistant message",
                       "continue_final_message")  # fmt: skip
    try:
        if body.continue_final_message:
            return renderer.continued_ids(messages)
        if not body.add_generation_prompt:
            return renderer.encode(renderer.conversation_text(messages))
        return renderer.prompt_ids(messages)
    except Exception as e:  # jinja's raise_exception (an unsupported role), a template's own checks
        raise ApiError(
            400, f"the model's chat template cannot render these messages: {e}", "messages"
        ) from None


def text_prompt(tokenizer: Any, body: CompletionBody) -> list[int]:
    """The prompt ids of a completion request: token ids as given, or the text encoded (special tokens added)."""
    if isinstance(body.prompt, list):
        if not body.prompt or not all(0 <= i < len(tokenizer) for i in body.prompt):
            raise ApiError(
                400, f"prompt: token ids must be a non-empty list in [0, {len(tokenizer)})", "prompt"
            )
        return list(body.prompt)
    return list(tokenizer(body.prompt, add_special_tokens=True)["input_ids"])


def refuse_unsupported(body: SamplingBody) -> None:
    """400 for what this gateway does not sample (see `rlcore.gateway.schema`)."""
    if body.stream:
        raise ApiError(400, "stream: streaming is not supported by the rlcore gateway", "stream")
    if isinstance(body, ChatBody) and body.top_logprobs:
        raise ApiError(
            400, "top_logprobs: only the sampled token's log-prob is recorded (use 0)", "top_logprobs"
        )
    if isinstance(body, CompletionBody) and body.echo:
        raise ApiError(400, "echo: not supported", "echo")
    if isinstance(body, ChatBody) and any(isinstance(m.content, list) and m.content and
                                          any(p.type != "text" for p in m.content) for m in body.messages):  # fmt: skip
        raise ApiError(400, "messages: only text content parts are supported", "messages")


def sampling_of(body: SamplingBody, prompt_length: int, limits: SamplingLimits, *, field: str) -> SamplingParams:
    """The engine's SamplingParams for `body`; 400 when the prompt (`field`) leaves no room in the context or
    `n` is over `limits.max_n`."""
    room = limits.max_context - prompt_length
    if room < 1:
        raise ApiError(400, f"{field}: the prompt is {prompt_length} tokens; this model's maximum context "
                            f"length is {limits.max_context} tokens", field)  # fmt: skip
    if body.n > limits.max_n:
        raise ApiError(400, f"n: {body.n} samples asked; this gateway serves at most {limits.max_n} a request "
                            "(Gateway(max_n=...))", "n")  # fmt: skip
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > 4 or not all(stops):
        raise ApiError(400, "stop: at most 4 non-empty strings", "stop")
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens or limits.default_max_tokens
    return SamplingParams(
        n=body.n,
        max_tokens=min(asked, room),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop_strings=stops,
        seed=body.seed,
    )


def completion_text(tokenizer: Any, call: Call, stops: tuple[str, ...]) -> str:
    """The sampled ids decoded (special tokens skipped), cut before the first matched stop string."""
    text = tokenizer.decode(list(call.ids), skip_special_tokens=True)
    if call.finish_reason == "stop" and stops:
        ends = [text.find(s) for s in stops if s in text]
        text = text[: min(ends)] if ends else text
    return text


def chat_choice(index: int, call: Call, tokenizer: Any, sampling: SamplingParams, *,
                tool_format: ToolCallFormat | None, logprobs: bool) -> dict[str, Any]:  # fmt: skip
    """One `choices[i]` of a chat completion; with `tool_format`, parsed tool calls become `tool_calls`."""
    text = completion_text(tokenizer, call, sampling.stop_strings)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = call.finish_reason
    parsed = tool_format.parse(text) if tool_format and tool_format.marker in text else []
    good = [c for c in parsed if c.error is None]
    if good:
        message["content"] = text[: text.index(tool_format.marker)].strip() or None
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in good
        ]  # fmt: skip
        finish = "tool_calls"
    choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs:
        choice["logprobs"] = {"content": token_logprobs(tokenizer, call), "refusal": None}
    return choice


def token_logprobs(tokenizer: Any, call: Call) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`: one entry per sampled token (special tokens spelled out)."""
    out = []
    for token_id, logprob in zip(call.ids, call.logprobs, strict=True):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        out.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return out


def text_choice(
    index: int, call: Call, tokenizer: Any, sampling: SamplingParams, *, logprobs: bool
) -> dict[str, Any]:
    """One `choices[i]` of a (legacy) completion, with the legacy `logprobs` shape when asked."""
    choice = {"index": index, "text": completion_text(tokenizer, call, sampling.stop_strings),
              "finish_reason": call.finish_reason, "logprobs": None}  # fmt: skip
    if logprobs:
        tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in call.ids]
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(call.logprobs),
                              "top_logprobs": None, "text_offset": offsets}  # fmt: skip
    return choice


def usage(prompt_length: int, calls: list[Call]) -> dict[str, int]:
    completion = sum(len(c.ids) for c in calls)
    return {"prompt_tokens": prompt_length, "completion_tokens": completion,
            "total_tokens": prompt_length + completion}  # fmt: skip
