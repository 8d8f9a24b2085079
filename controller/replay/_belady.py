"""Belady's MIN: what a cache that knows the future hits, the bound every online policy is measured against.

Offline by nature: both functions need the whole trace in memory (they take a sequence, or read an iterable
into a list first), plus two ints per access for next uses and a heap entry per access at worst.
Objects are keyed by ``(ns, key)`` like in the replay simulator, and the results are ``ReplayResult``s counted
by the same ``_tally``, so hit ratio, byte hit ratio, per-namespace counts, windows and prefix hit ratio mean
the same thing for MIN as for the online policies.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Sequence

from ._access import Access
from ._sim import ReplayResult, _tally, check_capacity


def belady_unit(
    trace: Sequence[Access] | Iterable[Access], capacity_objects: int, *, window_s: float | None = None
) -> ReplayResult:
    """The exact optimum of hits for a cache of ``capacity_objects`` objects, every object counting 1.

    Bypass is allowed: a missed object is not necessarily admitted. That is the true optimum (with forced
    admission the cache must sometimes throw out an object it will need, e.g. capacity 1 on ``a b a``).
    Rule: on a miss with the cache full, evict the cached object whose next use is farthest, unless the missed
    object's own next use is farther still, in which case it is not admitted. O(n log n) time, O(n) memory.
    Sizes are ignored for the decisions and used only for the byte measures. Policy name: ``"belady"``.
    """
    check_capacity("capacity_objects", capacity_objects)
    accesses = _materialise(trace)
    return _tally(
        _min_unit(accesses, capacity_objects),
        policy="belady",
        capacity=capacity_objects,
        unit="objects",
        window_s=window_s,
    )


def belady_size(
    trace: Sequence[Access] | Iterable[Access], capacity_bytes: int, *, window_s: float | None = None
) -> ReplayResult:
    """A heuristic for variable sizes, NOT an optimum (that problem is NP-hard): Belady's rule applied to bytes.

    Rule: victims are taken farthest next use first, size not weighed, until the missed object fits; the
    missed object is bypassed instead when its own next use is farther than that of a victim it would need
    (it would be the first to go), when it is never used again, or when it is heavier than the cache. With
    all sizes 1 it is exactly ``belady_unit``. Its hits are not an upper bound on online policies' for
    variable sizes; read it as "a strong clairvoyant policy". Policy name: ``"belady-size (heuristic)"``.
    """
    check_capacity("capacity_bytes", capacity_bytes)
    accesses = _materialise(trace)
    return _tally(
        _min_size(accesses, capacity_bytes),
        policy="belady-size (heuristic)",
        capacity=capacity_bytes,
        unit="bytes",
        window_s=window_s,
    )


def _materialise(trace: Sequence[Access] | Iterable[Access]) -> Sequence[Access]:
    return trace if isinstance(trace, Sequence) else list(trace)


def _next_uses(accesses: Sequence[Access]) -> tuple[list[Hashable], list[int]]:
    """The object key of each access and the index of its object's next access. An object never accessed again
    gets ``n + i``: beyond every real index, and distinct, so that heap entries never tie and a key's live
    entry is recognised by its next use alone."""
    n = len(accesses)
    keys: list[Hashable] = [(ns, key) if ns else key for _, key, _, ns, *_ in accesses]
    nxt = [0] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        k = keys[i]
        nxt[i] = last.get(k, n + i)
        last[k] = i
    return keys, nxt


def _min_unit(accesses: Sequence[Access], capacity: int) -> Iterator[tuple[Access, bool]]:
    keys, nxt = _next_uses(accesses)
    cached: dict[Hashable, int] = {}  # key -> its next use; heap entries disagreeing with it are stale
    heap: list[tuple[int, Hashable]] = []  # (-next use, key): a max-heap on next use
    push, pop = heapq.heappush, heapq.heappop
    for i, a in enumerate(accesses):
        k, n_i = keys[i], nxt[i]
        if k in cached:
            cached[k] = n_i
            push(heap, (-n_i, k))
            yield a, True
            continue
        if len(cached) >= capacity:
            while cached.get(heap[0][1]) != -heap[0][0]:
                pop(heap)
            if n_i > -heap[0][0]:
                yield a, False  # bypass: the missed object would be the farthest-used one held
                continue
            del cached[pop(heap)[1]]
        cached[k] = n_i
        push(heap, (-n_i, k))
        yield a, False


def _min_size(accesses: Sequence[Access], capacity: int) -> Iterator[tuple[Access, bool]]:
    keys, nxt = _next_uses(accesses)
    n = len(accesses)
    cached: dict[Hashable, tuple[int, int]] = {}  # key -> (next use, admitted size)
    heap: list[tuple[int, Hashable]] = []
    push, pop = heapq.heappush, heapq.heappop
    used = 0
    for i, a in enumerate(accesses):
        k, n_i, size = keys[i], nxt[i], a.size
        held = cached.get(k)
        if held is not None:
            cached[k] = (n_i, held[1])
            push(heap, (-n_i, k))
            yield a, True
            continue
        if size > capacity or n_i >= n:
            yield a, False
            continue
        victims: list[tuple[int, Hashable]] = []
        freed = 0
        while used - freed + size > capacity:
            while True:  # drop stale entries: keys evicted, or re-pushed by a later hit
                top_use, top_key = heap[0]
                top = cached.get(top_key)
                if top is not None and top[0] == -top_use:
                    break
                pop(heap)
            if -heap[0][0] < n_i:
                break  # a victim would be needed sooner than the missed object: bypass it instead
            victim = pop(heap)
            victims.append(victim)
            freed += cached[victim[1]][1]
        if used - freed + size > capacity:
            for victim in victims:
                push(heap, victim)
            yield a, False
            continue
        for _, v in victims:
            del cached[v]
        used += size - freed
        cached[k] = (n_i, size)
        push(heap, (-n_i, k))
        yield a, False
