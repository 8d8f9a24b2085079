"""Every Redis user of evocache on a real 3-master Redis Cluster (``redis+cluster://`` URLs): L2, its quotas
and integrity checks, the event stream, the policy store and its change messages, the shared semantic index,
the API-key store; and a node that dies mid-traffic, which costs misses and never a call."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from _helpers import FakeClock
from _redis_server import RedisClusterServers
from redis.cluster import RedisCluster

from evocache.controller import (
    L1Config,
    RedisConfig,
    RedisPolicyStore,
    RedisStreamSink,
    StoreConfig,
    Tenant,
    build_runtime,
    cache_if,
    tenant_scope,
)
from evocache.controller._events import AccessEvent
from evocache.controller._policy_store import PolicyFollower, PolicyState
from evocache.controller._redis_client import cluster_url, connect
from evocache.controller._types import L2, CacheKey, Entry, Namespace
from evocache.controller.errors import TierUnavailable
from evocache.controller.semantic import Scope, SharedEntry, SharedIndex
from evocache.controller.tiers import MemoryTier, RedisTier, TieredStore
from evocache.dsl import parse_policy

pytestmark = pytest.mark.redis

SECRET = b"the cluster's deployment secret"
NAMESPACES = [Namespace(f"tenant-{i}") for i in range(12)]


def key_of(arg: int) -> CacheKey:
    return CacheKey(hashlib.blake2b(str(arg).encode(), digest_size=16).hexdigest())


@pytest.fixture
def cluster(redis_cluster: RedisClusterServers) -> RedisClusterServers:
    """The session's cluster, emptied for the test."""
    redis_cluster.flush()
    return redis_cluster


@pytest.fixture
def admin(cluster: RedisClusterServers) -> Iterator[RedisCluster]:
    client = cluster.client()
    yield client
    client.close()


def tier_on(url: str, **options) -> RedisTier:
    return RedisTier(url, secret=SECRET, socket_timeout=1.0, connect_timeout=1.0, **options)


# -- the connection factory and the configuration --------------------------------------------------------------


def test_the_url_scheme_chooses_the_client(cluster: RedisClusterServers, redis_url: str) -> None:
    with connect(cluster.url) as client:
        assert isinstance(client, RedisCluster)
        assert {node.port for node in client.get_primaries()} == set(cluster.ports)
    with connect(redis_url) as client:
        assert type(client) is redis.Redis
    assert RedisConfig(url=cluster.url).url == cluster.url
    assert cluster_url("rediss+cluster://u:pw@a:7000,b:7001/0?ssl_cert_reqs=none") == (
        [("a", 7000), ("b", 7001)], "rediss://u:pw@a:7000?ssl_cert_reqs=none"
    )


def test_a_cluster_url_is_checked_at_the_edge() -> None:
    from evocache.controller import StoreConfigError

    with pytest.raises(StoreConfigError, match=r"redis\.url: .*a Redis Cluster has database 0 only, not '2'"):
        RedisConfig(url="redis+cluster://127.0.0.1:7000/2")
    with pytest.raises(StoreConfigError, match=r"redis\.url: .*'127\.0\.0\.1:x' is not host:port"):
        RedisConfig(url="redis+cluster://127.0.0.1:x")


def test_a_cluster_none_of_whose_nodes_answers_is_a_connection_error() -> None:
    from _helpers import free_port

    port = free_port()
    with pytest.raises(redis.ConnectionError, match=rf"Redis Cluster 127\.0\.0\.1:{port}: "):
        connect(f"redis+cluster://127.0.0.1:{port}", socket_timeout=0.2, connect_timeout=0.2)


# -- L2 --------------------------------------------------------------------------------------------------------


def test_l2_set_get_delete_over_namespaces_in_different_slots(cluster: RedisClusterServers, admin) -> None:
    tier = tier_on(cluster.url)
    entries = {
        (ns, key_of(i)): Entry(f"{ns}/{i}".encode(), None, 0.0) for ns in NAMESPACES for i in range(20)
    }
    for ns in NAMESPACES:
        tier.set_many(ns, [(key, e) for (space, key), e in entries.items() if space == ns])
    # The namespaces are spread over every primary; each one's entries and bookkeeping share its slot.
    slots = {ns: admin.keyslot(f"evc:{{{ns}}}:{key_of(0)}") for ns in NAMESPACES}
    assert len(set(slots.values())) == len(NAMESPACES)
    owners = {admin.get_node_from_key(f"evc:{{{ns}}}:x").port for ns in NAMESPACES}
    assert owners == set(cluster.ports)
    for ns in NAMESPACES:
        assert admin.keyslot(f"evc:{{{ns}}}:#sizes") == slots[ns]
        keys = [key_of(i) for i in range(25)]  # five never stored
        assert tier.get_many(ns, keys) == [entries.get((ns, key)) for key in keys]
        assert tier.get_many(ns, [key_of(3)]) == [entries[(ns, key_of(3))]]  # the single-key read path
    assert tier.delete(NAMESPACES[0], [key_of(0), key_of(1), key_of(99)]) == 2
    assert tier.get_many(NAMESPACES[0], [key_of(0), key_of(1), key_of(2)]) == [
        None, None, entries[(NAMESPACES[0], key_of(2))]
    ]
    assert tier.get_many(NAMESPACES[1], [key_of(0)]) == [entries[(NAMESPACES[1], key_of(0))]]
    tier.close()


def test_l2_ttl_travels_to_the_cluster(cluster: RedisClusterServers, admin) -> None:
    clock = FakeClock()
    tier = tier_on(cluster.url, clock=clock)
    ns = NAMESPACES[2]
    lasting, brief = Entry(b"lasting", None, clock.now), Entry(b"brief", clock.now + 30, clock.now)
    tier.set_many(ns, [(key_of(1), lasting), (key_of(2), brief)])
    assert admin.pttl(f"evc:{{{ns}}}:{key_of(1)}") == -1
    assert 29_000 < admin.pttl(f"evc:{{{ns}}}:{key_of(2)}") <= 30_000
    clock.advance(30)  # the entry's own expiry, read on the tier's clock
    assert tier.get_many(ns, [key_of(1), key_of(2)]) == [lasting, None]
    tier.close()


def test_l2_quotas_per_tenant_on_a_cluster(cluster: RedisClusterServers, admin) -> None:
    value = b"v" * 100
    probe = tier_on(cluster.url)
    probe.set_many(NAMESPACES[0], [(key_of(0), Entry(value, None, 0.0))])
    size = probe.usage(NAMESPACES[0])
    probe.close()
    cluster.flush()
    limited, other = NAMESPACES[3], NAMESPACES[4]
    tier = tier_on(cluster.url, quota=lambda ns: 3 * size if ns == limited else None)
    e = Entry(value, None, 0.0)
    tier.set_many(other, [(key_of(a), e) for a in range(5)])
    for a in range(1, 6):
        tier.set_many(limited, [(key_of(a), e)])
    assert tier.usage(limited) == 3 * size
    assert admin.exists(f"evc:{{{limited}}}:{key_of(1)}") == 0  # evicted, not just hidden
    present = [a for a in range(1, 6) if tier.get_many(limited, [key_of(a)])[0] is not None]
    assert present == [3, 4, 5]
    tier.get_many(limited, [key_of(3)])  # a hit under a quota refreshes its place: 4 is now the oldest
    tier.set_many(limited, [(key_of(6), e)])
    assert [a for a in range(1, 7) if tier.get_many(limited, [key_of(a)])[0] is not None] == [3, 5, 6]
    assert tier.usage(other) == 5 * size
    assert tier.usage() == 8 * size  # every namespace, from the namespaces set in its own slot
    tier.close()


def test_corrupt_and_forged_entries_are_refused_on_a_cluster(cluster: RedisClusterServers, admin) -> None:
    tier = tier_on(cluster.url)
    a, b = NAMESPACES[5], NAMESPACES[6]
    tier.set_many(a, [(key_of(1), Entry(b"answer", None, 0.0)), (key_of(2), Entry(b"other", None, 0.0))])
    blob = admin.get(f"evc:{{{a}}}:{key_of(1)}")
    admin.set(f"evc:{{{a}}}:{key_of(2)}", blob[:-1] + bytes([blob[-1] ^ 1]))  # one flipped bit
    admin.set(f"evc:{{{b}}}:{key_of(1)}", blob)  # tenant a's entry planted under tenant b's name
    assert tier.get_many(a, [key_of(2)]) == [None]
    assert tier.get_many(b, [key_of(1)]) == [None]
    assert admin.exists(f"evc:{{{b}}}:{key_of(1)}") == 0  # deleted
    assert tier.get_many(a, [key_of(1)]) == [Entry(b"answer", None, 0.0)]
    tier.close()


POLICY = """
policy: shared
version: 1
defaults: {ttl: 10m, tiers: [l1, l2]}
rules:
  - name: answers
    when: true
"""


def test_two_replicas_share_l2_through_the_cluster(cluster: RedisClusterServers) -> None:
    def replica():
        config = StoreConfig(l1=L1Config(), redis=RedisConfig(url=cluster.url, timeout_s=1.0))
        return build_runtime(config, policy=parse_policy(POLICY))

    calls: list[str] = []
    a, b = replica(), replica()

    def model_on(runtime):
        @cache_if("true", name="answer", model="m", store=runtime)
        def answer(prompt: str) -> str:
            calls.append(prompt)
            return f"answer to {prompt}"

        return answer

    answer_a, answer_b = model_on(a), model_on(b)
    with tenant_scope("acme"):
        assert [answer_a(f"q{i}") for i in range(10)] == [f"answer to q{i}" for i in range(10)]
        assert [answer_b(f"q{i}") for i in range(10)] == [f"answer to q{i}" for i in range(10)]
    assert calls == [f"q{i}" for i in range(10)]
    assert [e.tier for e in b.events.events() if e.outcome == "hit"] == [L2] * 10
    a.close(), b.close()


# -- the event stream ------------------------------------------------------------------------------------------


def test_events_are_written_to_and_read_back_from_the_cluster(cluster: RedisClusterServers) -> None:
    sink = RedisStreamSink(cluster.url, stream="evc:events", socket_timeout=1.0)
    events = [
        AccessEvent(1.0 + i, key_of(i), "tenant-a", "r", "p@1", "miss", None, 10, 0.1, 0.0) for i in range(300)
    ]
    for event in events:
        sink.emit(event)
    sink.flush()
    assert sink.read(count=1000) == events
    assert sink.errors == 0
    sink.close()


# -- the policy store ------------------------------------------------------------------------------------------


def doc(version: int) -> str:
    return f"policy: chat\nversion: {version}\ndefaults: {{ttl: 5m}}\nrules: []\n"


def test_policy_store_operations_and_a_follower_on_a_cluster(cluster: RedisClusterServers, admin) -> None:
    writer = RedisPolicyStore(cluster.url, "t:policy")
    watcher = RedisPolicyStore(cluster.url, "t:policy")
    seen = []
    follower = PolicyFollower(RedisPolicyStore(cluster.url, "t:policy"), "r1", seen.append)
    try:
        assert watcher.wait(0.01) is False  # subscribes
        assert writer.apply(doc(1)).active == "chat@1"
        assert watcher.wait(10.0) is True  # the change message, published on the state's primary
        state = writer.apply(doc(2), canary=0.25)
        assert (state.active, state.canary, state.fraction) == ("chat@1", "chat@2", 0.25)
        assert follower.poll().canary.ref == parse_policy(doc(2)).ref
        assert writer.promote().active == "chat@2"
        assert writer.rollback().active == "chat@1"
        assert watcher.state() == writer.state() and writer.state().serial == 4
        assert [r.replica_id for r in writer.status().replicas] == ["r1"]
        names = admin.scan_iter(match="*", target_nodes=RedisCluster.PRIMARIES)  # every primary
        assert sorted(k.decode() for k in names) == [
            "{t:policy}:replicas", "{t:policy}:state", "{t:policy}:v:chat@1", "{t:policy}:v:chat@2"
        ]
        assert isinstance(writer.state(), PolicyState)
    finally:
        follower.store.close()
        watcher.close()
        writer.close()


# -- the shared semantic index ---------------------------------------------------------------------------------


def test_the_shared_semantic_index_is_shared_through_the_cluster(cluster: RedisClusterServers, admin) -> None:
    scope = Scope("tenant-a", "fn=chat|model=m1|emb=test")
    other = Scope("tenant-b", scope.boundary)
    rows = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    vecs = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    first = SharedIndex(cluster.url, secret=SECRET, prefix="evc-sem", follow=False, socket_timeout=1.0)
    first.add(scope, ["a0", "a1"], vecs[:2], metas=[{"answer": "r0"}, {"answer": "r1"}])
    first.add(other, ["b0"], vecs[2:])
    second = SharedIndex(cluster.url, secret=SECRET, prefix="evc-sem", follow=False, socket_timeout=1.0)
    try:
        assert [[n.entry_id for n in row] for row in second.search(scope, vecs[:1], 2)] == [["a0", "a1"]]
        assert second.get(scope, "a1") == SharedEntry({"answer": "r1"}, None)
        assert [[n.entry_id for n in row] for row in second.search(other, vecs[:1], 2)] == [["b0"]]
        first.remove(scope, ["a0"])
        assert second.follow_once() == 1
        assert [[n.entry_id for n in row] for row in second.search(scope, vecs[:1], 2)] == [["a1"]]
        names = list(admin.scan_iter(match="*", target_nodes=RedisCluster.PRIMARIES))
        assert names and all(name.startswith(b"{evc-sem}:") for name in names)
        assert {admin.keyslot(name) for name in names} == {admin.keyslot("{evc-sem}")}
        assert first.stats().errors == 0 and second.stats().errors == 0
    finally:
        first.close()
        second.close()


# -- the API-key store -----------------------------------------------------------------------------------------


def test_api_keys_in_a_cluster(cluster: RedisClusterServers) -> None:
    from evocache.serving._auth import RedisKeyStore  # the serving room's: imported by its test alone
    from evocache.serving.errors import Unauthenticated

    store = RedisKeyStore.from_url(cluster.url)
    store.add("sk-alpha", Tenant("acme", "pro"))
    assert store.tenant_for("sk-alpha") == Tenant("acme", "pro")
    store.revoke("sk-alpha")
    with pytest.raises(Unauthenticated):
        store.tenant_for("sk-alpha")
    store.client.close()


# -- a node dies -----------------------------------------------------------------------------------------------


def test_a_killed_node_is_a_counted_miss_never_a_failed_call() -> None:
    own = RedisClusterServers(3, full_coverage=False).start()  # the other primaries serve on
    try:
        clock = FakeClock()
        l2 = RedisTier(
            own.url, secret=SECRET, clock=clock, socket_timeout=0.5, connect_timeout=0.5, retry_after=1.0
        )
        store = TieredStore([MemoryTier(1 << 20, clock=clock), l2], clock=clock)
        with own.client() as admin:
            owner = {ns: admin.get_node_from_key(f"evc:{{{ns}}}:x").port for ns in NAMESPACES}
        dead_port = owner[NAMESPACES[0]]
        on_dead = [ns for ns in NAMESPACES if owner[ns] == dead_port]
        alive = [ns for ns in NAMESPACES if owner[ns] != dead_port]
        assert on_dead and alive
        for ns in NAMESPACES:
            store.set(ns, key_of(1), Entry(ns.encode(), None, clock.now))

        own.kill(own.ports.index(dead_port))
        for ns in on_dead:
            with pytest.raises(TierUnavailable):
                l2.get_many(ns, [key_of(1)])  # at the tier: unavailable
            clock.advance(1.0)  # past retry_after: the next call goes to the network again
            # Through the store: a miss (the L1 copy is not asked for), counted, never raised.
            assert store.get(ns, key_of(1), tiers=[L2]).entry is None
            clock.advance(1.0)
        assert store.error_counts.get((L2, "get"), 0) >= len(on_dead)
        # The primaries that live still serve their tenants once the breaker lets calls through again.
        clock.advance(1.0)
        for ns in alive:
            found = store.get(ns, key_of(1), tiers=[L2])
            assert (found.tier, found.entry.value) == (L2, ns.encode())
        store.close()
    finally:
        own.close()
