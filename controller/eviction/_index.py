"""Order structures the policies are built on.

Each keeps one global view and one view per namespace, so that ``victim(ns)`` (tenant quotas evict inside
one namespace, possibly on every insert) costs the same as ``victim()``, not a scan past other tenants' keys.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class NsQueue:
    """Keys in queue order (oldest first), overall and per namespace, with a running measure per view.

    OrderedDicts rather than deques: keys leave from the middle (deleted, expired, hit under LRU) and must do
    so in O(1). The measure is what the owner of the queue counts its share in (bytes, or 1 per key).
    """

    __slots__ = ("_all", "_by_ns", "_measure", "_measure_ns")

    def __init__(self) -> None:
        self._all: OrderedDict[Hashable, tuple[str, int]] = OrderedDict()
        self._by_ns: dict[str, OrderedDict[Hashable, None]] = {}
        self._measure_ns: dict[str, int] = {}
        self._measure = 0

    def push(self, key: Hashable, ns: str, measure: int = 1) -> None:
        """Append ``key`` as the newest. The caller guarantees it is not queued already."""
        assert key not in self._all, key
        self._all[key] = (ns, measure)
        self._by_ns.setdefault(ns, OrderedDict())[key] = None
        self._measure += measure
        self._measure_ns[ns] = self._measure_ns.get(ns, 0) + measure

    def requeue(self, key: Hashable) -> None:
        """Make ``key`` the newest. Raises ``KeyError`` if it is not queued."""
        ns, _ = self._all[key]
        self._all.move_to_end(key)
        self._by_ns[ns].move_to_end(key)

    def remove(self, key: Hashable) -> tuple[str, int]:
        """Drop ``key`` and return its ``(ns, measure)``. Raises ``KeyError`` if it is not queued."""
        ns, measure = self._all.pop(key)
        keys = self._by_ns[ns]
        del keys[key]
        self._measure -= measure
        if keys:
            self._measure_ns[ns] -= measure
        else:  # forget empty namespaces so that tenants that come and go leave nothing behind
            del self._by_ns[ns]
            del self._measure_ns[ns]
        return ns, measure

    def oldest(self, ns: str | None = None) -> Hashable:
        """The oldest key (of ``ns``). Raises ``KeyError`` when there is none."""
        keys = self._all if ns is None else self._by_ns.get(ns)
        if not keys:
            raise KeyError("no key queued" if ns is None else f"no key queued in namespace {ns!r}")
        return next(iter(keys))

    def count(self, ns: str | None = None) -> int:
        if ns is None:
            return len(self._all)
        keys = self._by_ns.get(ns)
        return len(keys) if keys else 0

    def measure(self, ns: str | None = None) -> int:
        return self._measure if ns is None else self._measure_ns.get(ns, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._all

    def __len__(self) -> int:
        return len(self._all)


class NsHeap:
    """Keys by ascending priority, overall and per namespace: binary heaps with lazy invalidation.

    ``heapq`` cannot re-prioritise or remove an item in place. Instead every update pushes a new item and
    records its sequence number as the key's live one; items whose number is no longer live are discarded when
    they surface at the top. The heaps are rebuilt from the live items once stale ones outnumber them, so
    memory stays O(keys). Update and removal cost O(log n) amortised (twice: global and namespace heap); the
    lowest key costs O(1) amortised. Equal priorities fall back to the sequence number: the key updated
    longest ago comes first.
    """

    __slots__ = ("_all", "_by_ns", "_live", "_ns_items", "_seq")

    _SLACK = 64  # rebuild only past this many stale items, so that small heaps are not rebuilt on every push

    def __init__(self) -> None:
        self._live: dict[Hashable, tuple[Any, int, str]] = {}  # key -> (priority, seq, ns) of its live item
        self._all: list[tuple[Any, int, Hashable]] = []
        self._by_ns: dict[str, list[tuple[Any, int, Hashable]]] = {}
        self._ns_items = 0  # items over all namespace heaps; they are popped apart from the global heap's
        self._seq = 0

    def push(self, key: Hashable, ns: str, priority: Any) -> None:
        """Set the priority of ``key`` (new or not)."""
        self._seq += 1
        item = (priority, self._seq, key)
        self._live[key] = (priority, self._seq, ns)
        heapq.heappush(self._all, item)
        heapq.heappush(self._by_ns.setdefault(ns, []), item)
        self._ns_items += 1
        if max(len(self._all), self._ns_items) > 2 * len(self._live) + self._SLACK:
            self._rebuild()

    def remove(self, key: Hashable) -> None:
        """Forget ``key``; its items go stale. Raises ``KeyError`` if it is not held."""
        del self._live[key]

    def priority(self, key: Hashable) -> Any:
        return self._live[key][0]

    def lowest(self, ns: str | None = None) -> Hashable:
        """The key of lowest priority (in ``ns``). Raises ``KeyError`` when there is none."""
        heap = self._all if ns is None else self._by_ns.get(ns, [])
        while heap:
            _, seq, key = heap[0]
            live = self._live.get(key)
            if live is not None and live[1] == seq:
                return key
            heapq.heappop(heap)
            if ns is not None:
                self._ns_items -= 1
        raise KeyError("no key held" if ns is None else f"no key held in namespace {ns!r}")

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def _rebuild(self) -> None:
        self._all = [(priority, seq, key) for key, (priority, seq, _) in self._live.items()]
        heapq.heapify(self._all)
        self._by_ns = {}
        for key, (priority, seq, ns) in self._live.items():
            self._by_ns.setdefault(ns, []).append((priority, seq, key))
        for heap in self._by_ns.values():
            heapq.heapify(heap)
        self._ns_items = len(self._live)
