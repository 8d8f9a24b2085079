"""L1 MemoryTier: bytes, TTL, sliding renewal, quotas, namespaces, threads."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Hashable

import pytest
from _helpers import FakeClock

from evocache.controller._types import CacheKey, Entry, Namespace
from evocache.controller.eviction import EntryInfo, LRUPolicy, make_eviction_policy
from evocache.controller.tiers import MemoryTier

A, B = Namespace("tenant-a"), Namespace("tenant-b")


class RecordingLRU(LRUPolicy):
    """LRU that remembers what it was told, to check the tier's notifications."""

    def __init__(self) -> None:
        super().__init__()
        self.inserted: list[tuple[Hashable, EntryInfo]] = []
        self.removed: list[Hashable] = []

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        self.inserted.append((key, info))
        super().on_insert(key, info)

    def on_remove(self, key: Hashable) -> None:
        self.removed.append(key)
        super().on_remove(key)


def entry(
    size: int, *, expires_at: float | None = None, sliding: float | None = None, saved_ms: float = 0.0
) -> Entry:
    return Entry(b"v" * size, expires_at, 0.0, saved_ms=saved_ms, sliding_ttl=sliding)


KEY_LEN = 16


def weighing(footprint: int, **fields: float) -> Entry:
    """An entry that weighs ``footprint`` bytes in the tier under a 16-digit key."""
    return entry(footprint - KEY_LEN, **fields)


def k(i: int) -> CacheKey:
    return CacheKey(f"{i:0{KEY_LEN}x}")


K1, K2, K3, K4, K5 = (k(i) for i in range(1, 6))


def stats(tier: MemoryTier) -> dict[str, int]:
    return dataclasses.asdict(tier.stats)


# -- basics ----------------------------------------------------------------------------------------------


def test_get_returns_one_item_per_key_in_order() -> None:
    tier = MemoryTier(1000)
    tier.set_many(A, [(K1, entry(3)), (K2, entry(4))])
    assert tier.get_many(A, [K2, K5, K1, K2]) == [entry(4), None, entry(3), entry(4)]
    assert stats(tier) == {"hits": 3, "misses": 1, "evictions": 0, "expirations": 0, "rejected": 0, "bypassed": 0}


def test_size_is_payload_plus_key() -> None:
    tier = MemoryTier(1000)
    tier.set_many(A, [(K1, entry(10)), (CacheKey("ab" * 20), entry(0))])
    assert tier.usage(A) == (10 + 16) + (0 + 40)
    assert tier.usage() == 66
    assert len(tier) == 2


def test_write_replaces_and_recounts() -> None:
    tier = MemoryTier(1000)
    tier.set_many(A, [(K1, entry(10))])
    tier.set_many(A, [(K1, entry(4))])
    assert tier.get_many(A, [K1]) == [entry(4)]
    assert tier.usage() == 20
    assert len(tier) == 1


def test_delete_counts_present_keys() -> None:
    tier = MemoryTier(1000)
    tier.set_many(A, [(K1, entry(1)), (K2, entry(1))])
    assert tier.delete(A, [K1, K1, K5]) == 1
    assert tier.delete(B, [K2]) == 0
    assert tier.get_many(A, [K1, K2]) == [None, entry(1)]
    assert tier.usage() == 17


def test_invalid_names_are_refused_before_anything_is_written() -> None:
    tier = MemoryTier(1000)
    with pytest.raises(ValueError, match="invalid cache key 'short'"):
        tier.set_many(A, [(K1, entry(1)), (CacheKey("short"), entry(1))])
    with pytest.raises(ValueError, match="invalid namespace 'a:b'"):
        tier.get_many(Namespace("a:b"), [K1])
    with pytest.raises(ValueError, match="invalid namespace"):
        tier.keys(Namespace(""))
    assert len(tier) == 0


def test_close_drops_everything_and_tells_the_policy() -> None:
    policy = RecordingLRU()
    tier = MemoryTier(1000, policy=policy)
    tier.set_many(A, [(K1, entry(1)), (K2, entry(1))])
    tier.close()
    assert len(tier) == 0 and tier.usage() == 0 and len(policy) == 0
    assert policy.removed == [(A, K1), (A, K2)]


def test_policy_learns_size_namespace_cost_and_weight() -> None:
    policy = RecordingLRU()
    tier = MemoryTier(1000, policy=policy, weight={A: 2.5}.get)  # type: ignore[arg-type]
    tier.set_many(A, [(K1, entry(10, saved_ms=42.0))])
    assert policy.inserted == [((A, K1), EntryInfo(size=26, ns=A, saved_ms=42.0, weight=2.5))]


def test_constructor_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        MemoryTier(-1)
    with pytest.raises(TypeError, match="capacity_bytes must be an int"):
        MemoryTier(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_entry_bytes must be an int"):
        MemoryTier(10, max_entry_bytes=True)
    used = LRUPolicy()
    used.on_insert("x", EntryInfo(size=1))
    with pytest.raises(ValueError, match="already tracks 1 keys"):
        MemoryTier(10, policy=used)


# -- capacity and eviction -------------------------------------------------------------------------------


def test_evicts_by_policy_until_the_entry_fits() -> None:
    tier = MemoryTier(300)  # LRU
    tier.set_many(A, [(K1, weighing(100)), (K2, weighing(100)), (K3, weighing(100))])
    tier.get_many(A, [K1])
    tier.set_many(A, [(K4, weighing(100))])
    assert tier.keys(A) == [K1, K3, K4]
    tier.set_many(A, [(K5, weighing(200))])  # K3 and then K1 go
    assert tier.keys(A) == [K4, K5]
    assert tier.usage() == 300
    assert stats(tier)["evictions"] == 3


def test_oversize_entry_is_not_stored_and_evicts_nothing() -> None:
    tier = MemoryTier(300, max_entry_bytes=200)
    tier.set_many(A, [(K1, weighing(100)), (K2, weighing(100))])
    tier.set_many(A, [(K3, weighing(301))])  # over the capacity
    tier.set_many(A, [(K4, weighing(201))])  # over max_entry_bytes
    assert tier.keys(A) == [K1, K2]
    assert stats(tier) == {"hits": 0, "misses": 0, "evictions": 0, "expirations": 0, "rejected": 2, "bypassed": 0}
    tier.set_many(A, [(K5, weighing(200))])  # exactly max_entry_bytes: evicts K1
    assert tier.keys(A) == [K2, K5]


def test_a_rejected_write_still_removes_the_value_it_supersedes() -> None:
    tier = MemoryTier(300)
    tier.set_many(A, [(K1, weighing(50))])
    tier.set_many(A, [(K1, weighing(400))])
    assert tier.get_many(A, [K1]) == [None]
    assert tier.usage() == 0


def test_zero_capacity_stores_nothing() -> None:
    tier = MemoryTier(0)
    tier.set_many(A, [(K1, entry(0))])
    assert len(tier) == 0 and stats(tier)["rejected"] == 1


# -- TTL -------------------------------------------------------------------------------------------------


def test_expired_entry_is_absent_and_dropped_on_read() -> None:
    clock = FakeClock(0.0)
    tier = MemoryTier(1000, clock=clock)
    tier.set_many(A, [(K1, entry(5, expires_at=10.0)), (K2, entry(5))])
    clock.now = 9.99
    assert tier.get_many(A, [K1]) == [entry(5, expires_at=10.0)]
    clock.now = 10.0  # expires_at is the first instant the entry is dead
    assert tier.get_many(A, [K1, K2]) == [None, entry(5)]
    assert tier.usage() == 21 and len(tier) == 1
    assert stats(tier) == {"hits": 2, "misses": 1, "evictions": 0, "expirations": 1, "rejected": 0, "bypassed": 0}


def test_entry_already_expired_is_not_stored() -> None:
    clock = FakeClock(50.0)
    tier = MemoryTier(1000, clock=clock)
    tier.set_many(A, [(K1, entry(5, expires_at=50.0))])
    assert len(tier) == 0


def test_expired_entries_make_room_before_any_eviction() -> None:
    clock = FakeClock(0.0)
    tier = MemoryTier(300, clock=clock)
    tier.set_many(A, [(K1, weighing(100)), (K2, weighing(100, expires_at=5.0)), (K3, weighing(100))])
    clock.now = 6.0
    tier.set_many(A, [(K4, weighing(100))])
    assert tier.keys(A) == [K1, K3, K4]  # LRU would have evicted K1; the expired K2 went instead
    assert stats(tier)["evictions"] == 0 and stats(tier)["expirations"] == 1


def test_delete_of_an_expired_entry_counts_it_absent() -> None:
    clock = FakeClock(0.0)
    tier = MemoryTier(1000, clock=clock)
    tier.set_many(A, [(K1, entry(1, expires_at=1.0))])
    clock.now = 2.0
    assert tier.delete(A, [K1]) == 0
    assert len(tier) == 0 and stats(tier)["expirations"] == 1


def test_sliding_entry_is_renewed_on_each_hit() -> None:
    clock = FakeClock(0.0)
    tier = MemoryTier(1000, clock=clock)
    tier.set_many(A, [(K1, entry(5, expires_at=5.0, sliding=5.0)), (K2, entry(5, expires_at=5.0))])
    clock.now = 4.0
    got = tier.get_many(A, [K1, K2])
    assert [e.expires_at if e else None for e in got] == [9.0, 5.0]
    clock.now = 8.0
    assert tier.get_many(A, [K1, K2]) == [entry(5, expires_at=13.0, sliding=5.0), None]
    clock.now = 13.0
    assert tier.get_many(A, [K1]) == [None]
    assert len(tier) == 0


def test_renewed_entries_do_not_leave_stale_expiry_behind() -> None:
    clock = FakeClock(0.0)
    tier = MemoryTier(1000, clock=clock)
    tier.set_many(A, [(K1, entry(5, expires_at=5.0, sliding=5.0))])
    for step in range(1, 2000):
        clock.now = step * 0.5
        assert tier.get_many(A, [K1])[0] is not None
    assert len(tier._expiry) <= 2 * len(tier) + 65
    clock.now += 100
    tier.set_many(A, [(K2, weighing(1000))])  # needs all the room: the expired K1 must go first
    assert tier.keys(A) == [K2]
    assert stats(tier)["expirations"] == 1 and stats(tier)["evictions"] == 0


# -- namespaces and quotas ---------------------------------------------------------------------------------


def test_same_key_in_two_namespaces_is_two_entries() -> None:
    tier = MemoryTier(1000)
    tier.set_many(A, [(K1, Entry(b"from-a", None, 0.0))])
    tier.set_many(B, [(K1, Entry(b"from-b!", None, 0.0))])
    assert [e.value if e else None for e in tier.get_many(A, [K1])] == [b"from-a"]
    assert [e.value if e else None for e in tier.get_many(B, [K1])] == [b"from-b!"]
    assert (tier.usage(A), tier.usage(B), len(tier)) == (22, 23, 2)
    assert tier.delete(A, [K1]) == 1
    assert tier.get_many(A, [K1]) == [None]
    assert [e.value if e else None for e in tier.get_many(B, [K1])] == [b"from-b!"]
    assert tier.get_many(Namespace("tenant-c"), [K1]) == [None]


def test_tenant_filling_its_quota_evicts_only_its_own_entries() -> None:
    quotas = {A: 300}
    tier = MemoryTier(1000, quota=quotas.get)  # type: ignore[arg-type]
    b1, b2 = k(0xB1), k(0xB2)
    tier.set_many(B, [(b1, weighing(100)), (b2, weighing(100))])  # B: no quota; its entries are the oldest
    tier.set_many(A, [(K1, weighing(100)), (K2, weighing(100)), (K3, weighing(100))])
    tier.set_many(A, [(K4, weighing(100))])
    assert tier.keys(A) == [K2, K3, K4]
    assert tier.keys(B) == [b1, b2]
    assert tier.usage(A) == 300 and tier.usage(B) == 200
    tier.set_many(A, [(K5, weighing(200))])  # two of A's go, B still untouched
    assert tier.keys(A) == [K4, K5]
    assert tier.keys(B) == [b1, b2]


def test_quota_evictions_come_before_global_ones() -> None:
    quotas = {A: 200}
    tier = MemoryTier(400, quota=quotas.get)  # type: ignore[arg-type]
    b1, b2, b3 = k(0xB1), k(0xB2), k(0xB3)
    tier.set_many(B, [(b1, weighing(100))])
    tier.set_many(A, [(K1, weighing(100)), (K2, weighing(100))])
    tier.set_many(B, [(b2, weighing(100))])  # full
    tier.set_many(A, [(K3, weighing(100))])  # A over quota: K1 goes, which also makes the room overall
    assert tier.keys(A) == [K2, K3] and tier.keys(B) == [b1, b2]
    tier.set_many(B, [(b3, weighing(100))])  # B has no quota: the global LRU victim is b1
    assert tier.keys(A) == [K2, K3] and tier.keys(B) == [b2, b3]


def test_entry_larger_than_its_quota_is_not_stored() -> None:
    quotas = {A: 150}
    tier = MemoryTier(1000, quota=quotas.get)  # type: ignore[arg-type]
    tier.set_many(A, [(K1, weighing(50))])
    tier.set_many(A, [(K2, weighing(151))])
    assert tier.keys(A) == [K1]
    assert stats(tier)["rejected"] == 1 and stats(tier)["evictions"] == 0


def test_a_lowered_quota_applies_at_the_next_write() -> None:
    quotas = {A: 500}
    tier = MemoryTier(1000, quota=quotas.get)  # type: ignore[arg-type]
    tier.set_many(A, [(key, weighing(100)) for key in (K1, K2, K3, K4)])
    quotas[A] = 200
    tier.set_many(A, [(K5, weighing(100))])
    assert tier.keys(A) == [K4, K5]
    assert tier.usage(A) == 200


# -- threads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lru", "s3fifo", "lfu"])
def test_threads_hammering_keep_the_invariants(name: str) -> None:
    quotas = {Namespace("q"): 300}
    policy = make_eviction_policy(name)
    tier = MemoryTier(1000, policy=policy, quota=quotas.get, clock=FakeClock(0.0))  # type: ignore[arg-type]
    namespaces = [Namespace("q"), Namespace("x"), Namespace("y")]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        try:
            for _ in range(3000):
                ns = rng.choice(namespaces)
                key = k(rng.randrange(40))
                roll = rng.random()
                if roll < 0.5:
                    tier.set_many(
                        ns, [(key, Entry(f"{ns}/{key}".encode().ljust(rng.randrange(60), b"."), None, 0))]
                    )
                elif roll < 0.9:
                    for got in tier.get_many(ns, [key]):
                        assert got is None or got.value.startswith(f"{ns}/{key}".encode())
                else:
                    tier.delete(ns, [key])
                assert tier.usage() <= 1000
                assert tier.usage(Namespace("q")) <= 300
        except BaseException as exc:  # collected here, asserted empty in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    held = [(ns, key) for ns in namespaces for key in tier.keys(ns)]
    assert len(policy) == len(tier) == len(held)
    assert all(slot in policy for slot in held)  # type: ignore[operator]
    assert sum(tier.usage(ns) for ns in namespaces) == tier.usage()
    assert stats(tier)["evictions"] > 0


class PickyLRU(RecordingLRU):
    """Admits only entries of rule "keep": an admission-deciding policy, like the learned one."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[Hashable, EntryInfo]] = []

    def admit(self, key: Hashable, info: EntryInfo) -> bool:
        self.asked.append((key, info))
        return info.rule == "keep"


def test_a_policy_that_refuses_admission_keeps_the_entry_out_and_is_counted() -> None:
    policy = PickyLRU()
    tier = MemoryTier(10_000, policy=policy)
    keep, skip = Entry(b"v" * 10, None, 0.0, rule="keep"), Entry(b"v" * 10, None, 0.0, rule="skip")
    tier.set_many(A, [(k(1), keep), (k(2), skip)])
    assert tier.get_many(A, [k(1), k(2)]) == [keep, None]
    assert [key for key, _ in policy.asked] == [(A, k(1)), (A, k(2))]
    assert [info.rule for _, info in policy.asked] == ["keep", "skip"]
    assert [key for key, _ in policy.inserted] == [(A, k(1))]  # a refused key is never inserted
    assert tier.stats.bypassed == 1 and tier.stats.rejected == 0
    assert len(policy) == 1



def test_the_tier_closes_a_policy_it_stops_using() -> None:
    """A replaced policy, and the tier's policy when the tier closes, are closed (a learned policy's trainer
    thread ends)."""
    closed: list[str] = []

    class Closing(LRUPolicy):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.label = name

        def close(self) -> None:
            closed.append(self.label)

    tier = MemoryTier(1000, policy=Closing("first"))
    tier.replace_policy(Closing("second"))
    assert closed == ["first"]
    tier.close()
    assert closed == ["first", "second"]


def test_a_learned_policy_on_the_request_path_trains_in_the_background() -> None:
    policy = make_eviction_policy("learned", capacity=1000, background=True)
    try:
        assert policy._thread is not None and policy._thread.is_alive()
    finally:
        policy.close()
    assert not policy._thread.is_alive()
    assert not hasattr(make_eviction_policy("lru", capacity=1000, background=True), "_thread")
