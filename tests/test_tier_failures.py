"""Tier failures become counted misses, never failed calls; Redis comes back without a restart of anything.

Also the L2 quotas: a namespace over its quota loses its own oldest entries and nobody else's.
"""

from __future__ import annotations

import errno
import hashlib
import sqlite3
import time

import pytest
import redis
from _helpers import FakeClock
from _redis_server import RedisServer

from evocache.controller._codec import encoded_size
from evocache.controller._types import L1, L2, L3, CacheKey, Entry, Namespace
from evocache.controller.errors import TierUnavailable
from evocache.controller.tiers._disk import DiskTier
from evocache.controller.tiers._memory import MemoryTier
from evocache.controller.tiers._redis import RedisTier
from evocache.controller.tiers._tiered import Lookup, TieredStore

NS = Namespace("tenant-a")
SECRET = b"the test deployment's secret"  # signs the entries of the L2 and L3 tiers
OTHER = Namespace("tenant-b")


class WallClock(FakeClock):
    """Real time plus an offset the test moves (``now``): Redis sees real TTLs, the breaker's pause can be
    skipped."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def __call__(self) -> float:
        return time.time() + self.now


def key_of(arg: int) -> CacheKey:
    return CacheKey(hashlib.blake2b(str(arg).encode(), digest_size=16).hexdigest())


def compute(arg: int) -> bytes:
    return f"result of {arg}".encode()


def cached_call(store: TieredStore, clock, arg: int) -> bytes:
    """What @cache_if does around a call, reduced to the store traffic."""
    found = store.get(NS, key_of(arg))
    if found.entry is not None:
        return found.entry.value
    value = compute(arg)
    store.set(NS, key_of(arg), Entry(value, expires_at=clock() + 600, created_at=clock()))
    return value


# -- Redis dies mid-traffic and comes back ------------------------------------------------------------------


@pytest.mark.redis
def test_redis_killed_mid_traffic_then_restarted(restartable_redis: RedisServer, tmp_path) -> None:
    clock = WallClock()
    errors: list[tuple[str, str]] = []
    l2 = RedisTier(restartable_redis.url, secret=SECRET, clock=clock, retry_after=1.0)
    store = TieredStore(
        [MemoryTier(1 << 24, clock=clock), l2, DiskTier(tmp_path, clock=clock)],
        clock=clock,
        on_error=lambda tier, op, exc: errors.append((tier, op)),
    )
    # Each argument is called twice in a row: a miss through every tier, then an L1 hit.
    args = [i // 2 for i in range(500)]
    results = []
    for n, arg in enumerate(args):
        if n == 200:
            restartable_redis.stop()  # SIGKILL, between two calls: the pooled connection is now dead
        results.append(cached_call(store, clock, arg))

    assert results == [compute(arg) for arg in args]  # zero failed calls
    # Arguments 100..249 were new after the kill: each one's L2 read and L2 write failed, nothing else did.
    assert store.error_counts == {(L2, "get"): 150, (L2, "set"): 150}
    assert errors == [(L2, "get"), (L2, "set")] * 150
    assert store.tiers[L3].get_many(NS, [key_of(249)]) == [store.tiers[L1].get_many(NS, [key_of(249)])[0]]

    restartable_redis.start()  # same port, empty
    clock.advance(1.0)  # past retry_after: the next call goes to the network again
    assert cached_call(store, clock, 1000) == compute(1000)
    assert store.error_counts == {(L2, "get"): 150, (L2, "set"): 150}  # no new failure
    assert store.get(NS, key_of(1000), tiers=[L2]) == Lookup(store.get(NS, key_of(1000)).entry, L2)
    # An entry written while Redis was down comes back from L3 and is promoted into the new Redis.
    assert store.get(NS, key_of(249), tiers=[L2, L3]).tier == L3
    assert store.get(NS, key_of(249), tiers=[L2, L3]).tier == L2
    store.close()


@pytest.mark.redis
def test_slow_redis_is_a_counted_miss(redis_url: str) -> None:
    clock = WallClock()
    l2 = RedisTier(redis_url, secret=SECRET, clock=clock, socket_timeout=0.05, retry_after=1.0)
    store = TieredStore([l2], clock=clock)
    stored = Entry(b"v", expires_at=None, created_at=0.0)
    store.set(NS, key_of(1), stored)
    with redis.Redis.from_url(redis_url) as admin:
        # Redis holds every client's commands for 300 ms, as a Redis busy with a slow script would.
        admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
        assert store.get(NS, key_of(1)) == Lookup(None, None)
        assert store.error_counts == {(L2, "get"): 1}
        admin.ping()  # answers once the pause is over
    assert store.get(NS, key_of(1)) == Lookup(None, None)  # the breaker is open: skipped, still counted
    assert store.error_counts == {(L2, "get"): 2}
    clock.advance(1.0)
    assert store.get(NS, key_of(1)) == Lookup(stored, L2)
    store.close()


class Recorder:
    """Stands in for the Redis client and records every attribute the tier touches on it."""

    def __init__(self, real: redis.Redis) -> None:
        self.real = real
        self.touched: list[str] = []

    def __getattr__(self, name: str):
        self.touched.append(name)
        return getattr(self.real, name)


@pytest.mark.redis
def test_the_breaker_keeps_calls_off_the_network(restartable_redis: RedisServer) -> None:
    clock = WallClock()
    tier = RedisTier(restartable_redis.url, secret=SECRET, clock=clock, retry_after=5.0)
    restartable_redis.stop()
    with pytest.raises(TierUnavailable, match="l2: get: ConnectionError"):
        tier.get_many(NS, [key_of(1)])
    restartable_redis.start()
    recorder = Recorder(tier._client)
    tier._client = recorder
    clock.advance(4.9)
    for call in (
        lambda: tier.get_many(NS, [key_of(1)]),
        lambda: tier.set_many(NS, [(key_of(1), Entry(b"v", None, 0.0))]),
        lambda: tier.delete(NS, [key_of(1)]),
        lambda: tier.usage(NS),
    ):
        with pytest.raises(TierUnavailable, match=r"skipped: Redis failed less than 5\.0s ago"):
            call()
    assert recorder.touched == []
    clock.advance(0.1)
    assert tier.get_many(NS, [key_of(1)]) == [None]
    assert recorder.touched == ["mget"]  # get_many: MGET (get_one: GET)
    tier.close()


@pytest.mark.redis
def test_redis_out_of_memory_is_unavailable(tmp_path) -> None:
    server = RedisServer(maxmemory="2mb").start()
    try:
        tier = RedisTier(server.url, secret=SECRET, socket_timeout=1.0)
        with pytest.raises(
            TierUnavailable, match="l2: set: OutOfMemoryError: command not allowed when used memory"
        ):
            tier.set_many(NS, [(key_of(1), Entry(b"x" * 4_000_000, None, 0.0))])
        tier.close()
    finally:
        server.close()


@pytest.mark.redis
def test_scripts_are_reloaded_after_a_script_flush(redis_url: str) -> None:
    tier = RedisTier(redis_url, secret=SECRET, quota=lambda ns: 10_000)
    e = Entry(b"v", None, 0.0)
    tier.set_many(NS, [(key_of(1), e)])
    with redis.Redis.from_url(redis_url) as admin:
        admin.script_flush()
    assert tier.get_many(NS, [key_of(1)]) == [e]  # the quota path pipelines EVALSHA with the MGET
    tier.set_many(NS, [(key_of(2), e)])
    assert tier.usage(NS) == 2 * encoded_size(e)
    tier.close()


def test_a_missing_redis_server_says_how_to_get_one(monkeypatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"run `make test` .* apt-get install redis-server"):
        RedisServer()


# -- the disk fills up --------------------------------------------------------------------------------------


def test_disk_full_is_a_counted_skipped_write(tmp_path, monkeypatch) -> None:
    l1, l3 = MemoryTier(1 << 20), DiskTier(tmp_path)
    store = TieredStore([l1, l3])
    before, after = Entry(b"before", None, 0.0), Entry(b"after", None, 0.0)
    store.set(NS, key_of(1), before)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(l3._cache, "set", full)
    store.set(NS, key_of(2), after)
    assert store.error_counts == {(L3, "set"): 1}
    assert store.get(NS, key_of(2)) == Lookup(after, L1)  # the other tiers took the write
    assert store.get(NS, key_of(2), tiers=[L3]) == Lookup(None, None)
    assert store.get(NS, key_of(1), tiers=[L3]) == Lookup(before, L3)  # reads still work
    assert store.error_counts == {(L3, "set"): 1}
    store.close()


def test_disk_errors_are_unavailable(tmp_path, monkeypatch) -> None:
    tier = DiskTier(tmp_path)

    def locked(*args, **kwargs):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(tier._cache, "get", locked)
    with pytest.raises(TierUnavailable, match="l3: get: OperationalError: database is locked"):
        tier.get_many(NS, [key_of(1)])
    tier.close()


# -- L2 quotas ----------------------------------------------------------------------------------------------

VALUE = b"q" * 100
SIZE = encoded_size(Entry(VALUE, None, 0.0))  # every entry below weighs the same


def quota_tier(url: str, entries: int) -> RedisTier:
    return RedisTier(url, secret=SECRET, quota={NS: entries * SIZE, OTHER: 2 * SIZE}.get)


def present(tier: RedisTier, ns: Namespace, args: range) -> list[int]:
    return [
        a for a, e in zip(args, tier.get_many(ns, [key_of(a) for a in args]), strict=True) if e is not None
    ]


@pytest.mark.redis
def test_quota_evicts_the_namespaces_oldest_and_nobody_elses(redis_url: str) -> None:
    tier = quota_tier(redis_url, 3)
    unlimited = Namespace("tenant-c")
    e = Entry(VALUE, None, 0.0)
    tier.set_many(unlimited, [(key_of(a), e) for a in range(10)])
    tier.set_many(OTHER, [(key_of(a), e) for a in (1, 2)])
    for a in (1, 2, 3, 4):
        tier.set_many(NS, [(key_of(a), e)])
    assert tier.usage(NS) == 3 * SIZE
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.exists(f"evc:{NS}:{key_of(1)}") == 0  # evicted, not just hidden
    assert present(tier, NS, range(1, 5)) == [2, 3, 4]  # this read refreshes 2, 3 and 4, in that order
    tier.get_many(NS, [key_of(2)])  # 2 is now the most recently used
    tier.set_many(NS, [(key_of(5), e)])
    assert present(tier, NS, range(1, 6)) == [2, 4, 5]
    # A batch that alone fills the quota evicts everything older, oldest first, and keeps itself.
    tier.set_many(NS, [(key_of(a), e) for a in (6, 7, 8)])
    assert present(tier, NS, range(1, 9)) == [6, 7, 8]
    assert present(tier, OTHER, range(1, 3)) == [1, 2]
    assert present(tier, unlimited, range(10)) == list(range(10))
    assert tier.usage(OTHER) == 2 * SIZE
    assert tier.usage(unlimited) == 10 * SIZE
    tier.close()


@pytest.mark.redis
def test_quota_rejects_an_entry_larger_than_the_quota(redis_url: str) -> None:
    tier = quota_tier(redis_url, 3)
    small, huge = Entry(VALUE, None, 0.0), Entry(b"h" * (3 * SIZE), None, 0.0)
    tier.set_many(NS, [(key_of(1), small), (key_of(2), small)])
    tier.set_many(NS, [(key_of(3), huge)])
    assert tier.get_many(NS, [key_of(1), key_of(2), key_of(3)]) == [small, small, None]
    assert tier.usage(NS) == 2 * SIZE
    tier.close()


@pytest.mark.redis
def test_quota_counts_overwrites_once(redis_url: str) -> None:
    tier = quota_tier(redis_url, 3)
    e = Entry(VALUE, None, 0.0)
    tier.set_many(NS, [(key_of(a), e) for a in (1, 2, 3)])
    tier.set_many(NS, [(key_of(1), e)] * 5)  # rewriting 1 makes it the youngest; nothing else moves
    assert tier.usage(NS) == 3 * SIZE
    tier.set_many(NS, [(key_of(4), e)])
    assert present(tier, NS, range(1, 5)) == [1, 3, 4]
    tier.close()


@pytest.mark.redis
def test_quota_space_of_expired_entries_is_reused_first(redis_url: str) -> None:
    tier = quota_tier(redis_url, 3)
    now = time.time()
    lasting, brief = Entry(VALUE, None, now), Entry(VALUE, now + 0.1, now)
    tier.set_many(NS, [(key_of(1), lasting), (key_of(2), brief), (key_of(3), brief)])
    assert tier.usage(NS) == 3 * SIZE
    time.sleep(0.3)  # Redis expires 2 and 3 on its own
    tier.set_many(NS, [(key_of(4), lasting), (key_of(5), lasting)])
    # Their sizes were released before the quota was checked: the oldest live entry, 1, was kept.
    assert present(tier, NS, range(1, 6)) == [1, 4, 5]
    assert tier.usage(NS) == 3 * SIZE
    tier.close()


@pytest.mark.redis
def test_the_breaker_keeps_single_reads_off_the_pool(restartable_redis: RedisServer) -> None:
    """get_one (the request path's read) talks to a pooled connection directly: while the breaker is open it
    must not even take one."""
    clock = WallClock()
    tier = RedisTier(restartable_redis.url, secret=SECRET, clock=clock, retry_after=5.0)
    restartable_redis.stop()
    with pytest.raises(TierUnavailable, match="l2: get: ConnectionError"):
        tier.get_one(NS, key_of(1))
    restartable_redis.start()
    recorder = Recorder(tier._pool)
    tier._pool = recorder
    clock.advance(4.9)
    with pytest.raises(TierUnavailable, match=r"skipped: Redis failed less than 5\.0s ago"):
        tier.get_one(NS, key_of(1))
    assert recorder.touched == []
    clock.advance(0.1)
    assert tier.get_one(NS, key_of(1)) is None
    assert recorder.touched == ["get_connection", "release"]
    tier.close()


@pytest.mark.redis
def test_a_connection_left_out_of_step_is_dropped_not_decoded(redis_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A pooled connection holding an unread reply of another command (an exchange interrupted elsewhere) must
    not hand that reply to a GET: the read is a counted miss and the connection is replaced. (redis-py's pool
    checks a connection for unread data when it hands it out; the reply can still arrive after that check, which
    is what handing the connection over directly stands for here.)"""
    tier = RedisTier(redis_url, secret=SECRET, socket_timeout=1.0)
    tier.set_many(NS, [(key_of(1), Entry(b"value", None, 0.0))])
    pool = tier._pool
    conn = pool.get_connection()
    conn.send_command("MGET", "a", "b")  # its array reply is left unread
    handed = iter([conn])
    get_connection = pool.get_connection
    monkeypatch.setattr(pool, "get_connection", lambda *a, **k: next(handed, None) or get_connection(*a, **k))
    with pytest.raises(TierUnavailable, match="out-of-step reply to GET: list"):
        tier.get_one(NS, key_of(1))
    pool.release(conn)
    tier.breaker.open_until = 0.0  # the breaker opened; close it to read again at once
    assert tier.get_one(NS, key_of(1)).value == b"value"  # a fresh connection, in step
    tier.close()


@pytest.mark.redis
def test_a_foreign_value_under_one_key_fails_that_key_alone(redis_url: str) -> None:
    """Another program's list under one of our names (WRONGTYPE) makes that read a counted miss; Redis itself
    works, so the breaker stays closed and every other key is read at once."""
    tier = RedisTier(redis_url, secret=SECRET, socket_timeout=1.0, retry_after=60.0)
    tier.set_many(NS, [(key_of(2), Entry(b"fine", None, 0.0))])
    raw = redis.Redis.from_url(redis_url)
    raw.rpush(f"evc:{NS}:{key_of(1)}", b"not ours")
    try:
        with pytest.raises(TierUnavailable, match="l2: get: ResponseError: WRONGTYPE"):
            tier.get_one(NS, key_of(1))
        # MGET answers nil for a key of another type: a plain miss in a batch
        assert [e and e.value for e in tier.get_many(NS, [key_of(1), key_of(2)])] == [None, b"fine"]
        assert tier.get_one(NS, key_of(2)).value == b"fine"  # no "skipped: Redis failed" refusal
        assert tier.breaker.open_until == 0.0
    finally:
        raw.delete(f"evc:{NS}:{key_of(1)}")
        raw.close()
        tier.close()


@pytest.mark.redis
def test_a_success_that_began_before_the_breaker_opened_does_not_close_it(redis_url: str) -> None:
    """Two calls in flight: one fails (the breaker opens), the other, begun before, succeeds after. The failure is
    the newer evidence: the breaker stays open. A call begun after it opened (a probe once the pause is over)
    closes it."""
    clock = WallClock()
    tier = RedisTier(redis_url, secret=SECRET, socket_timeout=1.0, retry_after=5.0, clock=clock)
    tier.set_many(NS, [(key_of(1), Entry(b"v", None, 0.0))])
    real_get = tier._get

    def get_while_another_call_fails(name: str) -> bytes | None:
        blob = real_get(name)
        with pytest.raises(TierUnavailable):  # another thread's call fails meanwhile
            tier._backend("set").trip(redis.ConnectionError("connection reset"))
        return blob

    tier._get = get_while_another_call_fails
    assert tier.get_one(NS, key_of(1)).value == b"v"
    tier._get = real_get
    with pytest.raises(TierUnavailable, match="skipped: Redis failed less than 5.0s ago"):
        tier.get_one(NS, key_of(1))
    with pytest.raises(TierUnavailable, match="skipped"):  # the context-manager path too
        tier.delete(NS, [key_of(1)])

    guard = tier._backend("delete")  # the same race through a guarded call
    clock.advance(5.0)
    guard.__enter__()
    with pytest.raises(TierUnavailable):
        tier._backend("set").trip(redis.ConnectionError("connection reset"))
    guard.__exit__(None, None, None)
    assert tier.breaker.open_until > 0.0
    clock.advance(5.0)
    assert tier.get_one(NS, key_of(1)).value == b"v"  # a probe after the pause closes it
    assert tier.breaker.open_until == 0.0
    tier.close()
