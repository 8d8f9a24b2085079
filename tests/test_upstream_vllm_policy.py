"""The policy in front of a real vLLM (the session's server, tests/_vllm.py): semantic hits within their
tenant, sampled calls never served from the cache, a canary applied and rolled back while eight clients send
traffic, and Redis killed and restarted under that traffic, each without a failed request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections import Counter
from contextlib import contextmanager

import openai
import pytest
from _serving_fixtures import KEYS, UvicornThread, write_keys

from evocache.controller import (
    EventsConfig,
    PolicyStoreConfig,
    RedisConfig,
    StoreConfig,
    open_policy_store,
)
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


def policy(version: int, note: str = "") -> str:
    return f"""
policy: gateway
version: {version}
fields: {{endpoint: str}}
defaults: {{ttl: 10m, tiers: [l1, l2]}}
rules:
  - name: sampled
    when: temperature > 0
    cache: bypass
  - name: faq{note}
    when: endpoint == "chat"
    semantic: {{max_error: 0.05, mode: static, threshold: 0.8}}
  - name: completions
    when: true
"""


@contextmanager
def gateway(tmp_path, endpoint, redis_url, events: EventsConfig = EventsConfig(sink="ring")):
    store_config = PolicyStoreConfig(directory=str(tmp_path / "policies"), poll_interval_s=0.1)
    store = open_policy_store(store_config)
    store.apply(policy(1))
    config = UpstreamConfig(url=endpoint.base_url, read_timeout_s=60.0)
    model = upstream_model(config, tokenizer=str(endpoint.model_dir))
    spec = ServerSpec(model=model, policy_store=store_config, block_size=16,
                      store=StoreConfig(redis=RedisConfig(url=redis_url, secret="a-test-secret-of-32-bytes-000000"),
                                        events=events))
    server = ModelServer(spec, "replica-a")
    api = Api(model_id=model.id, model_revision=model.revision, tokenizer=server.tokenizer,
              backend=LocalBackend([server]), keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")),
              block_size=16, context_tokens=model.context_length(), upstream_fields=frozenset())
    try:
        with UvicornThread(build_fastapi(api)) as http:
            http.model_id, http.model_server, http.store = model.id, server, store
            yield http
    finally:
        server.close()
        store.close()


def chat(http, content, key=ACME, **extra):
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key=key, max_retries=0, timeout=60)
    return client.chat.completions.with_raw_response.create(
        model=http.model_id, messages=[{"role": "user", "content": content}], **{"temperature": 0, "max_tokens": 6,
                                                                               **extra})


def test_semantic_hits_stay_within_their_tenant_and_sampled_calls_are_never_served(tmp_path, vllm_upstream,
                                                                                    redis_url):
    with gateway(tmp_path, vllm_upstream, redis_url) as http:
        first = chat(http, "How do I reset my password?")
        paraphrase = chat(http, "How can I reset my password?")
        assert first.headers["x-evocache-status"] == "MISS"
        assert paraphrase.headers["x-evocache-status"] == "SEMANTIC HIT"
        assert paraphrase.parse().choices[0].message.content == first.parse().choices[0].message.content
        assert chat(http, "How can I reset my password?", key=GLOBEX).headers["x-evocache-status"] == "MISS"
        sampled = [chat(http, "Tell me a story", temperature=1.0) for _ in range(2)]
        assert [r.headers["x-evocache-status"] for r in sampled] == ["BYPASS", "BYPASS"]
        assert {r.headers["x-evocache-reason"] for r in sampled} == {"rule"}


def test_a_canary_and_a_redis_restart_under_eight_clients_fail_no_request(tmp_path, vllm_upstream, redis_server,
                                                                          redis_url):
    with gateway(tmp_path, vllm_upstream, redis_url) as http:
        stop = threading.Event()
        statuses: Counter[str] = Counter()
        policies: Counter[str] = Counter()
        failures: list[str] = []

        def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    r = chat(http, f"client {i % 4} question {n % 6}")
                    statuses[r.headers["x-evocache-status"]] += 1
                    policies[r.headers["x-evocache-policy"]] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                    failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        try:
            time.sleep(3)
            http.store.apply(policy(2, "-v2"), canary=0.5)
            time.sleep(4)
            redis_server.stop()  # L2 gone: a counted miss per lookup, never a failed request
            time.sleep(3)
            redis_server.start()
            time.sleep(3)
            http.store.rollback()
            time.sleep(3)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert failures == []
        assert statuses["HIT"] > 0 and statuses["MISS"] > 0
        assert policies["gateway@2"] > 0 and policies["gateway@1"] > 0  # the canary served, then rolled back
        registry = http.model_server.runtime.metrics.registry
        failed = [s for m in registry.collect() if m.name == "evocache_tier_errors" for s in m.samples
                  if s.name.endswith("_total") and s.labels.get("tier") == "l2" and s.value > 0]
        assert failed, "the stopped Redis was never noticed: the test did not exercise the outage"


def test_agent_watch_follows_the_gateways_events(tmp_path, vllm_upstream, redis_url):
    events = tmp_path / "events.jsonl"
    with gateway(tmp_path, vllm_upstream, redis_url, EventsConfig(sink="jsonl", path=str(events))) as http:
        for n in range(40):
            chat(http, f"question {n % 8}")
        http.model_server.runtime.flush()
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert len(lines) == 40 and {line["outcome"] for line in lines} == {"hit", "miss"}
    report = tmp_path / "report.json"
    done = subprocess.run(
        [str(Path(sys.executable).with_name("evocache")), "agent", "watch", "--events", str(events), "--store",
         str(tmp_path / "policies"), "--window", "20", "--max-windows", "2", "--interval", "0.2", "--workdir",
         str(tmp_path / "agent"), "--json", str(report)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    windows = json.loads(report.read_text())["windows"]
    assert len(windows) == 2 and sum(w["requests"] for w in windows) == 40
