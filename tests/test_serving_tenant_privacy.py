"""What one tenant can learn about another's prompts from outside, over HTTP: nothing. A server with the example
tiny Llama and its KV prefix cache (uvicorn in front of an in-process replica) is probed as a tenant would
probe it, with the official ``openai`` client and raw ``httpx``: tenant A sends a prompt, tenant B sends a guess
that starts with A's first block and a prompt nobody sent, and B compares what it sees. ``/metrics`` is the
operator's; even the operator's counters count the guess like the prompt nobody sent."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from _serving_fixtures import ADMIN, ADMIN_DIGEST, KEYS, UvicornThread, write_keys
from prometheus_client.parser import text_string_to_metric_families

from evocache.controller import EventsConfig, StoreConfig
from evocache.serving import (
    AdminKeys,
    Api,
    FileKeyStore,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    build_fastapi,
)

pytestmark = pytest.mark.slow  # a uvicorn server in front of a Hugging Face model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
TENANT_A, TENANT_B = list(KEYS)
# Words the packaged WordPiece tokenizer keeps whole, so prompts of as many words have as many tokens.
WORDS = ("red green blue black white brown pink gray gold tan cat dog cow pig hen fox owl bee ant elk "
         "one two three four five six seven eight nine ten sun moon star rain snow wind fire ice sea sky").split()


def words(start: int, n: int) -> str:
    return " ".join(WORDS[(start + 7 * i) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    spec = ServerSpec(model=ModelConfig(kind="hf", id="tiny-llama", path=str(EXAMPLE), tokenizer="minilm"),
                      store=StoreConfig(events=EventsConfig(sink="ring")))
    server = ModelServer(spec, "hf-replica")
    keys = FileKeyStore.load(write_keys(tmp_path_factory.mktemp("keys") / "keys.yaml"))
    api = Api(model_id="tiny-llama", model_revision="", tokenizer=server.tokenizer, backend=LocalBackend([server]),
              keys=keys, admin_keys=AdminKeys.from_hex([ADMIN_DIGEST]))
    with UvicornThread(build_fastapi(api)) as running:
        running.tokenizer = server.tokenizer
        yield running
    server.close()


def kv_misses(url: str) -> dict[str, float]:
    """``evocache_kv_misses_total`` by reason, as the operator reads it."""
    response = httpx.get(f"{url}/metrics", headers=ADMIN)
    assert response.status_code == 200
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "evocache_kv_misses_total":
                counts[sample.labels["reason"]] = counts.get(sample.labels["reason"], 0) + sample.value
    return counts


def probe(http, prompt: str) -> tuple[dict[str, str], set[str], dict, dict[str, float]]:
    """What tenant B sees of one completion (its x-evocache headers, its header names, its usage) and what the
    operator's counters moved by."""
    before = kv_misses(http.url)
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=TENANT_B, max_retries=0)
    raw = client.completions.with_raw_response.create(model="tiny-llama", prompt=prompt, temperature=0,
                                                      max_tokens=4)
    after = kv_misses(http.url)
    usage = raw.parse().usage
    seen = ({k: v for k, v in raw.headers.items() if k.startswith("x-evocache-")}, set(raw.headers.keys()),
            {"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens})
    moved = {reason: after[reason] - before.get(reason, 0) for reason in after
             if after[reason] != before.get(reason, 0)}
    return (*seen, moved)


def test_a_tenant_cannot_tell_whether_another_tenant_sent_a_prompt(http):
    secret = words(0, 40)  # tenant A's prompt: two full blocks and more
    guess = words(0, 20) + " " + words(3, 20)  # A's first block (and more), then B's own words
    nobody = words(5, 20) + " " + words(3, 20)  # as long, and never sent by anyone
    assert len(http.tokenizer.encode(guess)) == len(http.tokenizer.encode(nobody)) >= 32
    assert http.tokenizer.encode(guess)[:16] == http.tokenizer.encode(secret)[:16]
    openai.OpenAI(base_url=f"{http.url}/v1", api_key=TENANT_A, max_retries=0).completions.create(
        model="tiny-llama", prompt=secret, temperature=0, max_tokens=4)

    # Tenant B cannot read the metrics with its key, nor without one; the refusal says nothing of them.
    for headers, status in (({"Authorization": f"Bearer {TENANT_B}"}, 403), ({}, 401)):
        refused = httpx.get(f"{http.url}/metrics", headers=headers)
        assert refused.status_code == status and set(refused.json()) == {"error"}
        assert "evocache_" not in refused.text

    guessed, not_sent = probe(http, guess), probe(http, nobody)
    # B's headers and usage for the guess are those for a prompt nobody sent ...
    assert guessed[:3] == not_sent[:3]
    assert guessed[0]["x-evocache-outcome"] == "miss" and guessed[2]["cached_tokens"] == 0
    # ... and the operator's counters count both as the same kind of miss.
    assert guessed[3] == not_sent[3] == {"never-seen": 1}
