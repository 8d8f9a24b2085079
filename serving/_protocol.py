"""The OpenAI wire format as pydantic models: requests, responses, streaming chunks, errors.

Requests are checked in two steps. ``parse_request`` first bounds the work: the body's size, then (on the
decoded JSON, before any model is built) the number of messages and the prompt's characters; then the
model validates the fields and ``Limits`` bounds ``max_tokens``. Every refusal is a ``BadRequest`` whose
``param`` names the field (``messages[2].content``), which ``error_response`` turns into OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body.

Unknown top-level fields: OpenAI request fields that this server does not act on (``user``, ``metadata``,
``tools``, ...; listed in ``IGNORED_COMPLETION_FIELDS`` and ``IGNORED_CHAT_FIELDS``) are accepted and dropped,
so the official client's calls pass; any other name is refused with a 400 naming it, so a misspelt field
(``max_token``) never silently does nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError, BadRequest


@dataclass(frozen=True)
class Limits:
    """Bounds applied before and after parsing a request."""

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_prompt_chars: int = 200_000  # characters of text, or token ids of a tokenised prompt
    max_tokens: int = 8192


IGNORED_COMPLETION_FIELDS = frozenset({"best_of", "logit_bias", "suffix", "user"})
IGNORED_CHAT_FIELDS = frozenset({
    "audio", "function_call", "functions", "logit_bias", "metadata", "modalities", "moderation",
    "parallel_tool_calls", "prediction", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "service_tier", "store", "tool_choice",
    "tools", "user", "verbosity", "web_search_options",
})  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ContentPart(_Strict):
    """A part of a message's content; this text server reads text parts only."""

    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @pydantic.model_validator(mode="after")
    def _role_fields(self) -> Message:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


FinishReason = Literal["stop", "length", "content_filter"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """Both the whole answer and, with ``stream: true``, each chunk (OpenAI uses one type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


CompletionChunk = CompletionResponse


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE ``data:`` line; the usage-only final chunk has no choices and ``usage`` set."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "evocache"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_response(exc: ApiError) -> ErrorResponse:
    """OpenAI's error body for ``exc`` (its HTTP status is ``exc.status``)."""
    detail = ErrorDetail(message=exc.message, type=exc.error_type, param=exc.param, code=exc.code)
    return ErrorResponse(error=detail)


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for model in models for name in model.model_fields)


_FIELDS = _field_names(
    CompletionRequest, ChatCompletionRequest, Message, ContentPart, ToolCall, ToolCallFunction, StreamOptions
)


def _path(error: Any) -> str:
    """``messages[0].content`` from a pydantic error location, without the labels of union members."""
    loc = error["loc"]
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _FIELDS or (i == len(loc) - 1 and error["type"] == "extra_forbidden"):
            path += f".{part}" if path else part
    return path


def validation_error(exc: pydantic.ValidationError) -> BadRequest:
    """The 400 for a request that failed validation, naming the most specific field that failed."""
    error = max(exc.errors(), key=lambda e: len(e["loc"]))
    path = _path(error)
    if error["type"] == "extra_forbidden":
        message = f"{path}: unknown field"
    else:
        message = f"{path}: {error['msg']}" if path else error["msg"]
    return BadRequest(message, param=path or None)


def _prompt_size(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)
    return 0


def _message_size(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _bound(document: dict[str, Any], kind: Literal["completion", "chat"], limits: Limits) -> None:
    if kind == "chat":
        messages = document.get("messages")
        if isinstance(messages, list):
            if len(messages) > limits.max_messages:
                allowed = limits.max_messages
                count = len(messages)
                raise BadRequest(f"messages: {count} messages, more than the {allowed} allowed", "messages")
        size = sum(_message_size(m) for m in messages) if isinstance(messages, list) else 0
        param = "messages"
    else:
        size, param = _prompt_size(document.get("prompt")), "prompt"
    if size > limits.max_prompt_chars:
        allowed = limits.max_prompt_chars
        raise BadRequest(f"{param}: {size} characters, more than the {allowed} allowed", param)


def parse_request(
    body: bytes, kind: Literal["completion", "chat"], limits: Limits = Limits()
) -> CompletionRequest | ChatCompletionRequest:
    """The request in ``body`` (JSON) for ``/v1/completions`` or ``/v1/chat/completions``; ``BadRequest``
    naming the field when it is too large or invalid."""
    if len(body) > limits.max_body_bytes:
        raise BadRequest(f"request body of {len(body)} bytes, more than the {limits.max_body_bytes} allowed")
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise BadRequest("request body must be a JSON object")
    _bound(document, kind, limits)
    ignored = IGNORED_CHAT_FIELDS if kind == "chat" else IGNORED_COMPLETION_FIELDS
    fields = {name: value for name, value in document.items() if name not in ignored}
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate(fields)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from exc
    caps = [("max_tokens", request.max_tokens)]
    if isinstance(request, ChatCompletionRequest):
        caps.append(("max_completion_tokens", request.max_completion_tokens))
    for name, value in caps:
        if value is not None and value > limits.max_tokens:
            raise BadRequest(f"{name}: {value} is more than the {limits.max_tokens} allowed", name)
    return request
