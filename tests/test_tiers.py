"""The shared tier suite: every Tier implementation (L1 memory, L2 Redis, L3 disk) runs the same tests.

Time is a fake clock wherever a tier reads one (all three do). Redis also keeps its own TTLs in real time; the
few Redis-only tests that need Redis to expire something use a TTL of a few tens of milliseconds and check the
outcome after a wait, never how long anything took.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evocache.controller._codec import encoded_size
from evocache.controller._types import L1, L2, L3, CacheKey, Entry, Namespace, TierName
from evocache.controller.tiers._base import Tier
from evocache.controller.tiers._disk import DiskTier
from evocache.controller.tiers._memory import MemoryTier
from evocache.controller.tiers._redis import RedisTier

NS_A = Namespace("tenant-a")
NS_B = Namespace("tenant-b")
K1, K2, K3, K4 = (CacheKey(f"{i:016x}") for i in (0xA1, 0xB2, 0xC3, 0xD4))
T0 = 1_700_000_000.0
SECRET = b"the test deployment's secret"  # signs the entries of the L2 and L3 tiers


def entry(value: bytes = b"value", *, ttl: float | None = None, now: float = T0, **fields) -> Entry:
    return Entry(value, expires_at=None if ttl is None else now + ttl, created_at=now, **fields)


@dataclass
class Harness:
    """A tier under test with what the suite needs to see around it."""

    name: TierName
    tier: Tier
    clock: Callable[[], float]
    faults: list[tuple[str, str]]
    footprint: Callable[[Namespace, CacheKey, Entry], int]
    raw_get: Callable[[Namespace, CacheKey], bytes | None] | None = None
    raw_set: Callable[[Namespace, CacheKey, bytes], None] | None = None
    cleanup: list[Callable[[], None]] = field(default_factory=list)


def memory_harness(clock, faults, **_) -> Harness:
    tier = MemoryTier(1 << 24, clock=clock, on_fault=lambda t, k: faults.append((t, k)))
    return Harness(L1, tier, clock, faults, lambda ns, key, e: e.size + len(key))


def redis_harness(clock, faults, *, url: str, prefix: str = "evc", **_) -> Harness:
    tier = RedisTier(
        url, secret=SECRET, prefix=prefix, clock=clock, on_fault=lambda t, k: faults.append((t, k))
    )
    raw = redis.Redis.from_url(url)
    return Harness(
        L2,
        tier,
        clock,
        faults,
        lambda ns, key, e: encoded_size(e),
        raw_get=lambda ns, key: raw.get(f"{prefix}:{ns}:{key}"),
        raw_set=lambda ns, key, blob: raw.set(f"{prefix}:{ns}:{key}", blob, keepttl=True),
        cleanup=[tier.close, raw.close],
    )


def disk_harness(clock, faults, *, directory: str, **_) -> Harness:
    tier = DiskTier(directory, clock=clock, on_fault=lambda t, k: faults.append((t, k)))
    cache = tier._cache  # the raw store, to damage entries behind the tier's back
    return Harness(
        L3,
        tier,
        clock,
        faults,
        lambda ns, key, e: encoded_size(e),
        raw_get=lambda ns, key: cache.get(f"{ns}:{key}"),
        raw_set=lambda ns, key, blob: cache.set(f"{ns}:{key}", blob, tag=ns),
        cleanup=[tier.close],
    )


HARNESSES = {"memory": memory_harness, "redis": redis_harness, "disk": disk_harness}
ALL = [pytest.param("memory"), pytest.param("redis", marks=pytest.mark.redis), pytest.param("disk")]
STORED = [pytest.param("redis", marks=pytest.mark.redis), pytest.param("disk")]


def _harness(request: pytest.FixtureRequest, kind: str, clock, tmp_path) -> Iterator[Harness]:
    url = request.getfixturevalue("redis_url") if kind == "redis" else ""
    h = HARNESSES[kind](clock, [], url=url, directory=str(tmp_path / "l3"))
    yield h
    for close in h.cleanup:
        close()


@pytest.fixture(params=ALL)
def h(request, fake_clock, tmp_path) -> Iterator[Harness]:
    yield from _harness(request, request.param, fake_clock, tmp_path)


@pytest.fixture(params=STORED)
def stored(request, fake_clock, tmp_path) -> Iterator[Harness]:
    yield from _harness(request, request.param, fake_clock, tmp_path)


# -- the contract, for every tier --------------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [1e15, 1e300, float("inf"), float("nan")])
def test_a_ttl_past_what_the_backend_holds_is_stored(h: Harness, ttl: float) -> None:
    # Redis keeps a TTL as an integer of milliseconds (a Lua number in a script): past 2**53 ms it refuses the
    # write. The tier holds such an entry for the longest TTL it can; the entry keeps its own expiry.
    long_lived = entry(b"long-lived", ttl=ttl)
    h.tier.set_many(NS_A, [(K1, long_lived)])
    (got,) = h.tier.get_many(NS_A, [K1])
    assert got is not None and got.value == b"long-lived"
    assert repr(got.expires_at) == repr(long_lived.expires_at)  # nan included
    assert h.faults == []


def test_round_trip(h: Harness) -> None:
    items = [
        (K1, entry(b"plain")),
        (
            K2,
            entry(b"x" * 100_000, ttl=60, rule="long-context", saved_ms=812.5),
        ),  # past diskcache's file size
        (K3, entry(b"", ttl=5, sliding_ttl=5.0)),
    ]
    h.tier.set_many(NS_A, items)
    assert h.tier.get_many(NS_A, [K1, K2, K3]) == [e for _, e in items]


def test_batch_keeps_order_with_misses_and_repeats(h: Harness) -> None:
    e1, e3 = entry(b"one"), entry(b"three")
    h.tier.set_many(NS_A, [(K1, e1), (K3, e3)])
    assert h.tier.get_many(NS_A, [K3, K2, K1, K4, K3]) == [e3, None, e1, None, e3]


def test_empty_batches(h: Harness) -> None:
    h.tier.set_many(NS_A, [])
    assert h.tier.get_many(NS_A, []) == []
    assert h.tier.delete(NS_A, []) == 0
    assert h.tier.usage(NS_A) == 0


def test_overwrite_replaces(h: Harness) -> None:
    h.tier.set_many(NS_A, [(K1, entry(b"old value"))])
    h.tier.set_many(NS_A, [(K1, entry(b"new"))])
    assert h.tier.get_many(NS_A, [K1]) == [entry(b"new")]
    assert h.tier.usage(NS_A) == h.footprint(NS_A, K1, entry(b"new"))


def test_last_write_in_a_batch_wins(h: Harness) -> None:
    h.tier.set_many(NS_A, [(K1, entry(b"first")), (K1, entry(b"second"))])
    assert h.tier.get_many(NS_A, [K1]) == [entry(b"second")]
    assert h.tier.usage(NS_A) == h.footprint(NS_A, K1, entry(b"second"))


def test_expiry_follows_the_tier_clock(h: Harness, fake_clock) -> None:
    h.tier.set_many(NS_A, [(K1, entry(ttl=30)), (K2, entry())])
    fake_clock.advance(29.999)
    assert h.tier.get_many(NS_A, [K1, K2]) == [entry(ttl=30), entry()]
    fake_clock.advance(0.001)  # expires_at is the first instant the entry is dead
    assert h.tier.get_many(NS_A, [K1, K2]) == [None, entry()]


def test_an_expired_entry_is_not_stored(h: Harness, fake_clock) -> None:
    h.tier.set_many(NS_A, [(K1, entry(ttl=-1)), (K2, entry(ttl=0))])
    assert h.tier.get_many(NS_A, [K1, K2]) == [None, None]
    assert h.tier.usage(NS_A) == 0


def test_sliding_entry_renews_on_hit(h: Harness, fake_clock) -> None:
    h.tier.set_many(NS_A, [(K1, entry(ttl=10, sliding_ttl=10.0))])
    fake_clock.advance(8)
    assert h.tier.get_many(NS_A, [K1]) == [entry(ttl=18, sliding_ttl=10.0)]
    fake_clock.advance(8)  # 16 s after the write, 8 s after the hit: alive only because the hit renewed it
    assert h.tier.get_many(NS_A, [K1]) == [entry(ttl=26, sliding_ttl=10.0)]
    fake_clock.advance(10)
    assert h.tier.get_many(NS_A, [K1]) == [None]


def test_a_fixed_entry_does_not_renew(h: Harness, fake_clock) -> None:
    h.tier.set_many(NS_A, [(K1, entry(ttl=10))])
    fake_clock.advance(8)
    assert h.tier.get_many(NS_A, [K1]) == [entry(ttl=10)]
    fake_clock.advance(2)
    assert h.tier.get_many(NS_A, [K1]) == [None]


def test_namespaces_never_cross(h: Harness) -> None:
    a, b = entry(b"for tenant a"), entry(b"for tenant b!")
    h.tier.set_many(NS_A, [(K1, a)])
    assert h.tier.get_many(NS_B, [K1]) == [None]
    h.tier.set_many(NS_B, [(K1, b)])
    assert h.tier.get_many(NS_A, [K1]) == [a]
    assert h.tier.get_many(NS_B, [K1]) == [b]
    assert h.tier.usage(NS_A) == h.footprint(NS_A, K1, a)
    assert h.tier.usage(NS_B) == h.footprint(NS_B, K1, b)
    assert h.tier.delete(NS_A, [K1]) == 1
    assert h.tier.get_many(NS_A, [K1]) == [None]
    assert h.tier.get_many(NS_B, [K1]) == [b]
    assert h.tier.usage(NS_A) == 0
    assert h.tier.usage(NS_B) == h.footprint(NS_B, K1, b)


def test_delete_counts_what_was_present(h: Harness) -> None:
    h.tier.set_many(NS_A, [(K1, entry()), (K2, entry())])
    assert h.tier.delete(NS_A, [K1, K3, K1]) == 1
    assert h.tier.get_many(NS_A, [K1, K2]) == [None, entry()]
    assert h.tier.delete(NS_A, [K1]) == 0


def test_usage_accounting(h: Harness) -> None:
    e1, e2, e3 = entry(b"a" * 10), entry(b"b" * 2000, rule="r"), entry(b"c" * 40_000, ttl=60)
    h.tier.set_many(NS_A, [(K1, e1), (K2, e2)])
    h.tier.set_many(NS_B, [(K3, e3)])
    fa = h.footprint(NS_A, K1, e1) + h.footprint(NS_A, K2, e2)
    fb = h.footprint(NS_B, K3, e3)
    assert (h.tier.usage(NS_A), h.tier.usage(NS_B), h.tier.usage()) == (fa, fb, fa + fb)
    h.tier.delete(NS_A, [K2])
    fa -= h.footprint(NS_A, K2, e2)
    assert (h.tier.usage(NS_A), h.tier.usage(NS_B), h.tier.usage()) == (fa, fb, fa + fb)
    assert h.tier.usage(Namespace("nobody")) == 0


@pytest.mark.parametrize("ns", ["", "a:b", "a b", pytest.param("x" * 129, id="129-chars"), "tenant/a", "é"])
def test_rejects_an_invalid_namespace(h: Harness, ns: str) -> None:
    for call in (
        lambda: h.tier.get_many(ns, [K1]),
        lambda: h.tier.set_many(ns, [(K1, entry())]),
        lambda: h.tier.delete(ns, [K1]),
        lambda: h.tier.usage(ns),
    ):
        with pytest.raises(ValueError, match="invalid namespace"):
            call()


@pytest.mark.parametrize(
    "key",
    [
        "abc",
        "0123456789ABCDEF",
        "0123456789abcdeg",
        pytest.param("f" * 129, id="129-digits"),
        "0" * 16 + ":x",
    ],
)
def test_rejects_an_invalid_key(h: Harness, key: str) -> None:
    for call in (
        lambda: h.tier.get_many(NS_A, [K1, key]),
        lambda: h.tier.set_many(NS_A, [(K1, entry()), (key, entry())]),
        lambda: h.tier.delete(NS_A, [key]),
    ):
        with pytest.raises(ValueError, match="invalid cache key"):
            call()
    assert h.tier.get_many(NS_A, [K1]) == [None]  # a rejected batch stores nothing


# -- a model check: any sequence of writes and deletes leaves the tier equal to a dict ---------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "delete"]),
        st.sampled_from([NS_A, NS_B]),
        st.lists(st.sampled_from([K1, K2, K3, K4]), min_size=1, max_size=3),
        st.integers(0, 3000),
    ),
    max_size=12,
)
_run = itertools.count()


@pytest.mark.parametrize("kind", ALL)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_matches_a_dict_model(request, kind: str, script) -> None:
    url = request.getfixturevalue("redis_url") if kind == "redis" else ""
    with tempfile.TemporaryDirectory() as directory:
        # A prefix of its own per example: one Redis serves every example without a flush in between.
        h = HARNESSES[kind](lambda: T0, [], url=url, directory=directory, prefix=f"m{next(_run)}")
        model: dict[tuple[str, str], Entry] = {}
        for op, ns, keys, size in script:
            if op == "set":
                items = [(key, entry(bytes([i]) * size)) for i, key in enumerate(keys)]
                h.tier.set_many(ns, items)
                model.update(((ns, key), e) for key, e in items)
            else:
                present = len({key for key in keys if (ns, key) in model})
                assert h.tier.delete(ns, keys) == present
                for key in keys:
                    model.pop((ns, key), None)
        for ns in (NS_A, NS_B):
            assert h.tier.get_many(ns, [K1, K2, K3, K4]) == [model.get((ns, k)) for k in (K1, K2, K3, K4)]
            assert h.tier.usage(ns) == sum(h.footprint(n, k, e) for (n, k), e in model.items() if n == ns)
        assert h.tier.usage() == sum(h.footprint(n, k, e) for (n, k), e in model.items())
        for close in h.cleanup:
            close()


# -- stored tiers: a damaged payload is never served -------------------------------------------------------


def _flip(bit: int) -> Callable[[bytes], bytes]:
    def damage(blob: bytes) -> bytes:
        out = bytearray(blob)
        out[bit // 8 % len(out)] ^= 1 << (bit % 8)
        return bytes(out)

    return damage


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "flip a header bit": _flip(8 * 12 + 3),
    "flip a payload bit": _flip(8 * 60),
    "flip a checksum bit": _flip(-1),
    "drop the last byte": lambda blob: blob[:-1],
    "keep ten bytes": lambda blob: blob[:10],
    "empty": lambda blob: b"",
    "append a byte": lambda blob: blob + b"\0",
    "garbage": lambda blob: b"\x80not an entry at all" * 4,
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_a_damaged_payload_is_dropped_and_reported(stored: Harness, damage: str) -> None:
    e1, e2 = entry(b"v" * 64, ttl=60), entry(b"neighbour")
    stored.tier.set_many(NS_A, [(K1, e1), (K2, e2)])
    stored.raw_set(NS_A, K1, CORRUPTIONS[damage](stored.raw_get(NS_A, K1)))
    assert stored.tier.get_many(NS_A, [K1, K2]) == [None, e2]
    assert stored.faults == [(stored.name, "corrupt")]
    assert stored.raw_get(NS_A, K1) is None  # deleted, not left to fail again
    assert stored.tier.get_many(NS_A, [K1]) == [None]
    assert stored.faults == [(stored.name, "corrupt")]
    assert stored.tier.usage(NS_A) == stored.footprint(NS_A, K2, e2)


def test_another_keys_payload_is_not_served(stored: Harness) -> None:
    stored.tier.set_many(NS_A, [(K1, entry(b"for K1")), (K2, entry(b"for K2"))])
    stored.raw_set(NS_A, K1, stored.raw_get(NS_A, K2))
    assert stored.tier.get_many(NS_A, [K1, K2]) == [None, entry(b"for K2")]
    assert stored.faults == [(stored.name, "corrupt")]


def test_another_namespaces_payload_is_not_served(stored: Harness) -> None:
    stored.tier.set_many(NS_A, [(K1, entry(b"tenant a's"))])
    stored.tier.set_many(NS_B, [(K1, entry(b"tenant b's"))])
    stored.raw_set(NS_A, K1, stored.raw_get(NS_B, K1))
    assert stored.tier.get_many(NS_A, [K1]) == [None]
    assert stored.tier.get_many(NS_B, [K1]) == [entry(b"tenant b's")]
    assert stored.faults == [(stored.name, "corrupt")]


def test_every_corrupt_entry_of_a_batch_is_reported(stored: Harness) -> None:
    stored.tier.set_many(NS_A, [(K1, entry()), (K2, entry()), (K3, entry())])
    stored.raw_set(NS_A, K1, b"junk")
    stored.raw_set(NS_A, K3, b"more junk")
    assert stored.tier.get_many(NS_A, [K1, K2, K3]) == [None, entry(), None]
    assert stored.faults == [(stored.name, "corrupt")] * 2


# -- Redis specifics ---------------------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.redis
def test_redis_caps_the_ttl_it_hands_to_redis(redis_url: str, fake_clock) -> None:
    tier = RedisTier(redis_url, secret=SECRET, clock=fake_clock)
    tier.set_many(NS_A, [(K1, entry(ttl=1e15, now=fake_clock())), (K2, entry(ttl=60, now=fake_clock()))])
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.pttl(f"evc:{NS_A}:{K1}") > 2**53 - 10_000  # the longest TTL a script can pass exactly
        assert 0 < raw.pttl(f"evc:{NS_A}:{K2}") <= 60_000
    tier.close()


def test_redis_ttl_comes_from_expires_at(redis_url: str, fake_clock) -> None:
    tier = RedisTier(redis_url, secret=SECRET, clock=fake_clock)
    tier.set_many(NS_A, [(K1, entry(ttl=30)), (K2, entry())])
    with redis.Redis.from_url(redis_url) as raw:
        assert 29_000 < raw.pttl(f"evc:{NS_A}:{K1}") <= 30_000
        assert raw.pttl(f"evc:{NS_A}:{K2}") == -1  # no expiry
    tier.close()


@pytest.mark.redis
def test_redis_renewal_moves_the_redis_ttl(redis_url: str, fake_clock) -> None:
    tier = RedisTier(redis_url, secret=SECRET, clock=fake_clock)
    tier.set_many(NS_A, [(K1, entry(ttl=2, sliding_ttl=30.0))])
    assert tier.get_many(NS_A, [K1]) == [entry(ttl=30, sliding_ttl=30.0)]
    with redis.Redis.from_url(redis_url) as raw:
        assert 29_000 < raw.pttl(f"evc:{NS_A}:{K1}") <= 30_000
    tier.close()


@pytest.mark.redis
def test_redis_forgets_the_size_of_what_it_expired(redis_url: str) -> None:
    tier = RedisTier(redis_url, secret=SECRET)  # real clock: Redis itself must expire the entry
    short = Entry(b"short-lived", expires_at=time.time() + 0.05, created_at=time.time())
    tier.set_many(NS_A, [(K1, short), (K2, entry(b"stays"))])
    time.sleep(0.2)
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.exists(f"evc:{NS_A}:{K1}") == 0
    assert tier.get_many(NS_A, [K1, K2]) == [None, entry(b"stays")]
    assert tier.usage(NS_A) == encoded_size(entry(b"stays"))
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.hkeys(f"evc:{NS_A}:#sizes") == [K2.encode()]
    tier.close()


@pytest.mark.redis
def test_redis_prefixes_separate_stores(redis_url: str) -> None:
    one = RedisTier(redis_url, secret=SECRET, prefix="one")
    two = RedisTier(redis_url, secret=SECRET, prefix="two")
    one.set_many(NS_A, [(K1, entry(b"one"))])
    assert two.get_many(NS_A, [K1]) == [None]
    assert two.usage() == 0
    one.close()
    two.close()


# -- disk specifics ----------------------------------------------------------------------------------------


def test_disk_expiry_is_handed_to_diskcache(tmp_path, fake_clock) -> None:
    tier = DiskTier(tmp_path, clock=fake_clock)
    before = time.time()
    tier.set_many(NS_A, [(K1, entry(ttl=30)), (K2, entry())])
    _, expire_time = tier._cache.get(f"{NS_A}:{K1}", expire_time=True)
    assert before + 30 <= expire_time <= time.time() + 30
    assert tier._cache.get(f"{NS_A}:{K2}", expire_time=True)[1] is None
    tier.close()


def test_disk_entries_survive_a_reopen(tmp_path) -> None:
    tier = DiskTier(tmp_path)
    tier.set_many(NS_A, [(K1, entry(b"durable"))])
    tier.close()
    again = DiskTier(tmp_path)
    assert again.get_many(NS_A, [K1]) == [entry(b"durable")]
    again.close()


def test_disk_damaged_value_file_is_dropped(tmp_path) -> None:
    faults: list[tuple[str, str]] = []
    tier = DiskTier(tmp_path, on_fault=lambda t, k: faults.append((t, k)))
    big = entry(b"z" * 100_000)  # over diskcache's min_file_size: stored in a file of its own
    tier.set_many(NS_A, [(K1, big)])
    (path,) = tmp_path.rglob("*.val")
    data = bytearray(path.read_bytes())
    data[50_000] ^= 0x01
    path.write_bytes(bytes(data))
    assert tier.get_many(NS_A, [K1]) == [None]
    assert faults == [(L3, "corrupt")]
    assert list(tmp_path.rglob("*.val")) == []
    assert tier.usage() == 0
    tier.close()


def test_disk_stays_within_its_size_limit(tmp_path) -> None:
    tier = DiskTier(tmp_path, size_limit=1 << 20)
    keys = [CacheKey(f"{i:016x}") for i in range(40)]
    for key in keys:
        tier.set_many(NS_A, [(key, entry(b"z" * 100_000))])
    assert tier.usage() <= 1 << 20
    held = [e is not None for e in tier.get_many(NS_A, keys)]
    # Least recently stored goes first: what is left is a run of the newest writes.
    assert held == sorted(held) and held[-1] and not held[0]
    tier.close()


def test_disk_bad_settings(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown eviction_policy 'fifo'; known: least-frequently-used"):
        DiskTier(tmp_path, eviction_policy="fifo")
    with pytest.raises(ValueError, match="size_limit must be positive"):
        DiskTier(tmp_path, size_limit=0)


# -- get_one, the request path's read, answers exactly as get_many --------------------------------------------


def test_get_one_matches_get_many(h: Harness, fake_clock) -> None:
    fixed, sliding = entry(b"fixed", ttl=10), entry(b"sliding", ttl=10, sliding_ttl=10.0)
    h.tier.set_many(NS_A, [(K1, fixed), (K2, sliding)])
    assert h.tier.get_one(NS_A, K1) == fixed
    assert h.tier.get_one(NS_A, K3) is None
    assert h.tier.get_one(NS_B, K1) is None  # namespaces never cross
    fake_clock.advance(8)
    assert h.tier.get_one(NS_A, K2) == sliding.renewed(fake_clock())  # renewed, and written back
    fake_clock.advance(8)
    assert h.tier.get_one(NS_A, K1) is None  # expired at T0 + 10
    assert h.tier.get_many(NS_A, [K2]) == [sliding.renewed(fake_clock())]  # alive: renewed at +8 to +18
    with pytest.raises(ValueError):
        h.tier.get_one(NS_A, "not-a-key")


@pytest.mark.parametrize("damage", ["flip a payload bit", "drop the last byte"])
def test_get_one_never_serves_a_damaged_payload(stored: Harness, damage: str) -> None:
    stored.tier.set_many(NS_A, [(K1, entry(b"v" * 64, ttl=60))])
    stored.raw_set(NS_A, K1, CORRUPTIONS[damage](stored.raw_get(NS_A, K1)))
    assert stored.tier.get_one(NS_A, K1) is None
    assert stored.faults == [(stored.name, "corrupt")]
    assert stored.raw_get(NS_A, K1) is None
