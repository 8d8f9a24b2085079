"""@cache_if across replicas sharing a real Redis: tenants, corruption, a Redis that dies and comes back."""

from __future__ import annotations

import pytest

from evocache.controller import (
    DiskConfig,
    L1Config,
    RedisConfig,
    StoreConfig,
    StoreConfigError,
    build_runtime,
    cache_if,
    tenant_scope,
)
from evocache.controller._keys import ANONYMOUS_NS
from evocache.dsl import parse_policy

pytestmark = pytest.mark.redis

POLICY = """
policy: shared
version: 1
defaults: {ttl: 10m, tiers: [l1, l2]}
rules:
  - name: answers
    when: true
tenants:
  acme: {l1_share: 0.25, l2_share: 0.25}
  globex: {l1_share: 1.0, l2_share: 1.0}
"""


def replica(url, *, l2_bytes=1 << 20, l1_bytes=64 << 20):
    """One replica's runtime: its own process memory (L1), the shared Redis (L2)."""
    config = StoreConfig(
        l1=L1Config(bytes=l1_bytes), redis=RedisConfig(url=url, l2_bytes=l2_bytes, timeout_s=0.5)
    )
    return build_runtime(config, policy=parse_policy(POLICY))


def model_on(runtime, calls):
    @cache_if("true", name="answer", model="m", store=runtime)
    def answer(prompt: str) -> str:
        calls.append(prompt)
        return f"answer to {prompt}"

    return answer


def test_a_new_replica_reads_l2_but_never_another_tenants_entry(redis_url):
    calls_a, calls_b = [], []
    a, b = replica(redis_url), replica(redis_url)
    answer_a, answer_b = model_on(a, calls_a), model_on(b, calls_b)

    with tenant_scope("acme"):
        answer_a("cancel my subscription")
    with tenant_scope("globex"):
        answer_b("cancel my subscription")  # same prompt, same function, other tenant: computed again
    with tenant_scope("acme"):
        answer_b("cancel my subscription")  # acme's entry, written by replica a, read from L2
    assert calls_a == ["cancel my subscription"]
    assert calls_b == ["cancel my subscription"]
    hits = [(e.ns, e.tier) for e in b.events.events() if e.outcome == "hit"]
    assert hits == [("acme", "l2")]
    a.close(), b.close()


def test_corrupt_l2_payload_is_never_served(redis_url, redis_server):
    calls = []
    a = replica(redis_url)
    answer = model_on(a, calls)
    answer("q")
    key = answer.cache_key("q")
    with redis_server.client() as admin:
        raw = admin.get(f"evc:{ANONYMOUS_NS}:{key}")
        admin.set(f"evc:{ANONYMOUS_NS}:{key}", raw[:-1] + bytes([raw[-1] ^ 1]))  # one flipped bit
    b = replica(redis_url)  # a fresh replica: nothing in its L1
    answer_b = model_on(b, calls)
    assert answer_b("q") == "answer to q"
    assert calls == ["q", "q"]
    assert b.metrics.value("evocache_tier_faults_total", tier="l2", kind="corrupt") == 1
    a.close(), b.close()


def test_redis_killed_and_restarted_mid_traffic(restartable_redis, tmp_path):
    runtime = build_runtime(
        StoreConfig(
            l1=L1Config(bytes=1000),
            redis=RedisConfig(url=restartable_redis.url, timeout_s=0.2, retry_after_s=0.0),
            disk=DiskConfig(path=str(tmp_path / "l3")),
        )
    )
    calls = []
    answer = model_on(runtime, calls)
    results = []
    for i in range(300):
        if i == 100:
            restartable_redis.stop()
        if i == 200:
            restartable_redis.start()
        results.append(answer(f"question {i % 40}"))  # 40 prompts, L1 too small to hold them all
    assert results == [f"answer to question {i % 40}" for i in range(300)]  # zero failed calls
    assert runtime.metrics.value("evocache_tier_errors_total", tier="l2", op="get") > 0
    after = [e for e in runtime.events.events()[-150:] if e.outcome == "hit"]
    assert any(e.tier == "l2" for e in after), "L2 hits come back after the restart without a new runtime"
    runtime.close()


def test_l2_tenant_quota_from_the_policy(redis_url):
    runtime = replica(redis_url, l2_bytes=4000, l1_bytes=1 << 20)
    answer = model_on(runtime, [])
    with tenant_scope("globex"):
        for i in range(5):
            answer(f"g{i}")
    with tenant_scope("acme"):
        for i in range(40):
            answer(f"a{i}")
    l2 = runtime.store.tiers["l2"]
    assert l2.usage("acme") <= 1000  # a quarter of 4000 bytes
    assert l2.usage("globex") > 0
    # globex kept all five entries: acme's writes evicted only acme's
    with tenant_scope("globex"):
        for i in range(5):
            assert answer.invalidate(f"g{i}")
    runtime.close()


def test_l2_shares_without_l2_bytes_are_refused(redis_url):
    with pytest.raises(StoreConfigError, match="l2_bytes"):
        build_runtime(StoreConfig(redis=RedisConfig(url=redis_url)), policy=parse_policy(POLICY))


def test_l1_tenant_quota_from_the_policy(redis_url):
    runtime = replica(redis_url, l1_bytes=8000)
    answer = model_on(runtime, [])
    l1 = runtime.store.tiers["l1"]
    with tenant_scope("acme"):
        for i in range(100):
            answer(f"a{i}")
    assert 0 < l1.usage("acme") <= 2000
    runtime.close()
