"""Hostile and mistaken requests against the OpenAI API, from outside: raw HTTP and the official ``openai``
client through the ASGI app, in front of a real ``ModelServer`` (the echo model, bytes as tokens).

Every client mistake is a 400 (415 for a body not declared JSON) in OpenAI's error shape naming the field; a
5xx, which the official client retries, is kept for the server's own faults.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from _serving_fixtures import ADMIN_DIGEST, CALLS, KEYS, echo_model, write_keys

from evocache.controller import EventsConfig, StoreConfig
from evocache.dsl import parse_policy
from evocache.serving import (
    AdminKeys,
    Api,
    ByteTokenizer,
    FileKeyStore,
    Limits,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    ServingConfig,
    build_fastapi,
    load_tokenizer,
)
from evocache.serving._model import CallableGenerator, GenerationParams

ACME = next(iter(KEYS))
AUTH = {"authorization": f"Bearer {ACME}"}
JSON = {"content-type": "application/json"}
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"


def _server(generator=None, model=None, tokenizer=None):
    model = model or ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model")
    spec = ServerSpec(model=model, store=StoreConfig(events=EventsConfig(sink="ring")), block_size=4)
    return ModelServer(spec, "replica-a", generator=generator or CallableGenerator(echo_model, "echo_model"),
                       tokenizer=tokenizer or ByteTokenizer())


@pytest.fixture
def make_api(tmp_path):
    """Builds an ``Api`` over one echo replica (keyword arguments go to ``Api``); closes the replicas."""
    servers = []

    def make(**options):
        server = options.pop("server", None) or _server()
        servers.append(server)
        options.setdefault("tokenizer", server.tokenizer)
        return Api(model_id=server.spec.model.id, model_revision="", backend=LocalBackend([server]),
                   keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4,
                   admin_keys=AdminKeys.from_hex([ADMIN_DIGEST]), **options)

    yield make
    for server in servers:
        server.close()


def _call(api, *requests):
    """Each ``(method, path, headers, content)`` sent to ``api``'s app in turn; the responses."""

    async def run():
        transport = httpx.ASGITransport(app=build_fastapi(api), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://evocache.test") as http:
            return [await http.request(method, path, headers=headers, content=content)
                    for method, path, headers, content in requests]

    return asyncio.run(run())


def _post(api, path, body, headers=None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    (response,) = _call(api, ("POST", path, headers if headers is not None else AUTH | JSON, content))
    return response


def _sdk(api, work, **options):
    """``work(client)`` with the official async client over ``api``'s app (no retries unless given)."""

    async def run():
        transport = httpx.ASGITransport(app=build_fastapi(api), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, **options.pop("http", {})) as http:
            client = openai.AsyncOpenAI(base_url="http://evocache.test/v1", api_key=ACME, http_client=http,
                                        **({"max_retries": 0} | options))
            return await work(client)

    return asyncio.run(run())


def _openai_error(response, status, param):
    """The response is ``status`` in OpenAI's error shape, naming ``param``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    return error


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return json.dumps({"model": "echo", "messages": USER} | fields).encode()


def completion(**fields):
    return json.dumps({"model": "echo", "prompt": "hi"} | fields).encode()


def raw(text):
    return text.encode()


# (endpoint, body, status, param): each body one mistake, and what it must be answered.
HOSTILE = [
    # text that is not Unicode: a lone surrogate, in every place text goes
    (CHAT, raw('{"model": "echo", "messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400,
     "messages[0].content"),
    (CHAT, raw('{"model": "echo", "messages": [{"role": "user", "content": [{"type": "text", '
               '"text": "\\udfff"}]}]}'), 400, "messages[0].content[0].text"),
    (COMPLETIONS, raw('{"model": "echo", "prompt": "\\udc00"}'), 400, "prompt"),
    (COMPLETIONS, raw('{"model": "echo", "prompt": "x", "stop": ["\\ud800"]}'), 400, "stop[0]"),
    (COMPLETIONS, raw('{"model": "\\ud800", "prompt": "x"}'), 400, "model"),
    (COMPLETIONS, raw('{"model": "echo", "prompt": "x", "\\ud800": 1}'), 400, None),
    # token ids outside the vocabulary (bytes: 0 to 255), negative, beyond 64 bits
    (COMPLETIONS, completion(prompt=[-1, 5]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[2**63]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[2**64]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[10**30]), 400, "prompt[0]"),
    (COMPLETIONS, completion(prompt=[256]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[[1, 2, 300]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1, True]), 400, "prompt[1]"),
    (COMPLETIONS, completion(prompt=[1.0]), 400, "prompt[0]"),
    # seeds beyond 64 bits, and not integers
    (COMPLETIONS, completion(seed=2**63), 400, "seed"),
    (COMPLETIONS, completion(seed=-(2**63) - 1), 400, "seed"),
    (COMPLETIONS, completion(seed=18446744073709551616000), 400, "seed"),
    (COMPLETIONS, completion(seed=1.5), 400, "seed"),
    (COMPLETIONS, completion(seed="7"), 400, "seed"),
    # numbers JSON has no room for
    (CHAT, raw('{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'), 400,
     "temperature"),
    (CHAT, raw('{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": Infinity}'),
     400, "temperature"),
    (CHAT, raw('{"model": "echo", "messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}'), 400,
     "top_p"),
    (CHAT, raw('{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}'), 400,
     "temperature"),
    (COMPLETIONS, raw('{"model": "echo", "prompt": "x", "max_tokens": 1e308}'), 400, "max_tokens"),
    (COMPLETIONS, raw('{"model": "echo", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), 400, "max_tokens"),
    (COMPLETIONS, raw('{"model": "echo", "prompt": "x", "stop": [NaN]}'), 400, "stop[0]"),
    # strict integers and booleans
    (COMPLETIONS, completion(max_tokens=True), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens="4"), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=4.0), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=10**9), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=False), 400, "max_completion_tokens"),
    (CHAT, chat(n=True), 400, "n"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream=1), 400, "stream"),
    (CHAT, chat(temperature="0.5"), 400, "temperature"),
    (CHAT, chat(temperature=True), 400, "temperature"),
    (CHAT, chat(temperature=-0.1), 400, "temperature"),
    (CHAT, chat(temperature=2.5), 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    # the model
    (CHAT, chat(model=None), 400, "model"),
    (CHAT, chat(model=5), 400, "model"),
    (CHAT, chat(model=""), 400, "model"),
    (CHAT, chat(model="other"), 400, "model"),
    (CHAT, chat(model=["echo"]), 400, "model"),
    # messages: empty, null, junk, bad roles, nested junk
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=None), 400, "messages"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages={"role": "user", "content": "hi"}), 400, "messages"),
    (CHAT, chat(messages=[None]), 400, "messages[0]"),
    (CHAT, chat(messages=["hi"]), 400, "messages[0]"),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"role": None, "content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"role": "USER", "content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0]"),
    (CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "messages[0]"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": {"text": "x"}}]), 400, "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [[["x"]]]}]), 400, "messages[0].content[0]"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0].type"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400,
     "messages[0].content[0].text"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "extra": {"deep": [1, [2, {"x": None}]]}}]), 400,
     "messages[0].extra"),
    # stop sequences
    (COMPLETIONS, completion(stop=5), 400, "stop"),
    (COMPLETIONS, completion(stop=[None]), 400, "stop[0]"),
    (COMPLETIONS, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (COMPLETIONS, completion(stop=[""]), 400, "stop"),
    (COMPLETIONS, completion(stop="x" * 257), 400, "stop"),
    # prompts of the wrong shape
    (COMPLETIONS, completion(prompt=None), 400, "prompt"),
    (COMPLETIONS, completion(prompt={"a": 1}), 400, "prompt"),
    (COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=True), 400, "prompt"),
    # fields that would change the answer, which the engine cannot honour: refused by name
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tools"),
    (CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    (CHAT, chat(function_call="auto"), 400, "function_call"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format"),
    (CHAT, chat(logit_bias={"50256": -100}), 400, "logit_bias"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(logprobs=True), 400, "logprobs"),
    (CHAT, chat(n=2), 400, "n"),
    (CHAT, chat(presence_penalty=0.5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-1), 400, "frequency_penalty"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    (CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    (CHAT, chat(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    (CHAT, chat(reasoning_effort="high"), 400, "reasoning_effort"),
    (CHAT, chat(verbosity="low"), 400, "verbosity"),
    (CHAT, chat(web_search_options={}), 400, "web_search_options"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(stream=False, stream_options={"include_usage": False}), 400, "stream_options"),
    (CHAT, chat(stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage"),
    (CHAT, chat(stream=True, stream_options={"chunks": True}), 400, "stream_options.chunks"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "name": "alice"}]), 400, "messages[0].name"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "name": ""}]), 400, "messages[0].name"),
    (CHAT, chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages[0].tool_calls"),
    (CHAT, chat(messages=[{"role": "tool", "content": "42", "tool_call_id": "c1"}]), 400,
     "messages[0].tool_call_id"),
    (COMPLETIONS, completion(suffix="after"), 400, "suffix"),
    (COMPLETIONS, completion(best_of=2), 400, "best_of"),
    (COMPLETIONS, completion(echo=True), 400, "echo"),
    (COMPLETIONS, completion(logprobs=0), 400, "logprobs"),
    (COMPLETIONS, completion(logit_bias={"1": 1}), 400, "logit_bias"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), 400, "stream_options"),
    # fields no one defines
    (COMPLETIONS, completion(tenant="globex"), 400, "tenant"),
    (CHAT, chat(max_token=5), 400, "max_token"),
    # bodies that are no request
    (CHAT, raw("[]"), 400, None),
    (CHAT, raw("null"), 400, None),
    (CHAT, raw('"chat"'), 400, None),
    (CHAT, raw("{"), 400, None),
    (CHAT, raw(""), 400, None),
    (CHAT, b"\xff\xfe{", 400, None),
    (CHAT, raw("[" * 100_000 + "]" * 100_000), 400, None),
    (CHAT, raw('{"model": "echo", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}"), 400, None),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), HOSTILE,
                         ids=[f"{i}-{param}" for i, (_, _, _, param) in enumerate(HOSTILE)])
def test_a_client_mistake_is_refused_in_openais_shape_naming_the_field(make_api, endpoint, body, status, param):
    _openai_error(_post(make_api(), endpoint, body), status, param)


# (endpoint, body): at the edge of what is allowed, each answered.
ALLOWED = [
    (CHAT, chat(temperature=None, top_p=None, seed=None, max_tokens=None, stop=None, n=None)),
    (CHAT, chat(temperature=1e-300, seed=2**63 - 1)),
    (CHAT, chat(seed=-(2**63), temperature=2, top_p=1)),
    (CHAT, chat(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={}, n=1,
                presence_penalty=0, frequency_penalty=0.0, logprobs=False, modalities=["text"])),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "name": None, "tool_calls": None}])),
    (CHAT, chat(stream=True, stream_options={"include_usage": True})),
    (CHAT, chat(stream_options=None, user="u-1", metadata={"k": "v"}, store=False, service_tier="auto")),
    (CHAT, chat(messages=[{"role": "user", "content": ""}])),
    (CHAT, chat(stream=None)),  # null, as OpenAI allows: not streamed
    (COMPLETIONS, completion(prompt=[0, 255], suffix="", best_of=1, echo=False, logit_bias={})),
    (COMPLETIONS, completion(prompt=[[104, 105]])),
    (COMPLETIONS, completion(prompt="")),
    (COMPLETIONS, completion(prompt="x\u00e9\U0001f600", max_tokens=1)),
]


@pytest.mark.parametrize(("endpoint", "body"), ALLOWED, ids=[str(i) for i in range(len(ALLOWED))])
def test_requests_at_the_edge_of_what_is_allowed_are_answered(make_api, endpoint, body):
    assert _post(make_api(), endpoint, body).status_code == 200


def test_the_official_client_gets_a_400_naming_each_refused_field(make_api):
    api = make_api()
    calls = {
        "tools": lambda c: c.chat.completions.create(model="echo", messages=USER, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
        "response_format": lambda c: c.chat.completions.create(model="echo", messages=USER,
                                                               response_format={"type": "json_object"}),
        "logit_bias": lambda c: c.chat.completions.create(model="echo", messages=USER, logit_bias={"7": 5}),
        "top_logprobs": lambda c: c.chat.completions.create(model="echo", messages=USER, top_logprobs=3),
        "stream_options": lambda c: c.chat.completions.create(model="echo", messages=USER,
                                                              stream_options={"include_usage": True}),
        "messages[0].name": lambda c: c.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi", "name": "alice"}]),
        "suffix": lambda c: c.completions.create(model="echo", prompt="hi", suffix="!"),
        "best_of": lambda c: c.completions.create(model="echo", prompt="hi", best_of=3),
    }

    async def each(client):
        params = {}
        for name, call in calls.items():
            try:
                await call(client)
            except openai.BadRequestError as exc:
                params[name] = (exc.status_code, exc.body["param"])
        return params

    assert _sdk(api, each) == {name: (400, name) for name in calls}


def test_a_repeated_authorization_header_is_a_400_on_every_route(make_api):
    api = make_api()
    twice = [("authorization", f"Bearer {ACME}"), ("authorization", "Bearer sk-someone-elses-key")]
    same_twice = [("authorization", f"Bearer {ACME}")] * 2
    for headers in (twice, same_twice):
        responses = _call(api, ("POST", COMPLETIONS, [*headers, ("content-type", "application/json")],
                                completion(temperature=0)),
                          ("GET", "/v1/models", headers, None), ("GET", "/metrics", headers, None),
                          ("GET", "/healthz", headers, None))
        for response in responses:
            _openai_error(response, 400, "Authorization")
    ok = _call(api, ("POST", COMPLETIONS, AUTH | JSON, completion(temperature=0)))
    assert ok[0].status_code == 200


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", "application/jsonx", "text/json",
])  # fmt: skip
def test_a_body_not_declared_json_is_a_415_in_openais_shape(make_api, content_type):
    headers = AUTH | ({"content-type": content_type} if content_type is not None else {})
    response = _post(make_api(), COMPLETIONS, completion(temperature=0), headers)
    assert _openai_error(response, 415, "Content-Type")["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8",
    'application/json; charset="utf-8"',
])  # fmt: skip
def test_json_with_or_without_a_utf8_charset_is_read(make_api, content_type):
    response = _post(make_api(), COMPLETIONS, completion(temperature=0), AUTH | {"content-type": content_type})
    assert response.status_code == 200


def test_the_official_client_raises_a_415_as_a_status_error_and_does_not_retry_it(make_api):
    sent = []

    async def count(request):
        sent.append(request.url.path)

    async def call(client):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.completions.create(model="echo", prompt="hi", extra_headers={"Content-Type": "text/plain"})
        return caught.value

    error = _sdk(make_api(), call, max_retries=2, http={"event_hooks": {"request": [count]}})
    assert (error.status_code, error.body["param"], error.body["code"]) == (415, "Content-Type",
                                                                           "unsupported_media_type")
    assert sent == ["/v1/completions"]


# -- the bound in tokens ---------------------------------------------------------------------------------

CONTEXT = 64


def _words(n_bytes):
    """A prompt of exactly ``n_bytes`` bytes (and so as many byte tokens)."""
    text = ("word " * n_bytes)[:n_bytes]
    assert len(ByteTokenizer().encode(text)) == n_bytes
    return text


def test_prompt_tokens_and_max_tokens_are_bounded_by_the_context(make_api):
    api = make_api(context_tokens=CONTEXT)
    at_bound = _post(api, COMPLETIONS, completion(prompt=_words(CONTEXT - 8), max_tokens=8, temperature=0))
    assert at_bound.status_code == 200
    error = _openai_error(_post(api, COMPLETIONS, completion(prompt=_words(CONTEXT - 8), max_tokens=9)), 400,
                          "max_tokens")
    assert f"context of {CONTEXT} tokens" in error["message"]
    _openai_error(_post(api, COMPLETIONS, completion(prompt=_words(CONTEXT))), 400, "prompt")
    _openai_error(_post(api, COMPLETIONS, completion(prompt=[104] * CONTEXT)), 400, "prompt")
    prompt = ByteTokenizer().render_chat([("user", "")])
    near = [{"role": "user", "content": _words(CONTEXT - len(prompt) - 4)}]
    assert _post(api, CHAT, chat(messages=near, max_completion_tokens=4)).status_code == 200
    _openai_error(_post(api, CHAT, chat(messages=near, max_completion_tokens=5)), 400, "max_completion_tokens")
    _openai_error(_post(api, CHAT, chat(messages=near, max_tokens=5)), 400, "max_tokens")
    _openai_error(_post(api, CHAT, chat(messages=[{"role": "user", "content": _words(CONTEXT)}])), 400,
                  "messages")


def test_without_max_tokens_the_default_is_cut_to_the_room_the_context_leaves(make_api):
    api = make_api(context_tokens=CONTEXT, default_max_tokens=CONTEXT)
    room = 5
    response = _post(api, COMPLETIONS, completion(prompt=_words(CONTEXT - room), temperature=0))
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["completion_tokens"] == room and body["choices"][0]["finish_reason"] == "length"


def test_max_prompt_tokens_bounds_the_prompt_in_tokens(make_api):
    api = make_api(limits=Limits(max_prompt_tokens=16))
    assert _post(api, COMPLETIONS, completion(prompt=_words(16), temperature=0)).status_code == 200
    error = _openai_error(_post(api, COMPLETIONS, completion(prompt=_words(17))), 400, "prompt")
    assert "more than the 16 allowed" in error["message"]
    # a character is several tokens: the character limit alone would let this one through
    assert len("\U0001f600" * 5) <= Limits().max_prompt_chars
    _openai_error(_post(api, CHAT, chat(messages=[{"role": "user", "content": "\U0001f600" * 5}])), 400,
                  "messages")


GLOBEX = next(key for key, (tenant, _) in KEYS.items() if tenant == "globex")
TENANT_BOUNDS = """\
policy: bounds
version: 1
tenants:
  default: {max_prompt_tokens: 12}
  acme: {rate: 1000}
  globex: {max_prompt_tokens: 40}
"""


def test_a_tenants_max_prompt_tokens_in_the_policy_bounds_its_prompts(make_api):
    api = make_api(limits=Limits(max_prompt_tokens=20))
    globex = {"authorization": f"Bearer {GLOBEX}"} | JSON
    assert _post(api, COMPLETIONS, completion(prompt=_words(13), temperature=0)).status_code == 200
    api.set_policy(parse_policy(TENANT_BOUNDS))  # what the ingress does with each version it follows
    CALLS.clear()
    # acme's own entry sets no bound: the default entry's, tighter than the deployment's (as a rate falls back)
    assert _post(api, COMPLETIONS, completion(prompt=_words(12), temperature=0)).status_code == 200
    error = _openai_error(_post(api, COMPLETIONS, completion(prompt=_words(13))), 400, "prompt")
    assert "13 tokens, more than the 12 allowed" in error["message"]
    long_chat = [{"role": "user", "content": _words(12)}]  # rendered with its role: more than 12 tokens
    error = _openai_error(_post(api, CHAT, chat(messages=long_chat)), 400, "messages")
    assert "more than the 12 allowed" in error["message"]
    # globex's own bound is looser than the deployment's: the deployment's applies
    assert _post(api, COMPLETIONS, completion(prompt=_words(20), temperature=0), globex).status_code == 200
    error = _openai_error(_post(api, COMPLETIONS, completion(prompt=_words(21)), globex), 400, "prompt")
    assert "21 tokens, more than the 20 allowed" in error["message"]
    assert CALLS == [_words(12), _words(20)]  # the refused requests reached no replica
    # a version without the bounds lifts them
    api.set_policy(parse_policy(TENANT_BOUNDS.replace("version: 1", "version: 2").split("tenants:")[0]))
    assert _post(api, COMPLETIONS, completion(prompt=_words(13), temperature=0)).status_code == 200


def test_the_context_comes_from_the_models_config_or_the_setting():
    config = json.loads((EXAMPLE / "config.json").read_text())
    hf = ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm")
    assert hf.context_length() == config["max_position_embeddings"]
    assert hf.model_copy(update={"context_tokens": 100}).context_length() == 100
    echo = ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model")
    assert echo.context_length() is None
    assert ModelConfig(kind="callable", id="echo", callable="m:f", context_tokens=512).context_length() == 512


def test_a_serving_config_takes_the_limits():
    config = ServingConfig.model_validate({
        "server": {"model": {"kind": "callable", "id": "echo", "callable": "m:f", "context_tokens": 4096}},
        "api_keys": {"file": "keys.yaml"}, "limits": {"max_prompt_tokens": 1000},
    })  # fmt: skip
    assert config.limits == Limits(max_prompt_tokens=1000)
    assert config.server.model.context_length() == 4096
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        ServingConfig.model_validate({"server": {"model": {"kind": "callable", "id": "e", "callable": "m:f"}},
                                      "api_keys": {"file": "k"}, "limits": {"max_prompt_tokens": 0}})


# -- a callable's answer within max_tokens ---------------------------------------------------------------

PROMPT = "one two three four five six seven eight nine ten"


def _within(text, budget, tokenizer):
    """The longest prefix of ``text`` within ``budget`` tokens."""
    return max((text[:i] for i in range(len(text) + 1) if len(tokenizer.encode(text[:i])) <= budget), key=len)


def test_a_callables_answer_stops_at_max_tokens_with_finish_reason_length(make_api):
    api = make_api()
    whole = "".join(echo_model(PROMPT, 8))  # the echo model's 8 words: more than 8 byte tokens
    assert len(ByteTokenizer().encode(whole)) > 8
    expected = _within(whole, 8, ByteTokenizer())
    body = _post(api, COMPLETIONS, completion(prompt=PROMPT, max_tokens=8, temperature=0)).json()
    assert body["choices"][0] == {"index": 0, "text": expected, "finish_reason": "length"}
    assert body["usage"]["completion_tokens"] == 8

    async def stream(client):
        pieces = []
        async for event in await client.completions.create(model="echo", prompt=PROMPT + " again", max_tokens=8,
                                                           temperature=0, stream=True):
            pieces += [(choice.text, choice.finish_reason) for choice in event.choices]
        return pieces

    pieces = _sdk(api, stream)
    assert "".join(text for text, _ in pieces) == _within("".join(echo_model(PROMPT + " again", 8)), 8,
                                                          ByteTokenizer())
    assert pieces[-1][1] == "length"


def test_a_callable_that_ignores_max_tokens_is_cut_by_the_deployments_tokenizer():
    tokenizer = load_tokenizer("minilm")
    answer = "the cache answers from memory when it can, and asks the model when it must. " * 3

    def chatty(prompt):  # returns its whole answer, whatever max_tokens says
        return answer

    generator = CallableGenerator(chatty, "chatty", tokenizer)
    for budget in (1, 7, 20):
        text = "".join(generator.stream("q", [], GenerationParams(budget, 0.0, 1.0, None, ())))
        assert text == _within(answer, budget, tokenizer)
        assert len(tokenizer.encode(text)) == budget


# -- the example Hugging Face model ----------------------------------------------------------------------


@pytest.mark.slow  # builds the example tiny Llama
def test_the_hugging_face_model_refuses_ids_beyond_its_vocabulary_and_prompts_beyond_its_context(make_api):
    model = ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm")
    spec = ServerSpec(model=model, store=StoreConfig(events=EventsConfig(sink="ring")))
    server = ModelServer(spec, "hf-replica")
    api = make_api(server=server, context_tokens=model.context_length())
    vocab = server.tokenizer.vocab_size
    _openai_error(_post(api, COMPLETIONS, {"model": "tiny-llama", "prompt": [5, vocab]}), 400, "prompt")
    _openai_error(_post(api, COMPLETIONS, {"model": "tiny-llama", "prompt": [5] * model.context_length()}), 400,
                  "prompt")
    # a temperature just above 0 samples as greedy decoding does, rather than overflowing
    tiny = _post(api, COMPLETIONS, {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4,
                                    "temperature": 1e-300, "seed": 1})
    greedy = _post(api, COMPLETIONS, {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4,
                                      "temperature": 0})
    assert tiny.status_code == greedy.status_code == 200
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_a_compressed_or_non_utf8_body_is_refused_by_name(make_api):
    api = make_api()
    gzip = _post(api, COMPLETIONS, completion(temperature=0), AUTH | JSON | {"content-encoding": "gzip"})
    assert _openai_error(gzip, 415, "Content-Encoding")["code"] == "unsupported_media_type"
    plain = _post(api, COMPLETIONS, completion(temperature=0), AUTH | JSON | {"content-encoding": "identity"})
    assert plain.status_code == 200
    utf16 = _post(api, COMPLETIONS, completion(temperature=0).decode().encode("utf-16"), AUTH | JSON)
    assert utf16.status_code == 400 and "not UTF-8" in utf16.json()["error"]["message"]
