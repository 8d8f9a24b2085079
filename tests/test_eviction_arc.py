"""ARC: hand-worked sequences (the adaptation of p, ghost hits entering T2, the B2 tie-break), the ghost
bounds, byte sizes, and hits equal to libCacheSim's ARC. (The shared contract suite, tests/test_eviction.py,
runs it too.)"""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

from evocache.controller.eviction import ARCPolicy, EntryInfo, make_eviction_policy
from evocache.controller.replay import Access, replay


def serve(
    policy: ARCPolicy, trace: str, capacity: int, *, announce: bool = True,
    sizes: dict[str, int] | None = None,
) -> tuple[list[Hashable], list[float]]:
    """The replay owner by hand: each access is announced (``on_access``, unless ``announce`` is False, as the
    L1 tier does), then hit, or inserted after evicting until it fits. Returns the victims in order and ``p``
    after each access."""
    sizes = sizes or {}
    held: dict[str, int] = {}
    victims: list[Hashable] = []
    ps: list[float] = []
    for key in trace.split():
        info = EntryInfo(size=sizes.get(key, 1))
        if announce:
            policy.on_access(key, info)
        if key in held:
            policy.on_hit(key)
        else:
            while sum(held.values()) + info.size > capacity:
                victim = policy.victim()
                assert policy.victim() == victim
                victims.append(victim)
                policy.on_remove(victim)
                del held[victim]
            policy.on_insert(key, info)
            held[key] = info.size
        ps.append(policy.p)
    assert len(policy) == len(held)
    return victims, ps


def lists(policy: ARCPolicy) -> tuple[list[Hashable], ...]:
    """T1, T2, B1, B2, oldest first."""
    return (list(policy._t1._all), list(policy._t2._all), list(policy._b1.keys), list(policy._b2.keys))


TRACE = "a a b b c d e c d a f e g b"


def test_ghost_hits_adapt_p_and_enter_t2() -> None:
    # Capacity 3. a and b are hit: T2 = [a, b]; c enters T1.
    # d: T1 (1) > p (0): c -> B1.  e: d -> B1 (B1 = [c, d]).
    # c: B1 hit, |B1| 2 >= |B2| 0: p += 1 -> 1; T1 (1) is not > 1 and c is not in B2: T2's a -> B2; c -> T2.
    # d: B1 hit, |B1| 1 >= |B2| 1: p -> 2; T2's b -> B2; d -> T2 (T2 = [c, d], B2 = [a, b], T1 = [e]).
    # a: B2 hit, |B2| 2 >= |B1| 0: p -> 1; T1 (1) == p and a is in B2: T1's e -> B1; a -> T2.
    # f: T1 empty: T2's c -> B2 (B2 = [b, c]); f -> T1.
    # e: B1 hit, |B1| 1 < |B2| 2: p += 2/1 -> 3 (the capacity); T2's d -> B2; e -> T2 (B2 = [b, c, d]).
    # g: T2's a -> B2; 7 keys in all lists > 2 x 3: B2's oldest, b, is forgotten.
    # b: no ghost any more, p stays; T2's e -> B2, and c is forgotten.
    policy = ARCPolicy()
    victims, ps = serve(policy, TRACE, capacity=3)
    assert victims == ["c", "d", "a", "b", "e", "c", "d", "a", "e"]
    assert ps == [0, 0, 0, 0, 0, 0, 0, 1, 2, 1, 1, 3, 3, 3]
    assert lists(policy) == (["f", "g", "b"], [], [], ["d", "a", "e"])


def test_b2_hit_lowers_p_by_the_ghost_ratio() -> None:
    # Capacity 5. h is hit (T2); e f a b g fill T1 (b is hit later). g: T1 (4) > p (0): e -> B1.
    # e: B1 hit, |B1| 1 >= |B2| 0: p -> 1; T1's f -> B1; e -> T2.  b: hit, T1 -> T2.
    # d, c: T1 (2) > p (1): a, then g -> B1 (B1 = [f, a, g]).
    # f: B1 hit: p -> 2; T1 (2) is not > 2 and f is not in B2: T2's h -> B2; f -> T2.
    # h: B2 hit with |B2| 1 < |B1| 2: p -= 2/1 -> 0 (a step of 1 would leave 1); T1's d -> B1.
    policy = ARCPolicy(capacity=5)
    victims, ps = serve(policy, "h e f h a b g e b d c f h", capacity=5)
    assert victims == ["e", "f", "a", "g", "h", "d"]
    assert ps == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 0]
    assert lists(policy) == (["c"], ["e", "b", "f", "h"], ["a", "g", "d"], [])


def test_without_announcement_p_moves_at_insertion() -> None:
    # The L1 tier announces nothing: at c's return (the 8th access) the victim is chosen with p still 0, so
    # T1's e goes where the announced run evicted T2's a; p reaches 1 when c is inserted.
    policy = ARCPolicy()
    victims, ps = serve(policy, TRACE, capacity=3, announce=False)
    assert victims[:3] == ["c", "d", "e"]
    assert ps[:8] == [0, 0, 0, 0, 0, 0, 0, 1]


def test_a_deletion_leaves_no_ghost() -> None:
    policy = ARCPolicy()
    for key in "abc":
        policy.on_insert(key, EntryInfo(size=1))
    assert policy.victim() == "a"
    policy.on_hit("b")  # a notification between victim() and on_remove(): the removal is a deletion
    policy.on_remove("a")
    policy.on_insert("a", EntryInfo(size=1))
    assert lists(policy) == (["c", "a"], ["b"], [], [])
    assert policy.victim() == "c"
    policy.on_remove("c")  # the named victim: it enters B1
    assert lists(policy)[2] == ["c"]


def test_victim_in_a_namespace_follows_the_global_choice() -> None:
    policy = ARCPolicy()
    for key, ns in [("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B")]:
        policy.on_insert(key, EntryInfo(size=1, ns=ns))
    policy.on_hit("a1")
    policy.on_hit("b1")
    # p = 0 < |T1|: T1 is evicted from; A's oldest in T1 is a2, B's b2.
    assert policy.victim("A") == "a2"
    assert policy.victim("B") == "b2"
    policy.on_remove("a2")
    assert policy.victim("A") == "a1"  # A has nothing left in T1: its oldest in T2


def test_ghost_bounds_hold_in_keys_and_in_bytes() -> None:
    rng = random.Random(4)
    for capacity, sizes in ((None, False), (40, True)):
        policy = ARCPolicy(capacity=capacity)
        held: dict[str, int] = {}
        limit = 12 if capacity is None else capacity
        for _ in range(3000):
            key = f"k{min(rng.randrange(60), rng.randrange(60))}"
            info = EntryInfo(size=rng.randint(1, 9) if sizes else 1)
            policy.on_access(key, info)
            if key in held:
                policy.on_hit(key)
            else:
                measure = info.size if sizes else 1
                while sum(v if sizes else 1 for v in held.values()) + measure > limit:
                    victim = policy.victim()
                    policy.on_remove(victim)
                    del held[victim]
                policy.on_insert(key, info)
                held[key] = info.size
            c = policy.c
            t1, t2 = policy._t1.measure(), policy._t2.measure()
            b1, b2 = policy._b1.measure, policy._b2.measure
            assert t1 + b1 <= c and t1 + t2 + b1 + b2 <= 2 * c
            assert 0 <= policy.p <= c
        assert policy.c == limit
        assert policy._b1.keys and policy._b2.keys  # both ghost lists were used


def test_byte_sizes_move_p_by_the_ghost_size() -> None:
    # Capacity 10 bytes. a (4) is hit: T2. b (3) and c (3) enter T1. d (3): T1 (6) > p (0): b -> B1.
    # b returns: p += 3 (its size) -> 3; T1 (6) > 3: c -> B1; b -> T2.
    # e (3): T1 holds d, 3 bytes, not more than p: T2's a goes (with a step of 1 byte, T1's d would).
    sizes = {"a": 4, "b": 3, "c": 3, "d": 3, "e": 3}
    policy = ARCPolicy(capacity=10)
    victims, ps = serve(policy, "a a b c d b e", capacity=10, sizes=sizes)
    assert victims == ["b", "c", "a"]
    assert ps == [0, 0, 0, 0, 0, 3, 3]
    assert lists(policy) == (["d", "e"], ["b"], ["c"], ["a"])


def test_options_are_checked() -> None:
    with pytest.raises(TypeError, match="capacity must be an int"):
        ARCPolicy(capacity=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity must be > 0"):
        ARCPolicy(capacity=0)
    assert make_eviction_policy("arc", capacity=64).capacity == 64


# -- against libCacheSim's ARC ----------------------------------------------------------------------------


def skewed_trace(n: int, seed: int) -> list[Access]:
    """A hot set, a long-tailed middle and a scan-like cold tail: every part of ARC's adaptation is used."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.3:
            k = rng.randrange(20)
        elif roll < 0.6:
            k = 20 + int(rng.paretovariate(1.0)) % 300
        else:
            k = rng.randrange(2000)
        out.append(Access(float(i), f"k{k}", 1, ""))
    return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("capacity", [1, 3, 10, 50, 200])
def test_arc_hits_exactly_what_libcachesim_arc_hits(seed: int, capacity: int) -> None:
    lcs = pytest.importorskip("libcachesim")
    from evocache.controller.replay._peers import encode, replay_peer

    trace = skewed_trace(4000, seed)
    ours = replay(trace, "arc", capacity_objects=capacity)
    theirs = replay_peer(lcs, "ARC", encode(trace, "objects"), capacity)
    assert 0 < ours.hits < ours.requests
    assert theirs.hits == ours.hits
