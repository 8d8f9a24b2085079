"""Exact hits answered by the ingress itself (``ModelServer.lookups_only``), from its own L1 and the tiers it
shares with the model replicas, never waiting behind a generation: the same answer, headers, usage and events
as a replica's hit; everything else (a miss, a refresh) still goes to a replica."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from _serving_fixtures import KEYS, UvicornThread, write_keys

from evocache.controller import DiskConfig, EventsConfig, StoreConfig
from evocache.serving import (
    Api,
    ByteTokenizer,
    CallableGenerator,
    FileKeyStore,
    LocalBackend,
    ModelConfig,
    ModelServer,
    ServerSpec,
    build_fastapi,
)

ACME, GLOBEX = list(KEYS)
RAN: list[str] = []
GATE = threading.Event()


def gated_echo(prompt: str, max_tokens: int):
    """The prompt's words reversed; a prompt starting with ``wait`` blocks until the test opens the gate."""
    RAN.append(prompt)
    if prompt.startswith("wait"):
        GATE.wait(30)
    words = prompt.split()[::-1][:max_tokens]
    for i, word in enumerate(words):
        yield word if i == 0 else " " + word


@pytest.fixture
def http(tmp_path):
    RAN.clear()
    GATE.clear()
    store = StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3")), events=EventsConfig(sink="ring"))
    spec = ServerSpec(model=ModelConfig(kind="callable", id="echo", callable="x:y"), store=store, block_size=4)
    replica = ModelServer(spec, "replica-a", generator=CallableGenerator(gated_echo, "echo"),
                          tokenizer=ByteTokenizer())
    ingress = ModelServer.lookups_only(spec, "ingress-a", ByteTokenizer())
    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=LocalBackend([replica]),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4, hits=ingress.lookup)
    with UvicornThread(build_fastapi(api)) as running:
        running.replica, running.ingress = replica, ingress
        yield running
    GATE.set()
    replica.close()
    ingress.close()


def ask(http, prompt, key=ACME, headers=None, **body):
    return httpx.post(f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": "echo", "prompt": prompt, "temperature": 0, "max_tokens": 8, **body},
                      timeout=30)


def test_a_repeat_is_answered_by_the_ingress_with_the_replicas_answer(http):
    first = ask(http, "one two three")
    again = ask(http, "one two three")
    assert first.headers["x-evocache-replica"] == "replica-a" and first.headers["x-evocache-status"] == "MISS"
    assert again.headers["x-evocache-replica"] == "ingress-a" and again.headers["x-evocache-status"] == "HIT"
    assert again.headers["x-evocache-tier"] == "l3"  # the shared tier; then the ingress's own L1
    assert ask(http, "one two three").headers["x-evocache-tier"] == "l1"
    a, b = first.json(), again.json()
    assert a["choices"] == b["choices"] and a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    assert RAN == ["one two three"]
    stream = httpx.post(f"{http.url}/v1/completions", headers={"Authorization": f"Bearer {ACME}"}, timeout=30,
                        json={"model": "echo", "prompt": "one two three", "temperature": 0, "max_tokens": 8,
                              "stream": True})
    assert stream.headers["x-evocache-replica"] == "ingress-a"
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == a["choices"][0]["text"], stream.text
    assert stream.text.rstrip().endswith("data: [DONE]")
    http.ingress.runtime.flush()
    assert [e.outcome for e in http.ingress.runtime.events.events()] == ["hit", "hit", "hit"]  # its own events


def test_hits_do_not_wait_behind_a_generation_and_misses_still_reach_the_replica(http):
    ask(http, "cached answer here")
    slow = threading.Thread(target=ask, args=(http, "wait for the gate"))
    slow.start()  # the replica is busy generating until the gate opens
    try:
        hit = ask(http, "cached answer here")
        assert hit.headers["x-evocache-replica"] == "ingress-a" and not GATE.is_set()
    finally:
        GATE.set()
        slow.join(30)
    refresh = ask(http, "cached answer here", headers={"Cache-Control": "no-cache"})
    assert refresh.headers["x-evocache-replica"] == "replica-a" and refresh.headers["x-evocache-status"] == "REFRESH"
    other = ask(http, "cached answer here", key=GLOBEX)  # another tenant: never served acme's entry
    assert other.headers["x-evocache-status"] == "MISS" and other.headers["x-evocache-replica"] == "replica-a"
