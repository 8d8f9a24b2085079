"""The OpenAI-compatible HTTP API, called with the official ``openai`` client (sync and async, streaming and
not) against a real uvicorn server in front of in-process model replicas (``LocalBackend``).

The Ray deployment serves the same ``Api`` (tests/test_serving_ray.py checks it end to end); here the
behaviour of the API itself is pinned: headers, streams, errors, tenants, the policy's decisions.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from _serving_fixtures import ADMIN, ADMIN_DIGEST, CALLS, KEYS, UvicornThread, echo_model, write_keys

from evocache.controller import EventsConfig, PolicyStoreConfig, StoreConfig, open_policy_store
from evocache.serving import (
    AdminKeys,
    Api,
    FileKeyStore,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    build_fastapi,
    serve_metrics,
)
from evocache.serving._auth import tenant_rates
from evocache.serving._model import ByteTokenizer, CallableGenerator

ACME, GLOBEX = list(KEYS)
POLICY = """
policy: api-test
version: 1
fields: {endpoint: str}
defaults: {ttl: 10m, tiers: [l1]}
rules:
  - name: sampled
    when: temperature > 0
    cache: bypass
  - name: chat-faq
    when: endpoint == "chat"
    semantic: {max_error: 0.05, mode: static, threshold: 0.8}
  - name: completions
    when: true
tenants:
  globex: {l1_share: 1.0, rate: 3, burst: 3}
"""


@pytest.fixture
def served(tmp_path):
    CALLS.clear()
    store_config = PolicyStoreConfig(directory=str(tmp_path / "policies"), poll_interval_s=0.1)
    store = open_policy_store(store_config)
    store.apply(POLICY)
    spec = ServerSpec(model=ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model"),
                      store=StoreConfig(events=EventsConfig(sink="ring")), policy_store=store_config, block_size=4)
    server = ModelServer(spec, "replica-a", generator=CallableGenerator(echo_model, "echo_model"),
                         tokenizer=ByteTokenizer())
    # The rate limiter's clock stands still: a tenant's burst is all it gets, however slow the machine.
    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=LocalBackend([server]),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4, clock=lambda: 0.0,
              admin_keys=AdminKeys.from_hex([ADMIN_DIGEST]))
    api.set_tenant_rates(*tenant_rates(store.load(store.state().active), None))
    with UvicornThread(build_fastapi(api)) as http:
        yield http, server, store
    server.close()
    store.close()


def client(http, key=ACME):
    return openai.OpenAI(base_url=f"{http.url}/v1", api_key=key, max_retries=0)


def test_a_repeated_completion_is_a_hit_with_the_decision_in_its_headers(served):
    http, server, _ = served
    c = client(http)
    first = c.completions.with_raw_response.create(model="echo", prompt="one two three", temperature=0,
                                                   max_tokens=16)
    again = c.completions.with_raw_response.create(model="echo", prompt="one two three", temperature=0,
                                                   max_tokens=16)
    assert first.headers["x-evocache-outcome"] == "miss"
    assert again.headers["x-evocache-outcome"] == "hit" and again.headers["x-evocache-tier"] == "l1"
    assert again.headers["x-evocache-rule"] == "completions"
    assert again.headers["x-evocache-policy"] == "api-test@1"
    body = again.parse()
    assert body.choices[0].text == "three two one" == first.parse().choices[0].text
    assert body.usage.prompt_tokens == len("one two three")
    assert body.usage.prompt_tokens_details.cached_tokens == 0
    assert CALLS == ["one two three"]


def test_a_stream_that_hits_replays_the_first_streams_chunks(served):
    http, _, _ = served
    c = client(http)

    def stream():
        with c.chat.completions.with_streaming_response.create(
            model="echo", messages=[{"role": "user", "content": "alpha beta gamma delta"}], temperature=0,
            stream=True, stream_options={"include_usage": True},
        ) as response:
            lines = [line for line in response.iter_lines() if line]
            return response.headers, lines

    headers1, lines1 = stream()
    headers2, lines2 = stream()
    assert headers1["x-evocache-outcome"] == "miss" and headers2["x-evocache-outcome"] == "hit"
    assert lines1[-1] == lines2[-1] == "data: [DONE]"

    def payloads(lines):  # each chunk without the per-response id and timestamp
        out = []
        for line in lines[:-1]:
            data = json.loads(line.removeprefix("data: "))
            out.append({k: v for k, v in data.items() if k not in ("id", "created")})
        return out

    assert payloads(lines1) == payloads(lines2)
    chunks = payloads(lines1)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert "delta gamma beta alpha" in text  # the echo model reverses the rendered chat
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_the_sdk_streams_and_the_async_client_works_too(served):
    http, _, _ = served
    events = list(client(http).completions.create(model="echo", prompt="red green blue", temperature=0,
                                                  stream=True))
    assert "".join(e.choices[0].text for e in events if e.choices) == "blue green red"

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{http.url}/v1", api_key=ACME, max_retries=0) as ac:
            whole = await ac.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "left right"}], temperature=0)
            parts = []
            async for event in await ac.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "left right"}], temperature=0,
                    stream=True):
                parts += [ch.delta.content or "" for ch in event.choices]
            return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed and "right left" in whole


def test_two_tenants_with_the_same_prompt_never_share_an_answer(served):
    http, _, _ = served
    for key in (ACME, GLOBEX):
        r = client(http, key).completions.with_raw_response.create(model="echo", prompt="same words here",
                                                                   temperature=0)
        assert r.headers["x-evocache-outcome"] == "miss"
    assert CALLS == ["same words here", "same words here"]


def test_a_paraphrase_gets_a_semantic_hit_within_its_tenant_only(served):
    http, _, _ = served
    ask = [{"role": "user", "content": "How do I reset my password?"}]
    paraphrase = [{"role": "user", "content": "How can I reset my password?"}]
    client(http).chat.completions.create(model="echo", messages=ask, temperature=0)
    hit = client(http).chat.completions.with_raw_response.create(model="echo", messages=paraphrase,
                                                                 temperature=0)
    assert hit.headers["x-evocache-outcome"] == "hit"
    assert hit.headers["x-evocache-reason"] == "semantic" and hit.headers["x-evocache-rule"] == "chat-faq"
    other = client(http, GLOBEX).chat.completions.with_raw_response.create(model="echo", messages=paraphrase,
                                                                           temperature=0)
    assert other.headers["x-evocache-outcome"] == "miss"


def test_sampling_requests_bypass_and_openais_default_temperature_samples(served):
    http, _, _ = served
    r = client(http).completions.with_raw_response.create(model="echo", prompt="no temperature given")
    assert r.headers["x-evocache-outcome"] == "bypass" and r.headers["x-evocache-rule"] == "sampled"


def test_keys_are_checked_and_unknown_keys_get_401(served):
    http, _, _ = served
    with pytest.raises(openai.AuthenticationError) as err:
        client(http, "sk-not-a-known-key-000").completions.create(model="echo", prompt="x", temperature=0)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{http.url}/v1/models").status_code == 401
    body = {"model": "echo", "prompt": "x", "tenant": "globex"}  # a field cannot choose the tenant
    r = httpx.post(f"{http.url}/v1/completions", json=body, headers={"authorization": f"Bearer {ACME}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"


def test_bad_requests_name_the_field(served):
    http, _, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client(http).completions.create(model="echo", prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client(http).completions.create(model="other-model", prompt="x")
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client(http).chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}], n=2)
    assert err.value.body["param"] == "n"


def test_a_tenant_over_its_policy_rate_gets_429_and_others_do_not(served):
    http, _, _ = served
    statuses = []
    for _ in range(6):
        r = httpx.post(f"{http.url}/v1/completions", json={"model": "echo", "prompt": "r", "temperature": 0},
                       headers={"authorization": f"Bearer {GLOBEX}"})
        statuses.append(r.status_code)
    assert statuses == [200, 200, 200, 429, 429, 429]  # a burst of 3, and no time passes
    limited = r if r.status_code == 429 else None
    assert limited is not None and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    for _ in range(6):
        assert client(http, ACME).completions.with_raw_response.create(
            model="echo", prompt="r", temperature=0).status_code == 200


def test_models_health_and_metrics(served):
    http, _, _ = served
    assert [m.id for m in client(http).models.list()] == ["echo"]
    assert httpx.get(f"{http.url}/healthz").json()["status"] == "ok"
    client(http).completions.create(model="echo", prompt="count me", temperature=0)
    text = httpx.get(f"{http.url}/metrics", headers=ADMIN).text
    assert 'replica="replica-a"' in text
    assert "evocache_http_requests_total" in text and "evocache_requests_total" in text


def test_metrics_answer_the_admin_key_only_and_refuse_in_openais_error_shape(served):
    http, _, _ = served
    client(http).completions.create(model="echo", prompt="count me", temperature=0)
    refusals = {
        "tenant key": (403, "insufficient_permissions", {"Authorization": f"Bearer {GLOBEX}"}),
        "no key": (401, "invalid_api_key", {}),
        "unknown key": (401, "invalid_api_key", {"Authorization": "Bearer sk-guessed-admin"}),
        "malformed": (401, "invalid_api_key", {"Authorization": "Basic c2stYWNtZQ=="}),
    }
    for name, (status, code, headers) in refusals.items():
        r = httpx.get(f"{http.url}/metrics", headers=headers)
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["type"]) == (status, code, "invalid_request_error"), name
        assert "evocache_" not in r.text and "acme" not in r.text and "globex" not in r.text, name
    text = httpx.get(f"{http.url}/metrics", headers=ADMIN).text
    assert 'evocache_http_requests_total{endpoint="metrics",status="403"} 1.0' in text


def test_the_metrics_listener_serves_without_a_key_on_loopback_only(tmp_path):
    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=_NoReplica(),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")))
    listener = serve_metrics(api, "127.0.0.1", 0)
    try:
        assert listener.started
        (host, port), = [s.getsockname()[:2] for server in listener.servers for s in server.sockets]
        assert host == "127.0.0.1"
        assert "evocache_http_requests_total" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 404  # metrics only
    finally:
        listener.should_exit = True


def test_a_new_policy_version_reaches_the_replica_without_a_restart(served):
    http, server, store = served
    store.apply(POLICY.replace("version: 1", "version: 2").replace("name: completions", "name: everything"))
    assert server.follower is not None
    end = time.monotonic() + 5  # the follower polls every 0.1 s
    while time.monotonic() < end:
        r = client(http).completions.with_raw_response.create(model="echo", prompt="v2", temperature=0)
        if r.headers["x-evocache-policy"] == "api-test@2":
            break
        time.sleep(0.05)
    assert r.headers["x-evocache-policy"] == "api-test@2" and r.headers["x-evocache-rule"] == "everything"


class _NoReplica:
    """A backend with no replica ready: calls wait (as Ray's handle does while no replica runs)."""

    async def complete(self, request, placed=None):
        await asyncio.sleep(60)

    async def stream(self, request, placed=None):
        await asyncio.sleep(60)
        yield None

    async def ready(self):
        return False

    async def metrics(self):
        return b""


def test_no_ready_replica_is_a_503_in_openais_error_shape(tmp_path):
    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=_NoReplica(),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), ready_timeout_s=0.3)
    with UvicornThread(build_fastapi(api)) as http:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as err:
                list_or_one = client(http).completions.create(model="echo", prompt="x", temperature=0,
                                                              stream=stream)
                list(list_or_one) if stream else None
            assert err.value.status_code == 503 and err.value.body["code"] == "service_unavailable"
        assert httpx.get(f"{http.url}/healthz").status_code == 503


def test_a_shadow_version_is_planned_beside_every_call_and_never_serves(served):
    http, server, store = served
    shadow_doc = POLICY.replace("version: 1", "version: 2").replace(
        "  - name: completions\n    when: true", "  - name: completions\n    when: true\n    cache: bypass")
    store.apply(shadow_doc, shadow=True)
    end = time.monotonic() + 5
    while server.rollouts.shadow is None and time.monotonic() < end:
        time.sleep(0.05)
    assert server.rollouts.shadow is not None
    for prompt in ("shadow one", "shadow two", "shadow one"):
        r = client(http).completions.with_raw_response.create(model="echo", prompt=prompt, temperature=0)
        assert r.headers["x-evocache-policy"] == "api-test@1"  # the active version decides and serves
    assert r.headers["x-evocache-outcome"] == "hit"  # the shadow's bypass did not act
    tally = server.rollouts.shadow_tally()
    assert tally["shadow"] == "api-test@2" and tally["compared"] == 3 and tally["agreed"] == 0
    metrics = httpx.get(f"{http.url}/metrics", headers=ADMIN).text
    assert "evocache_shadow_decisions_total" in metrics and 'agree="false"' in metrics
