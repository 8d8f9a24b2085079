"""evocache in front of a real vLLM (the session's server, tests/_vllm.py), called with the official client:
miss then hit, a streamed hit identical to the first stream, the tenant's salt reaching vLLM's prefix cache,
fields that change the answer keyed, vLLM's own 400 passed through, a stopped vLLM answered with a 504 and a
killed one with a 502, nothing of either stored. The in-process gateway (``LocalBackend``) keeps each test
short; tests/test_upstream_vllm_serve.py runs ``evocache serve --upstream`` itself, through Ray."""

from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import contextmanager

import httpx
import openai
import pytest
from _serving_fixtures import KEYS, UvicornThread, write_keys

from evocache.controller import EventsConfig, StoreConfig
from evocache.serving import (
    Api,
    FileKeyStore,
    LocalBackend,
    ModelServer,
    ServerSpec,
    UpstreamConfig,
    build_fastapi,
    upstream_model,
)

pytestmark = pytest.mark.slow

ACME, GLOBEX = list(KEYS)
# Two of vLLM's 128-token blocks and some: the engine caches whole blocks of a prompt it has seen.
LONG = " ".join(f"word{i % 50}" for i in range(300))


@contextmanager
def evocache_over(tmp_path, endpoint, read_timeout_s: float = 60.0):
    """The gateway in this process (``LocalBackend``) in front of ``endpoint``, served on a loopback port."""
    config = UpstreamConfig(url=endpoint.base_url, read_timeout_s=read_timeout_s, retries=0, fields=("top_k",))
    model = upstream_model(config, tokenizer=str(endpoint.model_dir))
    spec = ServerSpec(model=model, store=StoreConfig(events=EventsConfig(sink="ring")), block_size=16)
    server = ModelServer(spec, "replica-a")
    api = Api(model_id=model.id, model_revision=model.revision, tokenizer=server.tokenizer,
              backend=LocalBackend([server]), keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")),
              block_size=16, context_tokens=model.context_length(), upstream_fields=frozenset(config.fields))
    try:
        with UvicornThread(build_fastapi(api)) as http:
            http.model_id, http.model_server, http.vllm = model.id, server, endpoint
            yield http
    finally:
        server.close()


@pytest.fixture
def gateway(tmp_path, vllm_upstream):
    with evocache_over(tmp_path, vllm_upstream) as http:
        yield http


def chat(http, content, key=ACME, **extra):
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model=http.model_id, messages=[{"role": "user", "content": content}], temperature=0,
        **{"max_tokens": 8, **extra})


def test_miss_then_hit_and_a_streamed_hit_replays_the_first_stream(gateway):
    first = chat(gateway, "the first question")
    again = chat(gateway, "the first question")
    assert (first.headers["x-evocache-outcome"], again.headers["x-evocache-outcome"]) == ("miss", "hit")
    a, b = first.parse(), again.parse()
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens == a.usage.prompt_tokens
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ACME, max_retries=0)

    def stream():
        return [c.model_dump(include={"choices"}) for c in client.completions.create(
            model=gateway.model_id, prompt="a streamed prompt", temperature=0, max_tokens=12, stream=True)]

    first_stream, second_stream = stream(), stream()
    assert first_stream == second_stream and "".join(c["choices"][0]["text"] for c in first_stream if c["choices"])
    direct = openai.OpenAI(base_url=gateway.vllm.base_url, api_key="none").completions.create(
        model=gateway.model_id, prompt="a streamed prompt", temperature=0, max_tokens=12)
    assert "".join(c["choices"][0]["text"] for c in first_stream if c["choices"]) == direct.choices[0].text


def test_the_tenants_salt_keeps_vllms_prefix_cache_apart(gateway):
    # A's long prompt twice under two keys (max_tokens differs): the second is evocache's miss, vLLM's prefix hit.
    chat(gateway, LONG, max_tokens=4)
    reused = chat(gateway, LONG, max_tokens=5).parse()
    assert reused.usage.prompt_tokens_details.cached_tokens >= 128
    # B's first request for the same prompt: a miss in both caches, nothing of A's prefix reused.
    other = chat(gateway, LONG, key=GLOBEX, max_tokens=4)
    assert other.headers["x-evocache-outcome"] == "miss"
    assert other.parse().usage.prompt_tokens_details.cached_tokens == 0


def test_fields_that_change_the_answer_are_keyed_and_vllms_400_passes_through(gateway):
    plain = chat(gateway, "keyed by its fields")
    penalised = chat(gateway, "keyed by its fields", frequency_penalty=1.5)
    extra = chat(gateway, "keyed by its fields", extra_body={"top_k": 1})
    assert [r.headers["x-evocache-outcome"] for r in (plain, penalised, extra)] == ["miss"] * 3
    assert chat(gateway, "keyed by its fields", frequency_penalty=1.5).headers["x-evocache-outcome"] == "hit"
    logprobs = chat(gateway, "with logprobs", logprobs=True, top_logprobs=2).parse()
    assert len(logprobs.choices[0].logprobs.content) == logprobs.usage.completion_tokens
    schema = {"type": "json_schema",
              "json_schema": {"name": "verdict", "schema": {"type": "string", "enum": ["yes", "no"]}}}
    shaped = chat(gateway, "keyed by its fields", response_format=schema, max_tokens=16)
    assert shaped.headers["x-evocache-outcome"] == "miss"  # another key than the plain request's
    # vLLM's guided decoding honoured it (the tiny model's WordPiece decoder puts spaces between pieces).
    assert json.loads("".join(shaped.parse().choices[0].message.content.split())) in ("yes", "no")
    assert chat(gateway, "keyed by its fields", response_format=schema, max_tokens=16).headers[
        "x-evocache-outcome"] == "hit"
    with pytest.raises(openai.BadRequestError) as err:  # vLLM refuses it: its message reaches the client
        chat(gateway, "needs tools", tool_choice="required")
    assert "tools" in err.value.body["message"] and "tool_choice" in err.value.body["message"]


def test_a_stopped_vllm_is_a_504_and_a_killed_one_a_502_and_neither_answer_is_stored(tmp_path, gateway,
                                                                                        vllm_server):
    chat(gateway, "while it sleeps", max_tokens=3)  # vLLM warm: its silence below is the signal's, not a warm-up
    with evocache_over(tmp_path, vllm_server.endpoint, read_timeout_s=2.0) as impatient:
        os.killpg(vllm_server.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIStatusError) as err:
                chat(impatient, "while it sleeps")
            assert err.value.status_code == 504
        finally:
            os.killpg(vllm_server.process.pid, signal.SIGCONT)
        assert chat(impatient, "while it sleeps").headers["x-evocache-outcome"] == "miss"  # the 504 stored nothing
    # Killed in the middle of a stream: the stream ends in an error, nothing is stored, the repeat is a 502.
    opened = threading.Event()
    lines: list[str] = []

    def read() -> None:
        with httpx.stream("POST", f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {ACME}"},
                          json={"model": gateway.model_id, "prompt": "a long answer", "temperature": 0,
                                "max_tokens": 600, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                opened.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert opened.wait(60)
    vllm_server.kill()
    reader.join(60)
    assert any('"error"' in line for line in lines)
    assert not any('"finish_reason":"length"' in line for line in lines)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ACME, max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=gateway.model_id, prompt="a long answer", temperature=0, max_tokens=600)
    assert err.value.status_code == 502
