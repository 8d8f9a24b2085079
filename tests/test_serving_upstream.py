"""The gateway's own logic in front of an OpenAI-compatible upstream, against a stand-in upstream
(tests/_fake_upstream.py): what is keyed, what passes through and what is refused, the tenant's salt, the
upstream's key, and how each upstream failure is answered. The same behaviour against a real vLLM is in
tests/test_upstream_vllm.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _fake_upstream import UPSTREAM_KEY, FakeUpstream
from _helpers import free_port
from _serving_fixtures import KEYS, UvicornThread, write_keys

from evocache.controller import EventsConfig, StoreConfig, entry_secret
from evocache.serving import Api, FileKeyStore, LocalBackend, ModelConfig, ModelServer, ServerSpec, build_fastapi
from evocache.serving._protocol import Limits
from evocache.serving import upstream_model
from evocache.serving._upstream import UpstreamConfig, tenant_salt
from evocache.serving.errors import ServingConfigError

ACME, GLOBEX = list(KEYS)
MODEL = "up-model"


@pytest.fixture
def upstream():
    fake = FakeUpstream(MODEL)
    with UvicornThread(fake.app) as http:
        fake.url = f"{http.url}/v1"
        yield fake
    fake.released.set()


@pytest.fixture
def gateway(tmp_path, upstream, monkeypatch):
    monkeypatch.setenv("EVOCACHE_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    store = StoreConfig(events=EventsConfig(sink="ring"))
    config = UpstreamConfig(url=upstream.url, api_key_env="EVOCACHE_TEST_UPSTREAM_KEY", read_timeout_s=1.0,
                            fields=("top_k",))
    spec = ServerSpec(model=ModelConfig(kind="upstream", id=MODEL, upstream=config), store=store, block_size=4)
    server = ModelServer(spec, "replica-a")
    api = Api(model_id=MODEL, model_revision="", tokenizer=server.tokenizer, backend=LocalBackend([server]),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4,
              upstream_fields=frozenset(config.fields), limits=Limits(request_timeout_s=30))
    with UvicornThread(build_fastapi(api)) as http:
        http.api, http.model_server, http.spec = api, server, spec
        yield http
    server.close()


def client(http, key=ACME):
    return openai.OpenAI(base_url=f"{http.url}/v1", api_key=key, max_retries=0)


def chat(http, content, key=ACME, **extra):
    return client(http, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=8, **extra)


def test_a_miss_goes_upstream_once_and_its_repeat_is_a_hit_with_the_same_answer(gateway, upstream):
    first = chat(gateway, "one two three")
    again = chat(gateway, "one two three")
    assert first.headers["x-evocache-outcome"] == "miss" and again.headers["x-evocache-outcome"] == "hit"
    a, b = first.parse(), again.parse()
    assert a.choices[0].message.content == b.choices[0].message.content == "three two one"
    assert upstream.calls("one two three") == 1
    # The upstream's usage on the miss (its own cached count), the whole prompt cached on the hit.
    assert (a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.prompt_tokens_details.cached_tokens) == (7, 3, 3)
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens == 7
    sent = upstream.bodies[-1]
    assert sent["model"] == MODEL and sent["stream"] is True and sent["max_completion_tokens"] == 8
    assert sent["messages"] == [{"role": "user", "content": "one two three"}]
    # The upstream's key, never the client's.
    assert upstream.headers[-1]["authorization"] == f"Bearer {UPSTREAM_KEY}"


def test_a_streamed_hit_replays_the_first_stream_and_completions_work_too(gateway, upstream):
    c = client(gateway)
    first = [x.choices[0].delta.content for x in c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "red green blue"}], temperature=0, max_tokens=8,
        stream=True) if x.choices]
    again = [x.choices[0].delta.content for x in c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "red green blue"}], temperature=0, max_tokens=8,
        stream=True) if x.choices]
    assert first == again and "".join(p for p in first if p) == "blue green red"
    assert upstream.calls("red green blue") == 1
    plain = c.completions.create(model=MODEL, prompt="alpha beta", temperature=0, max_tokens=8)
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model=MODEL, prompt="alpha beta", temperature=0, max_tokens=8, stream=True) if x.choices)
    assert plain.choices[0].text == streamed == "beta alpha"
    assert upstream.calls("alpha beta") == 1  # a stream and a plain call share the entry
    assert upstream.bodies[-1]["prompt"] == "alpha beta" and upstream.bodies[-1]["max_tokens"] == 8


def test_each_tenant_sends_its_own_salt_and_never_gets_anothers_entry(gateway, upstream):
    chat(gateway, "same prompt here", key=ACME)
    other = chat(gateway, "same prompt here", key=GLOBEX)
    assert other.headers["x-evocache-outcome"] == "miss"
    salts = [b["cache_salt"] for b in upstream.bodies]
    secret = entry_secret(gateway.spec.store)
    assert salts == [tenant_salt(secret, "acme"), tenant_salt(secret, "globex")]
    assert salts[0] != salts[1] and "acme" not in salts[0]


def test_a_clients_own_cache_salt_is_refused(gateway, upstream):
    r = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "cache_salt": "acme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert upstream.calls() == 0


def test_fields_that_change_the_answer_pass_through_and_are_keyed(gateway, upstream):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = chat(gateway, "tool weather please")
    with_tools = chat(gateway, "tool weather please", tools=tools, tool_choice="auto")
    assert plain.headers["x-evocache-outcome"] == with_tools.headers["x-evocache-outcome"] == "miss"
    assert upstream.bodies[-1]["tools"] == tools and upstream.bodies[-1]["tool_choice"] == "auto"
    answer = with_tools.parse().choices[0]
    assert answer.finish_reason == "tool_calls"
    call = answer.message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("call_1", "get_weather",
                                                                                  {"city": "Oslo"})
    hit = chat(gateway, "tool weather please", tools=tools, tool_choice="auto")
    assert hit.headers["x-evocache-outcome"] == "hit"
    assert hit.parse().choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    # Streamed, the tool call arrives as the upstream's deltas, replayed from the entry.
    deltas = [x.choices[0].delta for x in client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tool weather please"}], temperature=0, max_tokens=8,
        tools=tools, tool_choice="auto", stream=True) if x.choices]
    arguments = "".join(d.tool_calls[0].function.arguments for d in deltas if d.tool_calls)
    assert json.loads(arguments) == {"city": "Oslo"}
    assert upstream.calls("tool weather please") == 2
    # A deployment's own field (vLLM's top_k) passes through and is keyed; an unknown one is refused by name.
    chat(gateway, "one two three", extra_body={"top_k": 5})
    assert upstream.bodies[-1]["top_k"] == 5
    with pytest.raises(openai.BadRequestError) as err:
        chat(gateway, "one two three", extra_body={"min_p": 0.1})
    assert err.value.body["param"] == "min_p"
    with pytest.raises(openai.BadRequestError) as err:
        chat(gateway, "one two three", n=2)
    assert err.value.body["param"] == "n"


def test_the_upstreams_refusal_passes_through_and_its_failures_are_502_or_504(gateway, upstream):
    with pytest.raises(openai.BadRequestError) as err:
        chat(gateway, "refuse400 please")
    assert err.value.body["param"] == "temperature" and "not liked" in err.value.body["message"]
    with pytest.raises(openai.APIStatusError) as err:
        chat(gateway, "fail500 please")
    assert err.value.status_code == 502
    with pytest.raises(openai.APIStatusError) as err:  # the gateway's credentials: the operator's fault
        chat(gateway, "denied please")
    assert err.value.status_code == 502
    with pytest.raises(openai.APIStatusError) as err:
        chat(gateway, "hang on")
    assert err.value.status_code == 504
    upstream.released.set()
    # Nothing of a failed call was stored: the same request again goes upstream again.
    before = upstream.calls("fail500")
    with pytest.raises(openai.APIStatusError):
        chat(gateway, "fail500 please")
    assert upstream.calls("fail500") == before + 1  # a 500 is answered, not retried: one upstream call each
    registry = gateway.model_server.runtime.metrics.registry
    assert registry.get_sample_value("evocache_upstream_errors_total", {"kind": "failed"}) >= 2
    assert registry.get_sample_value("evocache_upstream_errors_total", {"kind": "timeout"}) == 1


def test_an_upstream_dropped_mid_stream_ends_the_stream_in_error_and_stores_nothing(gateway, upstream):
    r = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "cut a b c d e"}],
                         "temperature": 0, "stream": True}, timeout=30)
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert any('"error"' in line for line in lines)  # the failure is in the stream
    assert not any('"finish_reason":"stop"' in line or '"finish_reason":"length"' in line for line in lines)
    with pytest.raises(openai.APIStatusError) as err:  # not stored: the repeat goes upstream and fails again
        chat(gateway, "cut a b c d e")
    assert err.value.status_code == 502 and upstream.calls("cut a b c d e") == 2


def test_the_model_comes_from_the_upstreams_listing(upstream, tmp_path):
    config = UpstreamConfig(url=upstream.url)
    model = upstream_model(config)
    assert (model.kind, model.id, model.upstream) == ("upstream", MODEL, config)
    assert model.context_tokens is None  # no tokenizer of the model's own: its context is the upstream's to bound
    assert upstream_model(config, MODEL, "bytes").context_tokens == 512  # the listing's max_model_len
    with pytest.raises(ServingConfigError, match="does not serve 'other'; it lists up-model"):
        upstream_model(config, "other")
    with pytest.raises(ServingConfigError, match="cannot list its models"):
        upstream_model(UpstreamConfig(url=f"http://127.0.0.1:{free_port()}/v1", connect_timeout_s=1))
