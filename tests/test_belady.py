"""Belady's MIN: equal to an exhaustive optimum on tiny traces, never beaten by an online policy, and the
size heuristic on hand-made traces."""

from __future__ import annotations

import functools
import random
from collections.abc import Hashable

import pytest
from evocache.controller.eviction import EVICTION_POLICIES
from evocache.controller.replay._access import Access
from evocache.controller.replay._belady import belady_size, belady_unit
from evocache.controller.replay._sim import replay


def unit_trace(keys: list[str] | str) -> list[Access]:
    return [Access(float(i), key, 1) for i, key in enumerate(keys.split() if isinstance(keys, str) else keys)]


def sized_trace(text: str, sizes: dict[str, int]) -> list[Access]:
    return [Access(float(i), key, sizes[key]) for i, key in enumerate(text.split())]


def optimum(keys: list[str], capacity: int) -> int:
    """Most hits over every choice at every miss: bypass, or admit (evicting any one held object when full)."""

    @functools.cache
    def best(i: int, held: frozenset[Hashable]) -> int:
        if i == len(keys):
            return 0
        key = keys[i]
        if key in held:
            return 1 + best(i + 1, held)
        choices = [best(i + 1, held)]
        if len(held) < capacity:
            choices.append(best(i + 1, held | {key}))
        else:
            choices.extend(best(i + 1, (held - {out}) | {key}) for out in held)
        return max(choices)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(150))
def test_unit_equals_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    keys = rng.choices("abcde"[: rng.randint(1, 5)], k=rng.randint(0, 10))
    capacity = rng.randint(1, 3)
    assert belady_unit(unit_trace(keys), capacity).hits == optimum(keys, capacity)


def test_unit_bypasses() -> None:
    # capacity 1: admitting b would lose a's hit; MIN keeps a
    assert belady_unit(unit_trace("a b a"), 1).hits == 1
    # a b c a d a b, capacity 2: c and d bypassed, a and b held: a a b hit
    assert belady_unit(unit_trace("a b c a d a b"), 2).hits == 3


@pytest.mark.parametrize("seed", range(20))
def test_unit_at_least_every_online_policy(seed: int) -> None:
    rng = random.Random(seed)
    trace = [Access(float(i), f"k{int(rng.paretovariate(1.1)) % 30}", rng.randint(1, 9)) for i in range(400)]
    capacity = rng.randint(1, 12)
    bound = belady_unit(trace, capacity)
    for name in EVICTION_POLICIES:
        assert replay(trace, name, capacity_objects=capacity).hits <= bound.hits, name


def test_result_matches_replay_measures() -> None:
    chains = [["h1", "h2", "h3"], ["h1", "h2", "h4"], ["h1", "h5", "h2"]]
    trace = [
        Access(float(req), block, 16, "t", req=req, pos=pos)
        for req, chain in enumerate(chains)
        for pos, block in enumerate(chain)
    ]
    result = belady_unit(iter(trace), 2, window_s=1.0)  # an iterable is read into memory
    # capacity 2: h1 and h2 held throughout (h3, h4, h5 never come back and are bypassed)
    assert (result.policy, result.capacity, result.capacity_unit) == ("belady", 2, "objects")
    assert (result.requests, result.hits, result.bytes_requested, result.bytes_hit) == (9, 4, 144, 64)
    assert (result.prefix_requests, result.prefix_hits) == (9, 3)
    assert result.per_ns == {"t": (9, 4)}
    assert result.windows == ((0.0, 3, 0), (1.0, 3, 2), (2.0, 3, 2))


def test_size_on_unit_sizes_is_belady_unit() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        trace = unit_trace(rng.choices("abcdefg", k=60))
        capacity = rng.randint(1, 5)
        assert belady_size(trace, capacity).hits == belady_unit(trace, capacity).hits


def test_size_evicts_farthest_first() -> None:
    # c (4 bytes, next used at 3) needs both a (next 4) and b (next 5) out: both are farther, so both go
    trace = sized_trace("a b c c a b", {"a": 2, "b": 2, "c": 4})
    result = belady_size(trace, 4)
    assert result.policy == "belady-size (heuristic)"
    assert (result.hits, result.bytes_hit) == (1, 4)


def test_size_bypasses_when_a_victim_is_needed_sooner() -> None:
    # c (next use 4) would need b (next 5) and a (next 3) out; a is needed before c, so c is bypassed and b,
    # taken off the heap as a candidate, must still be held for its hit at the end
    trace = sized_trace("a b c a c b", {"a": 2, "b": 2, "c": 4})
    assert belady_size(trace, 4).hits == 2


def test_size_never_admits_what_is_not_reused_or_too_big() -> None:
    trace = sized_trace("a big z a big", {"a": 1, "big": 9, "z": 3})
    assert belady_size(trace, 4).hits == 1


def test_size_never_exceeds_capacity_and_beats_lru_on_a_scan() -> None:
    # a loop slightly larger than the cache: LRU hits nothing, a clairvoyant cache keeps most of it
    trace = sized_trace("a b c d e " * 10, {k: 2 for k in "abcde"})
    assert replay(trace, "lru", capacity_bytes=8).hits == 0
    assert belady_size(trace, 8).hits == belady_unit(unit_trace("a b c d e " * 10), 4).hits > 0


@pytest.mark.parametrize("function", [belady_unit, belady_size])
def test_bad_capacity(function: object) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        function(unit_trace("a"), 0)  # type: ignore[operator]
    with pytest.raises(TypeError, match="must be an int"):
        function(unit_trace("a"), 1.5)  # type: ignore[operator]
