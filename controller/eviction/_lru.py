"""Least recently used."""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Sequence

from ._base import Clock, EntryInfo, EvictionPolicy
from ._index import NsQueue


class LRUPolicy(EvictionPolicy):
    """Evicts the key accessed longest ago (insertion counts as an access).

    One queue in access order (an ``OrderedDict`` per view, see ``NsQueue``): a hit moves its key to the new
    end in O(1), and the victim is the old end, in or out of a namespace, in O(1).
    """

    name = "lru"

    def __init__(self, *, clock: Clock = time.monotonic, rng: random.Random | None = None) -> None:
        super().__init__(clock=clock, rng=rng)
        self._order = NsQueue()

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        """Raises ``ValueError`` if ``key`` is held already (replacing is ``on_remove`` + ``on_insert``)."""
        if key in self._order:
            raise ValueError(f"{key!r} is already held; replace it with on_remove then on_insert")
        self._order.push(key, info.ns)

    def on_hit(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        self._order.requeue(key)

    def on_hits(self, keys: Sequence[Hashable]) -> None:
        """Only a key's last hit decides its place in LRU order, so a batch moves each key once, in the order
        of their last hits."""
        requeue = self._order.requeue
        for key in reversed(dict.fromkeys(reversed(keys))):
            requeue(key)

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        self._order.remove(key)

    def victim(self, ns: str | None = None) -> Hashable:
        return self._order.oldest(ns)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
