"""Policies in force: activation is all or nothing, unevaluable rules fail closed, user code never fails a call."""

from __future__ import annotations

import pickle

import pytest

from evocache.controller import (
    ContractError,
    DiskConfig,
    Entry,
    L1Config,
    StoreConfig,
    StoreConfigError,
    build_runtime,
    cache_if,
    tenant_scope,
)
from evocache.controller.eviction import LRUPolicy, S3FIFOPolicy
from evocache.controller._keys import ANONYMOUS_NS
from evocache.dsl import parse_policy


ALL = """  - name: all
    when: true"""


def policy(version: int, *, l1: str = "lru", acme_share: float = 1.0, extra_rules: str = ALL) -> str:
    return f"""
policy: p
version: {version}
defaults: {{ttl: 10m, tiers: [l1, l3]}}
rules:
{extra_rules}
tenants:
  acme: {{l1_share: {acme_share}}}
eviction: {{l1: {l1}}}
"""


@pytest.fixture
def rt(tmp_path):
    runtime = build_runtime(StoreConfig(l1=L1Config(bytes=10_000), disk=DiskConfig(path=str(tmp_path / "l3"))),
                            policy=parse_policy(policy(1)))
    yield runtime
    runtime.close()


def test_activation_switches_eviction_and_quotas_together(rt):
    @cache_if("true", store=rt)
    def f(x: int) -> str:
        return "v" * 50

    with tenant_scope("acme"):
        for i in range(20):
            f(i)
    assert isinstance(rt.l1.policy, LRUPolicy)
    before = rt.l1.usage("acme")
    new = rt.activate(parse_policy(policy(2, l1="s3fifo", acme_share=0.1)))
    assert isinstance(new.l1.policy, S3FIFOPolicy) and len(new.l1.policy) == len(new.l1)
    assert new.policy_ref == "p@2" and new.generation != rt.generation
    assert new.store.tiers["l3"]._cache.eviction_policy == "least-recently-stored"

    @cache_if("true", store=new)
    def g(x: int) -> str:
        return "w" * 50

    with tenant_scope("acme"):
        g(0)
    assert new.l1.usage("acme") <= 1_000 < before  # the next write made room within the new quota


def test_a_policy_that_cannot_be_enforced_changes_nothing(rt):
    bad = parse_policy(policy(2, l1="clairvoyant", acme_share=0.1))
    with pytest.raises(StoreConfigError, match="clairvoyant"):
        rt.activate(bad)
    assert rt.tenants.policy.ref == "p@1"  # quotas untouched
    assert isinstance(rt.l1.policy, LRUPolicy)


UNEVALUABLE = """  - name: admin-never-cached
    when: route == "admin"
    cache: bypass
  - name: all
    when: true"""


def test_a_rule_that_cannot_be_evaluated_fails_closed(tmp_path, caplog):
    text = policy(1, extra_rules=UNEVALUABLE).replace("defaults:", "fields: {route: str}\ndefaults:")
    runtime = build_runtime(StoreConfig(), policy=parse_policy(text))

    @cache_if("true", store=runtime)
    def secret(prompt: str) -> str:  # no `route`: the bypass rule cannot be decided for it
        return "secret"

    secret("q"), secret("q")
    assert secret.cache_info().hits == 0 and secret.cache_info().bypasses == 2
    events = runtime.events.events()
    assert [(e.rule, e.reason) for e in events] == [("admin-never-cached", "rule-error")] * 2
    assert sum("admin-never-cached" in r.message for r in caplog.records) == 1  # warned once


def test_a_failing_predicate_is_a_bypass_not_a_failure():
    runtime = build_runtime(StoreConfig())

    @cache_if(lambda view: view["top_k"] <= 10, store=runtime)
    def f(prompt: str) -> str:
        return "ok"

    assert f("a") == "ok" and f("a") == "ok"
    assert [e.reason for e in runtime.events.events()] == ["contract-error", "contract-error"]


class Gone:
    pass


def test_a_payload_that_no_longer_unpickles_is_dropped(rt):
    @cache_if("true", serializer="pickle", store=rt)
    def f(x: int) -> object:
        return "fresh"

    key = f.cache_key(1)
    now = rt.clock()
    payload = b"p" + pickle.dumps(Gone()).replace(b"Gone", b"Lost")  # a class removed since it was stored
    rt.store.set(ANONYMOUS_NS, key, Entry(value=payload, expires_at=now + 60, created_at=now), ["l3"])
    assert f(1) == "fresh"
    assert rt.metrics.value("evocache_tier_faults_total", tier="l3", kind="undecodable") == 1


def test_string_annotations_are_resolved_at_decoration():
    # This module uses `from __future__ import annotations`: `count: int` is the string "int" here.
    with pytest.raises(ContractError, match="len"):

        @cache_if("len(count) > 3")
        def f(count: int) -> str:
            return ""
