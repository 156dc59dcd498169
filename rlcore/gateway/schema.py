"""The OpenAI request bodies the gateway accepts (validated by pydantic), and the errors it answers.

Only the fields that change what is sampled or returned are declared; anything else an OpenAI client
sends (`user`, `metadata`, `frequency_penalty` at its default...) is ignored. A field that would need
sampling the engine does not do is refused with a 400 naming it (`stream`, `top_logprobs` > 0, `echo`,
image parts), rather than silently answered with something else.

Every error body has OpenAI's shape, so `openai` clients raise their usual `BadRequestError` /
`AuthenticationError` with `e.body == {"message", "type", "param", "code"}`:

    {"error": {"message": "temperature: Input should be greater than or equal to 0",
               "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request


class ApiError(Exception):
    """A request the gateway refuses: HTTP `status`, a one-line `message`, the offending field `param`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.param, exc.kind), status_code=exc.status)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's first error as a 400; `param` is the top-level field (None for a body that is not JSON)."""
    first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request body"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc and not loc[0].isdigit() else None
    where = ".".join(loc) if param else "request body"
    body = error_body(f"{where}: {first.get('msg', 'invalid')}", param)
    return JSONResponse(jsonable_encoder(body), status_code=400)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallSpec(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallSpec] | None = None
    tool_call_id: str | None = None


class SamplingBody(_Body):
    """What every endpoint shares: the model name (any is accepted) and the sampling fields."""

    model: str = ""
    n: int = Field(1, ge=1)
    """At most `rlcore.gateway.translate.SamplingLimits.max_n`."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    continue_final_message: bool = False
    """vLLM's extension (`extra_body`): the last message is an assistant message the model goes on writing
    (rendered without its end of turn and without a generation prompt)."""
    add_generation_prompt: bool = True
    """vLLM's extension: end the prompt with the assistant's generation prompt (ignored when continuing)."""


class CompletionBody(SamplingBody):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
