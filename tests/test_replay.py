"""The replay simulator: exact hits per policy on hand-made traces, LRU against a brute-force LRU, capacity
modes, windows, namespaces, prefix hits and determinism."""

from __future__ import annotations

import functools
import random
from collections import OrderedDict

import pytest
from evocache.controller.errors import StoreConfigError
from evocache.controller.eviction import EVICTION_POLICIES, LRUKPolicy, LRUPolicy
from evocache.controller.replay._access import Access
from evocache.controller.replay._sim import ReplayResult, WorkingSet, replay, working_set


def unit_trace(text: str) -> list[Access]:
    return [Access(float(i), key, 1) for i, key in enumerate(text.split())]


def sized_trace(text: str, sizes: dict[str, int]) -> list[Access]:
    return [Access(float(i), key, sizes[key]) for i, key in enumerate(text.split())]


# Hand-worked expectations, object capacity (every object 1). "a b c a d a b" does not tell the policies
# apart; "a a a b c b c a" does: recency keeps b and c, frequency (with aging) keeps a.
@pytest.mark.parametrize(
    ("policy", "trace", "capacity", "hits"),
    [
        # [a] [a b] [b c] [c a] [a d] hit a [a b]
        ("lru", "a b c a d a b", 2, 1),
        # [a b c] hit a, d evicts b, hit a, b evicts c
        ("lru", "a b c a d a b", 3, 2),
        ("lfu", "a b c a d a b", 2, 1),
        ("lfu", "a b c a d a b", 3, 2),
        # hits a a; then b c evicts b, c b evicts c, b c evicts b, a misses (evicted since c came at L=1)
        ("lru", "a a a b c b c a", 2, 4),
        # a at priority 3; b (1) evicted for c (L=1, prio 2); c for b (L=2, prio 3); the tie a/b goes to a,
        # the older; b for a: only the first two a's hit
        ("lfu", "a a a b c b c a", 2, 2),
        # a has 2 accesses, so b, c (one access, infinite K-distance) go first and a's last access hits
        ("lruk", "a a a b c b c a", 2, 3),
        # a reaches counter 2 in S and moves to M on the first eviction; b, c then churn through S
        ("s3fifo", "a a a b c b c a", 2, 3),
        # sizes 1, no saved cost: GDSF reduces to LFU-DA
        ("weighted", "a a a b c b c a", 2, 2),
    ],
)
def test_exact_hits_in_objects(policy: str, trace: str, capacity: int, hits: int) -> None:
    result = replay(unit_trace(trace), policy, capacity_objects=capacity)
    assert (result.requests, result.hits) == (len(trace.split()), hits)
    assert result.capacity == capacity and result.capacity_unit == "objects"


@pytest.mark.parametrize(("policy", "hits"), [("lru", 0), ("lfu", 0), ("weighted", 1)])
def test_exact_hits_in_bytes(policy: str, hits: int) -> None:
    # Capacity 4, x weighs 3. z needs room: LRU and LFU (tie, older) evict y; GDSF evicts x, whose score per
    # byte is a third of y's, so y hits.
    trace = sized_trace("y x z y", {"x": 3, "y": 1, "z": 1})
    result = replay(trace, policy, capacity_bytes=4)
    assert result.hits == hits
    assert result.bytes_requested == 6 and result.bytes_hit == hits


def test_object_larger_than_capacity_is_never_admitted() -> None:
    trace = sized_trace("a big a big a", {"a": 2, "big": 5})
    result = replay(trace, "lru", capacity_bytes=4)
    # big never gets in, so it never evicts a
    assert (result.hits, result.bytes_hit) == (2, 4)


def test_capacity_objects_ignores_sizes() -> None:
    trace = sized_trace("a b a b", {"a": 1000, "b": 1000})
    assert replay(trace, "lru", capacity_objects=2).hits == 2
    assert replay(trace, "lru", capacity_bytes=1000).hits == 0


def brute_lru(trace: list[Access], capacity: int) -> tuple[int, int]:
    held: OrderedDict[tuple[str, str], int] = OrderedDict()
    hits = bytes_hit = 0
    for access in trace:
        k = (access.ns, access.key)
        if k in held:
            held.move_to_end(k)
            hits += 1
            bytes_hit += access.size
        elif access.size <= capacity:
            while sum(held.values()) + access.size > capacity:
                held.popitem(last=False)
            held[k] = access.size
    return hits, bytes_hit


@pytest.mark.parametrize("seed", range(40))
def test_lru_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(rng.randint(1, 12))]
    sizes = {key: rng.randint(1, 6) for key in keys}
    trace = [
        Access(float(i), key, sizes[key], rng.choice(["", "", "t"]))
        for i, key in enumerate(rng.choices(keys, k=rng.randint(0, 80)))
    ]
    capacity = rng.randint(1, 20)
    result = replay(trace, "lru", capacity_bytes=capacity)
    assert (result.hits, result.bytes_hit) == brute_lru(trace, capacity)
    assert result.requests == len(trace)


def random_trace(seed: int, n: int = 300) -> list[Access]:
    rng = random.Random(seed)
    return [
        Access(i * 0.1, f"k{int(rng.paretovariate(1.2)) % 40}", rng.randint(1, 50), rng.choice("xy"))
        for i in range(n)
    ]


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_deterministic(name: str) -> None:
    trace = random_trace(7)
    first = replay(trace, name, capacity_bytes=300, window_s=5.0)
    second = replay(trace, name, capacity_bytes=300, window_s=5.0)
    assert first == second
    assert first.policy == name
    assert 0 < first.hits < first.requests


def test_factory_gets_virtual_clock_and_seeded_rng() -> None:
    seen: list[float] = []

    class Spy(LRUPolicy):
        def on_hit(self, key: object) -> None:
            seen.append(self.clock())
            super().on_hit(key)

    draws = []

    def factory(**kw: object) -> Spy:
        policy = Spy(**kw)  # type: ignore[arg-type]
        draws.append(policy.rng.random())
        return policy

    trace = [Access(100.0, "a", 1), Access(250.5, "a", 1), Access(251.0, "b", 1), Access(300.0, "a", 1)]
    result = replay(trace, factory, capacity_objects=2, seed=3)
    assert seen == [250.5, 300.0]
    assert draws == [random.Random(3).random()]
    assert result.policy == "lru"


def test_factory_with_options() -> None:
    result = replay(unit_trace("a a a b c b c a"), functools.partial(LRUKPolicy, k=1), capacity_objects=2)
    assert result.hits == 4  # k=1 is plain LRU


def test_fraction_of_working_set() -> None:
    trace = sized_trace("a b c d a b", {"a": 10, "b": 20, "c": 30, "d": 40})
    assert working_set(trace) == WorkingSet(objects=4, bytes=100)
    assert working_set(iter(trace)) == WorkingSet(objects=4, bytes=100)
    result = replay(trace, "lru", fraction=0.5)
    assert (result.capacity, result.capacity_unit) == (50, "bytes")
    result = replay(trace, "lru", fraction=0.5, fraction_of="objects")
    assert (result.capacity, result.capacity_unit) == (2, "objects")
    assert replay(trace, "lru", fraction=0.01, fraction_of="objects").capacity == 1  # at least 1


def test_fraction_rejects_a_one_shot_trace() -> None:
    with pytest.raises(TypeError, match="re-iterable"):
        replay(iter(unit_trace("a b")), "lru", fraction=0.5)


def test_working_set_separates_namespaces() -> None:
    trace = [
        Access(0.0, "k", 3, "a"),
        Access(1.0, "k", 3, "b"),
        Access(2.0, "k", 3, "a"),
        Access(3.0, "k", 9),
    ]
    assert working_set(trace) == WorkingSet(objects=3, bytes=15)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one"),
        ({"capacity_bytes": 10, "capacity_objects": 2}, ValueError, "exactly one"),
        ({"capacity_bytes": 0}, ValueError, "capacity_bytes must be > 0"),
        ({"capacity_objects": 2.5}, TypeError, "capacity_objects must be an int"),
        ({"capacity_bytes": True}, TypeError, "capacity_bytes must be an int"),
        ({"fraction": 0.0}, ValueError, "fraction must be in"),
        ({"fraction": 1.5}, ValueError, "fraction must be in"),
        ({"fraction": 0.5, "fraction_of": "pages"}, ValueError, "fraction_of"),
        ({"capacity_bytes": 10, "window_s": 0}, ValueError, "window_s"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        replay(unit_trace("a b"), "lru", **kwargs)  # type: ignore[arg-type]


def test_unknown_policy_lists_known() -> None:
    with pytest.raises(StoreConfigError, match="known: .*lru"):
        replay(unit_trace("a"), "nope", capacity_objects=1)


def test_per_namespace_counts() -> None:
    trace = [
        Access(0.0, "k", 1, "a"),
        Access(1.0, "k", 1, "b"),
        Access(2.0, "k", 1, "a"),
        Access(3.0, "k", 1, "b"),
        Access(4.0, "k", 1),
        Access(5.0, "k", 1, "a"),
    ]
    result = replay(trace, "lru", capacity_objects=3)
    # the same key in three namespaces is three objects
    assert result.per_ns == {"a": (3, 2), "b": (2, 1), "": (1, 0)}
    assert result.hits == 3


def test_windows() -> None:
    times = [10.0, 10.5, 11.0, 11.9, 13.5, 13.7]
    trace = [Access(t, key, 1) for t, key in zip(times, ["a", "a", "b", "a", "b", "b"], strict=True)]
    result = replay(trace, "lru", capacity_objects=2, window_s=1.0)
    # windows start at the first access; [12, 13) saw nothing and is left out
    assert result.windows == ((10.0, 2, 1), (11.0, 2, 1), (13.0, 2, 2))
    assert replay(trace, "lru", capacity_objects=2).windows == ()


def test_prefix_hit_ratio_on_block_trace() -> None:
    chains = [["h1", "h2", "h3"], ["h1", "h2", "h4"], ["h1", "h5", "h2"]]
    trace = [
        Access(float(req), block, 16, req=req, pos=pos)
        for req, chain in enumerate(chains)
        for pos, block in enumerate(chain)
    ]
    result = replay(trace, "lru", capacity_objects=10)
    # request 1 hits h1 h2 as a prefix; request 2 hits h1 as a prefix, and h2 only after a miss
    assert (result.hits, result.prefix_requests, result.prefix_hits) == (4, 9, 3)
    assert result.prefix_hit_ratio == pytest.approx(3 / 9)


def test_no_request_numbers_means_no_prefix() -> None:
    result = replay(unit_trace("a a"), "lru", capacity_objects=1)
    assert (result.prefix_requests, result.prefix_hits, result.prefix_hit_ratio) == (0, 0, 0.0)


def test_empty_trace() -> None:
    assert replay([], "lru", capacity_objects=1) == ReplayResult(
        policy="lru",
        capacity=1,
        capacity_unit="objects",
        requests=0,
        hits=0,
        bytes_requested=0,
        bytes_hit=0,
        hit_ratio=0.0,
        byte_hit_ratio=0.0,
        per_ns={},
        windows=(),
        prefix_requests=0,
        prefix_hits=0,
        prefix_hit_ratio=0.0,
    )
