"""TieredStore: read-through in order, promotion, write-through; tier failures absorbed at its boundary."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from evocache.controller._types import L1, L2, L3, CacheKey, Entry, Namespace, TierName
from evocache.controller.errors import CorruptEntry, TierUnavailable
from evocache.controller.tiers._base import Tier
from evocache.controller.tiers._disk import DiskTier
from evocache.controller.tiers._memory import MemoryTier
from evocache.controller.tiers._redis import RedisTier
from evocache.controller.tiers._tiered import MISS, Lookup, TieredStore

NS = Namespace("tenant-a")
K1, K2, K3, K4 = (CacheKey(f"{i:016x}") for i in (1, 2, 3, 4))
T0 = 1_700_000_000.0
SECRET = b"the test deployment's secret"  # signs the entries of the L2 and L3 tiers


def entry(value: bytes, ttl: float | None = None) -> Entry:
    return Entry(value, expires_at=None if ttl is None else T0 + ttl, created_at=T0)


E1, E2, E3 = entry(b"one"), entry(b"two"), entry(b"three")


class Recording(Tier):
    """A dict-backed tier that records its calls and fails on demand (``fail``: an exception to raise)."""

    def __init__(self, name: str, **held: Entry) -> None:
        super().__init__()
        self.name = TierName(name)
        self.held: dict[str, Entry] = {CacheKey(k): e for k, e in held.items()}
        self.calls: list[tuple] = []
        self.fail: BaseException | None = None
        self.closed = False

    def _call(self, *call) -> None:
        self.calls.append(call)
        if self.fail is not None:
            raise self.fail

    def get_many(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[Entry | None]:
        self._call("get", list(keys))
        return [self.held.get(k) for k in keys]

    def set_many(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]]) -> None:
        self._call("set", list(items))
        self.held.update(items)

    def delete(self, ns: Namespace, keys: Sequence[CacheKey]) -> int:
        self._call("delete", list(keys))
        return sum(self.held.pop(k, None) is not None for k in set(keys))

    def usage(self, ns: Namespace | None = None) -> int:
        return sum(e.size for e in self.held.values())

    def close(self) -> None:
        self.closed = True
        self._call("close")


def three(**extra) -> tuple[Recording, Recording, Recording, TieredStore]:
    l1, l2, l3 = Recording("l1", **{K1: E1}), Recording("l2", **{K2: E2}), Recording("l3", **{K3: E3, K2: E2})
    return l1, l2, l3, TieredStore([l1, l2, l3], clock=lambda: T0, **extra)


def test_each_tier_is_asked_only_for_what_the_ones_above_missed() -> None:
    l1, l2, l3, store = three()
    assert store.get_many(NS, [K1, K2, K3, K4]) == [Lookup(E1, L1), Lookup(E2, L2), Lookup(E3, L3), MISS]
    assert l1.calls[0] == ("get", [K1, K2, K3, K4])
    assert l2.calls[0] == ("get", [K2, K3, K4])
    assert l3.calls == [("get", [K3, K4])]


def test_hits_are_promoted_into_every_tier_above() -> None:
    l1, l2, l3, store = three()
    store.get_many(NS, [K1, K2, K3, K4])
    assert l1.calls[1:] == [("set", [(K2, E2), (K3, E3)])]
    assert l2.calls[1:] == [("set", [(K3, E3)])]
    assert store.get_many(NS, [K2, K3]) == [Lookup(E2, L1), Lookup(E3, L1)]
    assert l2.calls[2:] == l3.calls[1:] == []


def test_nothing_to_ask_once_every_key_is_found() -> None:
    l1, l2, l3, store = three()
    assert store.get(NS, K1) == Lookup(E1, L1)
    assert l1.calls == [("get", [K1])]
    assert l2.calls == l3.calls == []


def test_a_tier_list_restricts_reads_and_promotion() -> None:
    l1, l2, l3, store = three()
    assert store.get_many(NS, [K2, K3], tiers=["l3", "l1"]) == [Lookup(E2, L3), Lookup(E3, L3)]
    assert l1.calls == [("get", [K2, K3]), ("set", [(K2, E2), (K3, E3)])]  # the store's order, not the list's
    assert l2.calls == []
    assert l3.calls == [("get", [K2, K3])]


def test_tiers_the_store_does_not_hold_are_skipped() -> None:
    _, _, _, store = three()
    assert store.get(NS, K1, tiers=["l1", "l4"]) == Lookup(E1, L1)
    only_l1 = TieredStore([Recording("l1")])
    assert only_l1.get(NS, K1, tiers=["l2"]) == MISS
    only_l1.set(NS, K1, E1, tiers=["l2"])
    assert only_l1.tiers[L1].calls == []  # type: ignore[attr-defined]


def test_writes_go_to_every_selected_tier() -> None:
    l1, l2, l3, store = three()
    store.set_many(NS, [(K4, E1)], tiers=("l1", "l3"))
    store.set(NS, K4, E2)
    assert l1.calls == [("set", [(K4, E1)]), ("set", [(K4, E2)])]
    assert l2.calls == [("set", [(K4, E2)])]
    assert l3.calls == [("set", [(K4, E1)]), ("set", [(K4, E2)])]


def test_writes_return_the_tiers_that_stored() -> None:
    l1, l2, l3, store = three()
    assert store.set(NS, K4, E1) == (L1, L2, L3)
    assert store.set_many(NS, [(K4, E1)], tiers=("l3", "l1")) == (L1, L3)  # the store's order
    l2.fail = TierUnavailable("l2", "down")
    assert store.set(NS, K4, E2) == (L1, L3)  # a tier that failed the write is not one that stored
    assert store.set(NS, K4, entry(b"dead", ttl=-1)) == ()  # expired on arrival: stored nowhere


def test_expired_entries_are_not_written() -> None:
    l1, l2, l3, store = three()
    store.set_many(NS, [(K4, entry(b"dead", ttl=0)), (K3, entry(b"alive", ttl=1))])
    assert l1.calls == l2.calls == l3.calls == [("set", [(K3, entry(b"alive", ttl=1))])]
    store.set(NS, K4, entry(b"dead", ttl=-5))
    assert len(l1.calls) == 1


def test_a_read_never_returns_an_expired_entry() -> None:
    stale = entry(b"stale", ttl=-1)
    l1, l2 = Recording("l1", **{K1: stale}), Recording("l2", **{K1: E1})  # l1 ignores expiry: a buggy tier
    store = TieredStore([l1, l2], clock=lambda: T0)
    assert store.get(NS, K1) == Lookup(E1, L2)
    only = TieredStore([Recording("l1", **{K1: stale})], clock=lambda: T0)
    assert only.get(NS, K1) == MISS


def test_delete_reaches_every_tier_and_sums_the_copies() -> None:
    l1, l2, l3, store = three()
    assert store.delete(NS, [K2, K4]) == 2  # one copy in l2, one in l3
    assert l1.calls == l2.calls == l3.calls == [("delete", [K2, K4])]
    assert store.get(NS, K2) == MISS


@pytest.mark.parametrize("error", [TierUnavailable("l2", "down"), CorruptEntry("l2", "bad")])
def test_a_failing_tier_is_a_counted_miss(error) -> None:
    seen = []
    l1, l2, l3, store = three(on_error=lambda tier, op, exc: seen.append((tier, op, exc)))
    l2.fail = error
    assert store.get_many(NS, [K2, K3]) == [Lookup(E2, L3), Lookup(E3, L3)]
    assert l3.calls == [("get", [K2, K3])]
    # Promoted into l1; not into l2, which has just failed this read.
    assert l1.calls[-1] == ("set", [(K2, E2), (K3, E3)])
    assert l2.calls == [("get", [K2, K3])]
    assert store.error_counts == {(L2, "get"): 1}
    assert seen == [(L2, "get", error)]


def test_a_failing_write_is_skipped_and_counted() -> None:
    seen = []
    l1, l2, l3, store = three(on_error=lambda tier, op, exc: seen.append((tier, op)))
    l2.fail = TierUnavailable("l2", "down")
    store.set(NS, K4, E1)
    assert (l1.held[K4], l3.held[K4]) == (E1, E1)
    store.delete(NS, [K4])
    assert store.error_counts == {(L2, "set"): 1, (L2, "delete"): 1}
    assert seen == [(L2, "set"), (L2, "delete")]
    assert K4 not in l1.held and K4 not in l3.held


def test_any_other_exception_is_a_bug_and_propagates() -> None:
    _, l2, _, store = three()
    l2.fail = KeyError("a bug in a tier")
    with pytest.raises(KeyError, match="a bug in a tier"):
        store.get(NS, K2)
    with pytest.raises(KeyError, match="a bug in a tier"):
        store.set(NS, K2, E2)
    assert store.error_counts == {}


def test_a_tier_returning_the_wrong_number_of_entries_is_a_bug() -> None:
    class Short(Recording):
        def get_many(self, ns, keys):
            return []

    store = TieredStore([Short("l1")])
    with pytest.raises(ValueError, match="zip"):
        store.get_many(NS, [K1])


def test_failures_are_logged_once_per_interval_without_tracebacks(caplog) -> None:
    _, l2, l3, store = three()
    l2.fail = TierUnavailable("l2", "connection refused")
    l3.fail = TierUnavailable("l3", "disk full")
    with caplog.at_level(logging.WARNING, logger="evocache.controller.tiers"):
        for _ in range(5):
            store.get(NS, K4)
    assert [r.getMessage() for r in caplog.records] == [
        "tier l2 get failed, treated as a miss: l2: connection refused",
        "tier l3 get failed, treated as a miss: l3: disk full",
    ]
    assert all(r.exc_info is None for r in caplog.records)
    assert store.error_counts == {(L2, "get"): 5, (L3, "get"): 5}


def test_construction_rules() -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])
    with pytest.raises(ValueError, match="tier 'l1' given twice"):
        TieredStore([Recording("l1"), Recording("l1")])
    with pytest.raises(TypeError, match="is not a Tier"):
        TieredStore([object()])  # type: ignore[list-item]


def test_tiers_are_exposed_in_order_and_read_only() -> None:
    l1, l2, l3, store = three()
    assert list(store.tiers.items()) == [(L1, l1), (L2, l2), (L3, l3)]
    with pytest.raises(TypeError):
        store.tiers[L1] = l2  # type: ignore[index]


def test_close_closes_every_tier_even_when_one_fails() -> None:
    l1, l2, l3, store = three()
    l1.fail = TierUnavailable("l1", "already gone")
    with store:
        pass
    assert (l1.closed, l2.closed, l3.closed) == (True, True, True)


def test_lookup() -> None:
    assert Lookup(E1, L1).hit and not MISS.hit
    assert Lookup(None, None) == MISS


# -- with the real tiers ------------------------------------------------------------------------------------


@pytest.mark.redis
def test_real_tiers_read_through_and_promote(redis_url: str, tmp_path, fake_clock) -> None:
    l1 = MemoryTier(1 << 20, clock=fake_clock)
    l2 = RedisTier(redis_url, secret=SECRET, clock=fake_clock)
    l3 = DiskTier(tmp_path, clock=fake_clock)
    with TieredStore([l1, l2, l3], clock=fake_clock) as store:
        fresh = Entry(b"from disk", expires_at=fake_clock() + 60, created_at=fake_clock(), sliding_ttl=60.0)
        l3.set_many(NS, [(K1, fresh)])
        fake_clock.advance(30)
        renewed = Entry(
            b"from disk", expires_at=fake_clock() + 60, created_at=fake_clock() - 30, sliding_ttl=60.0
        )
        assert store.get(NS, K1) == Lookup(renewed, L3)
        assert l1.get_many(NS, [K1]) == l2.get_many(NS, [K1]) == [renewed]
        assert store.get(NS, K1) == Lookup(renewed, L1)
        assert store.delete(NS, [K1]) == 3
        assert store.get(NS, K1) == MISS
