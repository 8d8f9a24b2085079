"""The OpenAI wire format (serving/_protocol.py): requests bounded and validated with the field named,
responses and chunks readable by the official ``openai`` client's types, errors in OpenAI's shape."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import Completion, Model
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk
from openai.types.chat import completion_create_params as chat_params

from evocache.serving import (
    IGNORED_CHAT_FIELDS,
    IGNORED_COMPLETION_FIELDS,
    REFUSED_CHAT_FIELDS,
    REFUSED_COMPLETION_FIELDS,
    AssistantMessage,
    BadRequest,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    Limits,
    ModelCard,
    ModelList,
    RateLimited,
    Unauthenticated,
    Usage,
    error_response,
    parse_request,
)


def _body(**fields):
    return json.dumps(fields).encode()


def _chat(**extra):
    return _body(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def test_a_chat_request_parses_with_openai_defaults():
    request = parse_request(_chat(), "chat")
    assert isinstance(request, ChatCompletionRequest)
    assert (request.model, request.n, request.stream, request.stream_options, request.max_tokens) == (
        "m", 1, False, None, None,
    )  # fmt: skip
    assert request.messages[0].text() == "hi"


def test_chat_messages_take_every_text_role_and_text_parts():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "be kind"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "name": None, "tool_calls": []},
    ]  # fmt: skip
    body = _body(model="m", messages=messages, stream=True, stream_options={"include_usage": True})
    request = parse_request(body, "chat")
    assert [m.role for m in request.messages] == ["system", "developer", "user", "assistant"]
    assert request.messages[2].text() == "ab"
    assert request.stream and request.stream_options.include_usage


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_a_completion_prompt_is_text_or_tokens(prompt):
    request = parse_request(_body(model="m", prompt=prompt, max_tokens=16), "completion")
    assert isinstance(request, CompletionRequest)
    assert (request.prompt, request.max_tokens) == (prompt, 16)


def test_every_field_of_the_official_client_is_known():
    """The openai package's request fields are each declared, deliberately ignored or deliberately refused, so
    no call it makes is refused as an unknown field, and no field is both ignored and refused."""
    chat = set(typing.get_type_hints(chat_params.CompletionCreateParamsBase)) | {"stream"}
    completion = set(typing.get_type_hints(completion_params.CompletionCreateParamsBase)) | {"stream"}
    assert chat - set(ChatCompletionRequest.model_fields) - IGNORED_CHAT_FIELDS - set(REFUSED_CHAT_FIELDS) == set()
    assert completion - set(CompletionRequest.model_fields) - IGNORED_COMPLETION_FIELDS - set(
        REFUSED_COMPLETION_FIELDS) == set()
    assert IGNORED_CHAT_FIELDS.isdisjoint(REFUSED_CHAT_FIELDS)
    assert IGNORED_COMPLETION_FIELDS.isdisjoint(REFUSED_COMPLETION_FIELDS)


def test_ignored_openai_fields_are_dropped():
    request = parse_request(_chat(user="u-1", metadata={"a": "b"}, store=True, parallel_tool_calls=False),
                            "chat")
    assert "user" not in request.model_dump()


@pytest.mark.parametrize("field", sorted(REFUSED_CHAT_FIELDS))
def test_every_refused_chat_field_passes_when_it_asks_for_nothing(field):
    for neutral in (None, *REFUSED_CHAT_FIELDS[field]):
        assert isinstance(parse_request(_chat(**{field: neutral}), "chat"), ChatCompletionRequest)


@pytest.mark.parametrize("field", sorted(REFUSED_COMPLETION_FIELDS))
def test_every_refused_completion_field_passes_when_it_asks_for_nothing(field):
    for neutral in (None, *REFUSED_COMPLETION_FIELDS[field]):
        assert isinstance(parse_request(_body(model="m", prompt="x", **{field: neutral}), "completion"),
                          CompletionRequest)


@pytest.mark.parametrize(
    ("body", "kind", "param", "message"),
    [
        (_chat(max_token=5), "chat", "max_token", "max_token: unknown field"),
        (_body(model="m", prompt="x", echoo=True), "completion", "echoo", "echoo: unknown field"),
        (_chat(user_id="x"), "chat", "user_id", "user_id: unknown field"),
        (_body(model="m", messages=[{"role": "robot", "content": "x"}]), "chat", "messages[0].role", "Input"),
        (_body(model="m", messages=[{"role": "user", "content": [{"type": "text"}]}]), "chat",
         "messages[0].content[0].text", "Field required"),
        (_body(model="m", messages=[{"role": "user", "content": "x", "nam": "y"}]), "chat",
         "messages[0].nam", "unknown field"),
        (_body(model="m", messages=[{"role": "tool", "content": "x"}]), "chat", "messages[0]",
         "a tool message needs tool_call_id"),
        (_body(model="m", messages=[]), "chat", "messages", "at least 1 item"),
        (_body(messages=[{"role": "user", "content": "x"}]), "chat", "model", "Field required"),
        (_chat(max_tokens=0), "chat", "max_tokens", "greater than or equal to 1"),
        (_chat(temperature=3), "chat", "temperature", "less than or equal to 2"),
        (_chat(stream_options={"include_usage": "maybe"}), "chat", "stream_options.include_usage", "boolean"),
        (_body(model="m", prompt={"a": 1}), "completion", "prompt", "Input should be"),
    ],
)
def test_an_invalid_request_is_a_400_naming_the_field(body, kind, param, message):
    with pytest.raises(BadRequest) as caught:
        parse_request(body, kind)
    assert caught.value.param == param
    assert message in caught.value.message
    assert caught.value.message.startswith(param)
    assert caught.value.status == 400


LIMITS = Limits(max_body_bytes=2000, max_messages=3, max_prompt_chars=10, max_tokens=100)


@pytest.mark.parametrize(
    ("body", "kind", "param", "message"),
    [
        (b"x" * 2001, "chat", None, "request body of more than the 2000 bytes allowed"),
        (b"[1, 2]", "chat", None, "request body must be a JSON object"),
        (b"{not json", "chat", None, "request body is not valid JSON"),
        (b"[" * 1000 + b"]" * 1000, "chat", None, "request body"),
        (_body(model="m", messages=[{"role": "user", "content": "x"}] * 4), "chat", "messages",
         "messages: 4 messages, more than the 3 allowed"),
        (_body(model="m", messages=[{"role": "user", "content": "123456"}] * 2), "chat", "messages",
         "messages: 12 characters, more than the 10 allowed"),
        (_body(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 11}]}]),
         "chat",
         "messages", "11 characters"),
        (_body(model="m", prompt="x" * 11), "completion", "prompt", "prompt: 11 characters, more than"),
        (_body(model="m", prompt=[[1] * 6, [2] * 6]), "completion", "prompt", "prompt: 12 characters"),
        (_chat(max_tokens=101), "chat", "max_tokens", "max_tokens: 101 is more than the 100 allowed"),
        (_chat(max_completion_tokens=101), "chat", "max_completion_tokens", "101 is more than the 100"),
    ],
)
def test_sizes_are_bounded_with_the_field_named(body, kind, param, message):
    with pytest.raises(BadRequest) as caught:
        parse_request(body, kind, LIMITS)
    assert (caught.value.param, caught.value.status) == (param, 400)
    assert message in caught.value.message


def test_requests_at_the_bounds_pass():
    body = _body(model="m", messages=[{"role": "user", "content": "12345"}] * 2, max_tokens=100)
    assert len(parse_request(body, "chat", LIMITS).messages) == 2


USAGE = Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7)


def test_usage_reports_cached_prompt_tokens_zero_by_default():
    assert USAGE.model_dump()["prompt_tokens_details"] == {"cached_tokens": 0}


def test_a_completion_response_reads_as_the_clients_completion():
    response = CompletionResponse(
        id="cmpl-1", created=1, model="m", usage=USAGE,
        choices=[CompletionChoice(index=0, text="ok", finish_reason="stop")],
    )  # fmt: skip
    parsed = Completion.model_validate(response.model_dump())
    assert (parsed.object, parsed.choices[0].text, parsed.usage.prompt_tokens_details.cached_tokens) == (
        "text_completion", "ok", 0,
    )  # fmt: skip
    piece = CompletionChoice(index=0, text="o")
    chunk = CompletionResponse(id="cmpl-1", created=1, model="m", choices=[piece])
    assert chunk.model_dump(exclude_none=True) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "o"}],
    }  # fmt: skip


def test_a_chat_response_and_its_chunks_read_as_the_clients_types():
    response = ChatCompletionResponse(
        id="c-1", created=1, model="m", usage=USAGE,
        choices=[ChatChoice(index=0, message=AssistantMessage(content="ok"), finish_reason="stop")],
    )  # fmt: skip
    parsed = ChatCompletion.model_validate(response.model_dump())
    assert (parsed.object, parsed.choices[0].message.content, parsed.usage.total_tokens) == (
        "chat.completion", "ok", 7,
    )  # fmt: skip
    first = ChatCompletionChunk(
        id="c-1", created=1, model="m",
        choices=[ChunkChoice(index=0, delta=Delta(role="assistant", content="o"))],
    )
    last = ChatCompletionChunk(id="c-1", created=1, model="m", choices=[], usage=USAGE)
    assert OpenAIChunk.model_validate(first.model_dump()).choices[0].delta.content == "o"
    assert OpenAIChunk.model_validate(last.model_dump()).usage.prompt_tokens_details.cached_tokens == 0


def test_the_model_list_reads_as_the_clients_models():
    models = ModelList(data=[ModelCard(id="tiny-llama", created=1)])
    assert models.model_dump()["object"] == "list"
    assert Model.model_validate(models.model_dump()["data"][0]).id == "tiny-llama"


@pytest.mark.parametrize(
    ("error", "status", "expected"),
    [
        (BadRequest("max_tokens: too big", "max_tokens"), 400,
         {"message": "max_tokens: too big", "type": "invalid_request_error", "param": "max_tokens",
          "code": None}),
        (Unauthenticated("unknown API key"), 401,
         {"message": "unknown API key", "type": "invalid_request_error", "param": None,
          "code": "invalid_api_key"}),
        (RateLimited("slow down", 0.5), 429,
         {"message": "slow down", "type": "requests", "param": None, "code": "rate_limit_exceeded"}),
    ],
)  # fmt: skip
def test_errors_take_openais_shape(error, status, expected):
    assert error.status == status
    assert error_response(error).model_dump() == {"error": expected}
