"""The example tiny Llama (real Hugging Face model code, random weights from examples/tiny-llama's config, the
packaged WordPiece tokenizer) served over HTTP: streamed token by token, cached, and counted in usage."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from _serving_fixtures import KEYS, UvicornThread, write_keys

from evocache.controller import EventsConfig, StoreConfig
from evocache.serving import Api, FileKeyStore, LocalBackend, ModelConfig, ModelServer, ServerSpec, build_fastapi

pytestmark = pytest.mark.slow  # a uvicorn server in front of a Hugging Face model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
ACME = next(iter(KEYS))


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    spec = ServerSpec(model=ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm"),
                      store=StoreConfig(events=EventsConfig(sink="ring")))
    server = ModelServer(spec, "hf-replica")
    keys = FileKeyStore.load(write_keys(tmp_path_factory.mktemp("keys") / "keys.yaml"))
    api = Api(model_id="tiny-llama", model_revision="", tokenizer=server.tokenizer,
              backend=LocalBackend([server]), keys=keys)
    with UvicornThread(build_fastapi(api)) as running:
        yield running
    server.close()


def test_the_tiny_llama_streams_tokens_and_a_repeat_is_served_from_the_cache(http):
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=ACME, max_retries=0)

    def stream():
        with client.chat.completions.with_streaming_response.create(
                model="tiny-llama", messages=[{"role": "user", "content": "tell me about caches"}],
                temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True}) as response:
            events = [e for e in response.parse()]
            return response.headers["x-evocache-outcome"], events

    outcome1, events1 = stream()
    outcome2, events2 = stream()
    assert (outcome1, outcome2) == ("miss", "hit")
    pieces1 = [e.choices[0].delta.content for e in events1 if e.choices and e.choices[0].delta.content]
    pieces2 = [e.choices[0].delta.content for e in events2 if e.choices and e.choices[0].delta.content]
    assert pieces1 == pieces2 and len(pieces1) > 1  # token by token, replayed piece for piece
    usage = events1[-1].usage
    assert usage.completion_tokens == len(pieces1) and usage.prompt_tokens > 0
    finish = [e.choices[0].finish_reason for e in events1 if e.choices and e.choices[0].finish_reason]
    assert finish == (["length"] if len(pieces1) == 12 else ["stop"])


def test_greedy_decoding_is_deterministic_and_sampling_with_a_seed_repeats(http):
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=ACME, max_retries=0)
    greedy = [client.completions.create(model="tiny-llama", prompt=f"prompt {i}", temperature=0,
                                        max_tokens=6).choices[0].text for i in range(2)]
    assert greedy[0] != greedy[1]  # different prompts, different continuations
    raw = client.completions.with_raw_response.create(model="tiny-llama", prompt="seeded", temperature=0.8,
                                                      seed=7, max_tokens=6)
    again = client.completions.with_raw_response.create(model="tiny-llama", prompt="seeded", temperature=0.8,
                                                        seed=7, max_tokens=6)
    # A seeded sample is reproducible, so the cache may keep it; unseeded sampling is bypassed.
    assert raw.parse().choices[0].text == again.parse().choices[0].text
    assert again.headers["x-evocache-outcome"] == "hit"


def test_a_shared_system_prompt_is_reused_from_the_kv_cache_and_reported_as_cached_tokens(http, tmp_path):
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=ACME, max_retries=0)
    system = {"role": "system", "content": "You are a terse assistant for the evocache project. " * 6}

    def ask(question):
        return client.chat.completions.create(
            model="tiny-llama", temperature=0, max_tokens=6,
            messages=[system, {"role": "user", "content": question}])

    first = ask("what is a cache?")
    second = ask("what is a prefix?")  # another question after the same system prompt
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * 4 and cached % 16 == 0 and cached < second.usage.prompt_tokens

    # The answer with reused KV is the answer the model gives computing everything.
    spec = ServerSpec(model=ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm"),
                      store=StoreConfig(events=EventsConfig(sink="ring")), kv=None)
    plain = ModelServer(spec, "no-kv")
    keys = FileKeyStore.load(write_keys(tmp_path / "keys.yaml"))
    api = Api(model_id="tiny-llama", model_revision="", tokenizer=plain.tokenizer,
              backend=LocalBackend([plain]), keys=keys)
    with UvicornThread(build_fastapi(api)) as other:
        uncached = openai.OpenAI(base_url=f"{other.url}/v1", api_key=ACME, max_retries=0).chat.completions.create(
            model="tiny-llama", temperature=0, max_tokens=6,
            messages=[system, {"role": "user", "content": "what is a prefix?"}])
    plain.close()
    assert uncached.choices[0].message.content == second.choices[0].message.content
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0
