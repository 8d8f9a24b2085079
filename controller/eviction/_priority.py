"""Bases for policies that evict the key of lowest priority: the base keeps the heap, a subclass says what a
priority is (``priority(key)``, in the manner of SGLang's ``evict_policy``)."""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Hashable
from typing import Any

from ._base import Clock, EntryInfo, EvictionPolicy
from ._index import NsHeap

_NOBODY: Hashable = object()  # "no victim named": keys are arbitrary hashables, so None could be one


class PriorityPolicy(EvictionPolicy):
    """Evicts the key whose ``priority(key)`` is lowest; equal priorities go to the key accessed longest ago.

    Time is a logical access counter, ``self._tick`` (1 at the first notification, +1 per insert or hit), not
    the injected clock: victims then depend only on the order of notifications, so replay reproduces them
    exactly. Subclasses keep the per-key state ``priority`` reads, updating it in ``_record`` and dropping it
    in ``_forget``. Cost: O(log n) per notification, O(1) amortised per ``victim``, in or out of a namespace.
    """

    def __init__(self, *, clock: Clock = time.monotonic, rng: random.Random | None = None) -> None:
        super().__init__(clock=clock, rng=rng)
        self._heap = NsHeap()
        self._infos: dict[Hashable, EntryInfo] = {}
        self._tick = 0

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        """Raises ``ValueError`` if ``key`` is held already (replacing is ``on_remove`` + ``on_insert``)."""
        if key in self._infos:
            raise ValueError(f"{key!r} is already held; replace it with on_remove then on_insert")
        self._infos[key] = info
        self._touch(key, first=True)

    def on_hit(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        if key not in self._infos:
            raise KeyError(key)
        self._touch(key, first=False)

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        del self._infos[key]
        self._heap.remove(key)
        self._forget(key)

    def victim(self, ns: str | None = None) -> Hashable:
        return self._heap.lowest(ns)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def _touch(self, key: Hashable, *, first: bool) -> None:
        self._tick += 1
        self._record(key, first=first)
        self._heap.push(key, self._infos[key].ns, self.priority(key))

    @abc.abstractmethod
    def priority(self, key: Hashable) -> Any:
        """The sort key of a held key as of its last access: lowest is evicted first."""

    @abc.abstractmethod
    def _record(self, key: Hashable, *, first: bool) -> None:
        """Update the state of ``key`` for the access numbered ``self._tick`` (``first``: its insertion)."""

    @abc.abstractmethod
    def _forget(self, key: Hashable) -> None:
        """Drop the state of a removed key."""


class AgingPolicy(PriorityPolicy):
    """Greedy-Dual aging: ``priority = L + score(key)``, with ``score`` counting hits in some way.

    ``L``, the inflation value, rises to the priority of each evicted key, and a key's priority is fixed with
    the ``L`` of its last access. So a key's past popularity counts against keys accessed since only until the
    cache has evicted its way up to it: frequency that is not renewed ages out (LFU-DA, GDSF), where plain LFU
    would keep a once-hot key forever.

    ``L`` moves only when the owner removes the key that the immediately preceding ``victim()`` named: a
    deletion or expiry is not an eviction and must not age the cache, and a victim looked at but not acted on
    leaves no trace (any other notification in between forgets it).
    """

    def __init__(self, *, clock: Clock = time.monotonic, rng: random.Random | None = None) -> None:
        super().__init__(clock=clock, rng=rng)
        self._hits: dict[Hashable, int] = {}  # accesses, the insertion included
        self._inflation = 0.0
        self._named: Hashable = _NOBODY

    @property
    def inflation(self) -> float:
        return self._inflation

    @abc.abstractmethod
    def score(self, key: Hashable) -> float:
        """What a key is worth over ``L``; it may read ``self._hits[key]`` and ``self._infos[key]``."""

    def priority(self, key: Hashable) -> float:
        return self._inflation + self.score(key)

    def victim(self, ns: str | None = None) -> Hashable:
        key = super().victim(ns)
        self._named = key
        return key

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        self._named = _NOBODY
        super().on_insert(key, info)

    def on_hit(self, key: Hashable) -> None:
        self._named = _NOBODY
        super().on_hit(key)

    def on_remove(self, key: Hashable) -> None:
        if self._named is not _NOBODY and key == self._named and key in self._heap:
            self._inflation = max(self._inflation, self._heap.priority(key))
        self._named = _NOBODY
        super().on_remove(key)

    def _record(self, key: Hashable, *, first: bool) -> None:
        self._hits[key] = 1 if first else self._hits[key] + 1

    def _forget(self, key: Hashable) -> None:
        del self._hits[key]
