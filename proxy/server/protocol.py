"""OpenAI wire types (msgspec Structs) of Chat Completions and the Responses API, and nothing else.

The request types decode only what the proxy must read or validate; every field they do not
name is ignored by the decoder and survives in the raw body that is forwarded.
"""

from __future__ import annotations

from typing import Any

import msgspec


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCall(msgspec.Struct, omit_defaults=True):
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None
    index: int | None = None


class Message(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    function: FunctionDef
    type: str = "function"


class ChatCompletionRequest(msgspec.Struct, omit_defaults=True):
    """The fields of a chat-completions request that the proxy validates and reads."""

    messages: list[Message]
    model: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool | None = None
    n: int | None = None
    temperature: float | None = None
    seed: int | None = None


class ResponsesTool(msgspec.Struct, omit_defaults=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct, omit_defaults=True):
    """The fields of a Responses API request (`POST /v1/responses`) that the proxy validates and reads."""

    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool | None = None
    temperature: float | None = None
    previous_response_id: str | None = None


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(msgspec.Struct, omit_defaults=True):
    index: int = 0
    message: ResponseMessage | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, omit_defaults=True):
    """A non-streamed chat-completions response, as far as scoring needs it."""

    choices: list[Choice] = []
    id: str | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
responses_request_decoder = msgspec.json.Decoder(ResponsesRequest)
completion_decoder = msgspec.json.Decoder(ChatCompletion)
