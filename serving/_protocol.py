"""The OpenAI wire format as pydantic models: requests, responses, streaming chunks, errors.

Requests are checked in steps. ``parse_request`` first bounds the work: the body's size; then, on the decoded
JSON and before any model is built, every value JSON can carry that no field takes (a string with a lone
surrogate, NaN or Infinity, a number beyond 64 bits), the number of messages and the prompt's characters; then
the models validate the fields, strictly (``max_tokens: true`` or ``"4"`` is not an integer); then fields that
would change the answer but that this server cannot honour are refused; last ``Limits`` bounds ``max_tokens``.
Every refusal is a ``BadRequest`` whose ``param`` names the field (``messages[2].content``), which
``error_response`` turns into OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body. The bounds
that need the tokenizer (token ids within the vocabulary, prompt tokens against the context) are the
ingress's (``serving._ingress``).

Fields OpenAI defines fall in three sets:

* declared by the models below and honoured;
* ``IGNORED_COMPLETION_FIELDS``, ``IGNORED_CHAT_FIELDS``: accepted and dropped, because they never change the
  answer (``user``, ``metadata``, ``store``, ...);
* ``REFUSED_COMPLETION_FIELDS``, ``REFUSED_CHAT_FIELDS``, ``REFUSED_MESSAGE_FIELDS``: they change the answer
  (``tools``, ``response_format``, ``logit_bias``, ``n``, a message's ``name``, ...) and the engine cannot
  honour them, so a request that asks for anything with one is refused naming it; absent, null or the value
  that asks for nothing (``n: 1``, ``tools: []``) passes. Serving such a request the plain request's answer
  would also file it under the plain request's cache entry.

With an upstream engine (``parse_upstream_request``) a fourth set, ``PASSED_CHAT_FIELDS`` or
``PASSED_COMPLETION_FIELDS`` with a message's refused fields and the deployment's own, reaches the engine as the
client sent it and is keyed. ``cache_salt`` is always refused: the tenant's salt comes from its key.

Any other name is refused with a 400 naming it, so a misspelt field (``max_token``) never silently does
nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError, BadRequest, BodyTooLarge


class Limits(BaseModel):
    """Bounds on a request: before parsing (body bytes, messages, prompt characters), after (``max_tokens``),
    after tokenising (``max_prompt_tokens``, ``None`` for no bound but the model's context), and in time
    (``request_timeout_s``: from the request's arrival to its answer, or a stream's first piece; past it the
    answer is a 504 and the replica's generation is cancelled). The default is the official client's own
    timeout, so the server gives up when such a client would; a deployment that serves long generations
    raises it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(1 << 20, ge=1)
    max_messages: int = Field(256, ge=1)
    max_prompt_chars: int = Field(200_000, ge=1)  # characters of text, or token ids of a tokenised prompt
    max_tokens: int = Field(8192, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)  # to receive the whole body, however slowly it trickles in


IGNORED_COMPLETION_FIELDS = frozenset({"user"})
IGNORED_CHAT_FIELDS = frozenset({
    "metadata", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "safety_identifier", "service_tier", "store", "user",
})  # fmt: skip

# Each refused field with the values that ask for nothing (null always does); any other value is refused.
REFUSED_COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "echo": (False,), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (),
    "n": (1,), "presence_penalty": (0, 0.0), "suffix": ("",),
}  # fmt: skip
REFUSED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "audio": (), "frequency_penalty": (0, 0.0), "function_call": ("none",), "functions": ([],),
    "logit_bias": ({},), "logprobs": (False,), "modalities": (["text"],), "moderation": (), "n": (1,),
    "prediction": (), "presence_penalty": (0, 0.0), "reasoning_effort": (), "response_format": ({"type": "text"},),
    "tool_choice": ("none",), "tools": ([],), "top_logprobs": (), "verbosity": (), "web_search_options": (),
}  # fmt: skip
# With an upstream engine (serving._upstream) these reach it as the client sent them, and are keyed; so do a
# message's REFUSED_MESSAGE_FIELDS. ``n`` and ``best_of`` stay refused: the replica serves one choice.
PASSED_CHAT_FIELDS = frozenset({
    "frequency_penalty", "logit_bias", "logprobs", "parallel_tool_calls", "presence_penalty", "reasoning_effort",
    "response_format", "tool_choice", "tools", "top_logprobs",
})  # fmt: skip
PASSED_COMPLETION_FIELDS = frozenset({
    "echo", "frequency_penalty", "logit_bias", "logprobs", "presence_penalty", "suffix",
})  # fmt: skip
# A message's name and tool calls would reach the model only through a chat template that renders them; the
# prompt is rendered from roles and text, so they are refused rather than dropped. A tool message answers a
# tool call, which this server never makes.
REFUSED_MESSAGE_FIELDS: dict[str, tuple[Any, ...]] = {"name": (), "tool_calls": ([],), "tool_call_id": ()}

INT64 = 1 << 63
_MAX_INT_DIGITS = 20  # a longer integer is beyond every field's range (the widest, seed, is 64 bits)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class CacheDirectives(_Strict):
    """The body's ``cache`` object (LiteLLM's shape): ``no-store`` (serve, don't store), ``no-cache`` (skip the
    lookup, store the fresh answer), ``ttl`` (seconds the stored answer lives, at most its rule's),
    ``s-maxage`` (an entry older than this is not served), ``namespace`` (a partition within the tenant,
    never across tenants: its own entries)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=False)

    no_store: bool = Field(False, alias="no-store")
    no_cache: bool = Field(False, alias="no-cache")
    ttl: float | None = Field(None, ge=0, allow_inf_nan=False)
    s_maxage: float | None = Field(None, alias="s-maxage", ge=0, allow_inf_nan=False)
    namespace: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")


class _Sampling(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool | None = False  # null as OpenAI allows: not streamed
    stream_options: StreamOptions | None = None
    cache: CacheDirectives | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
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
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


FinishReason = str  # "stop", "length", "content_filter"; an upstream engine's own too ("tool_calls")


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
) | frozenset(f.alias or name for name, f in CacheDirectives.model_fields.items())


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


def _member(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The location up to the union member an error is under (``("prompt", "list[int]")``), else all of it."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and part not in _FIELDS:
            return loc[: i + 1]
    return loc


def validation_error(exc: pydantic.ValidationError) -> BadRequest:
    """The 400 for a request that failed validation, naming the most specific field that failed, and of those
    the one in the union member the value came closest to (fewest errors): ``prompt: [1, true]`` is refused at
    ``prompt[1]``, not an integer, rather than at ``prompt[0]``, not a string."""
    errors = exc.errors()
    counts = Counter(_member(e["loc"]) for e in errors)
    error = min(errors, key=lambda e: (-len(e["loc"]), counts[_member(e["loc"])]))
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


class _Unfit:
    """A JSON number no field takes, kept in place of its value so the walk below can name where it was."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


def _float(text: str) -> float | _Unfit:
    value = float(text)
    return value if value not in (float("inf"), float("-inf")) else _Unfit(f"{text} is beyond a double")


def _int(text: str) -> int | _Unfit:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= _MAX_INT_DIGITS else _Unfit(f"an integer of {digits} digits, beyond 64 bits")


def _constant(name: str) -> _Unfit:
    return _Unfit(f"{name} is not a number JSON allows")


def _decode(body: bytes) -> Any:
    """The JSON document in ``body``, with NaN, Infinity, numbers beyond a double and integers beyond 64 bits
    left as ``_Unfit`` (``json.loads`` would take them, and the first two are not JSON)."""
    try:
        text = body.decode("utf-8")  # json.loads would also guess UTF-16 and UTF-32; only UTF-8 is read
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_values(document: dict[str, Any]) -> None:
    """Refuse a value no field can take (a lone surrogate, which is no Unicode text, or an ``_Unfit``
    number), naming its place. Iterative: the depth is ``json.loads``'s to bound, not this walk's."""
    todo: list[tuple[str, Any]] = [("", document)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                raise BadRequest(f"{path}: a lone surrogate (\\ud800-\\udfff) is not Unicode text", path)
        elif isinstance(value, _Unfit):
            raise BadRequest(f"{path}: {value.what}", path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_surrogate(key):
                    where = path or None
                    raise BadRequest(f"{path or 'request body'}: a field name with a lone surrogate", where)
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` asks for nothing: null, or one of ``neutral`` with its JSON type (``true`` is not 1)."""
    if value is None:
        return True
    text = json.dumps(value, sort_keys=True)
    return any(text == json.dumps(n, sort_keys=True) for n in neutral)


def _refusal(path: str, neutral: tuple[Any, ...]) -> BadRequest:
    allowed = " or ".join(["null", *(json.dumps(n) for n in neutral)])
    return BadRequest(f"{path}: not supported by this server (leave it out, or send {allowed})", path)


def _refuse_unsupported(document: dict[str, Any], kind: Literal["completion", "chat"],
                        passed: frozenset[str] = frozenset()) -> None:
    """Refuse each field that would change the answer and that this server cannot honour (module docstring),
    but those ``passed`` to an upstream engine. Runs on the validated document, so every value has its
    field's type."""
    refused = REFUSED_CHAT_FIELDS if kind == "chat" else REFUSED_COMPLETION_FIELDS
    for name, neutral in refused.items():
        if name not in passed and not _neutral(document.get(name), neutral):
            raise _refusal(name, neutral)
    if document.get("stream_options") is not None and document.get("stream") is not True:
        raise BadRequest("stream_options: only allowed with stream: true", "stream_options")
    message_fields = {} if passed else REFUSED_MESSAGE_FIELDS
    for i, message in enumerate(document.get("messages") or ()):
        for name, neutral in message_fields.items():
            if not _neutral(message.get(name), neutral):
                raise _refusal(f"messages[{i}].{name}", neutral)


def parse_request(
    body: bytes, kind: Literal["completion", "chat"], limits: Limits = Limits()
) -> CompletionRequest | ChatCompletionRequest:
    """The request in ``body`` (JSON) for ``/v1/completions`` or ``/v1/chat/completions``; ``BadRequest``
    naming the field when it is too large, invalid, or asks for what this server cannot honour."""
    return _parse(body, kind, limits, None)[0]


def parse_upstream_request(
    body: bytes, kind: Literal["completion", "chat"], limits: Limits = Limits(), extras: frozenset[str] = frozenset()
) -> tuple[CompletionRequest | ChatCompletionRequest, dict[str, Any]]:
    """As ``parse_request``, for an upstream engine: the fields it honours (``PASSED_CHAT_FIELDS`` or
    ``PASSED_COMPLETION_FIELDS``, a message's ``PASSED_MESSAGE_FIELDS``, and ``extras``, the deployment's own)
    are accepted, and returned as the client sent them with the prompt (``messages`` or ``prompt``): what
    goes upstream and into the key besides the sampling fields."""
    request, fields = _parse(body, kind, limits, extras)
    assert fields is not None
    return request, fields


def _parse(body: bytes, kind: Literal["completion", "chat"], limits: Limits,
           extras: frozenset[str] | None) -> tuple[CompletionRequest | ChatCompletionRequest, dict[str, Any] | None]:
    if len(body) > limits.max_body_bytes:
        raise BodyTooLarge(f"request body of more than the {limits.max_body_bytes} bytes allowed")
    document = _decode(body)
    if not isinstance(document, dict):
        raise BadRequest("request body must be a JSON object")
    _check_values(document)
    _bound(document, kind, limits)
    if document.get("cache_salt") is not None:
        raise BadRequest("cache_salt: set by the server from your API key's tenant; leave it out", "cache_salt")
    ignored = IGNORED_CHAT_FIELDS if kind == "chat" else IGNORED_COMPLETION_FIELDS
    refused = REFUSED_CHAT_FIELDS if kind == "chat" else REFUSED_COMPLETION_FIELDS
    passed: frozenset[str] = frozenset()
    if extras is not None:
        passed = (PASSED_CHAT_FIELDS if kind == "chat" else PASSED_COMPLETION_FIELDS) | extras
        ignored = ignored - passed
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    fields = {name: value for name, value in document.items() if name not in ignored and name != "cache_salt"
              and (name in model.model_fields or (name not in refused and name not in passed))}
    try:
        request = model.model_validate(fields)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from exc
    _refuse_unsupported(document, kind, passed)
    caps = [("max_tokens", request.max_tokens)]
    if isinstance(request, ChatCompletionRequest):
        caps.append(("max_completion_tokens", request.max_completion_tokens))
    for name, value in caps:
        if value is not None and value > limits.max_tokens:
            raise BadRequest(f"{name}: {value} is more than the {limits.max_tokens} allowed", name)
    if extras is None:
        return request, None
    upstream = {name: document[name] for name in sorted(passed) if document.get(name) is not None}
    prompt = "messages" if kind == "chat" else "prompt"
    upstream[prompt] = document[prompt]
    return request, upstream
