"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP '23)."""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from ._base import BuildContext, Clock, EntryInfo, EvictionPolicy
from ._index import NsQueue

_NOBODY: Hashable = object()  # "no victim named": keys are arbitrary hashables, so None could be one
_MAX_FREQ = 3  # the paper's two-bit counter


class S3FIFOPolicy(EvictionPolicy):
    """Three FIFO queues: small (S, ``small_fraction`` of the cache), main (M, the rest), ghost (G: keys).

    Most keys are never hit again after insertion; S lets them leave quickly, before they can push out keys
    that are reused. Following the paper's algorithm:

    - a new key enters S, or M when it is in G (it was evicted from S too early); its counter starts at 0;
    - a hit adds 1 to the key's counter, capped at 3; keys never move on a hit;
    - evicting from S looks at its oldest key: with a counter of at least ``move_threshold`` (the paper's
      ``freq > 1``, so 2) it moves to M with its counter cleared and the next oldest is looked at; otherwise
      it is the victim, and its key enters G when the owner's next notification removes it;
    - evicting from M looks at its oldest key: a counter above 0 is decremented and the key re-queued (the
      two-bit CLOCK); a counter of 0 makes it the victim;
    - S is evicted from while it holds at least ``small_fraction`` of the cache, M otherwise.

    Sizes: the owner's capacity is in bytes, so with ``capacity`` (bytes) the S/M split is by bytes (each key
    weighs ``EntryInfo.size``) against that capacity; with ``capacity=None`` it is by key count against the
    keys held. ``victim(ns)`` runs the same algorithm on the namespace's keys alone, measured against the
    namespace's own holdings (about its quota when the owner asks). The paper evicts from M right after a
    move from S overfills M; here one call names one victim, so M over its share is evicted from first on the
    next call instead. G holds as many keys as M holds at its target share: ``ceil((1 - small_fraction) *
    keys held)``, oldest dropped first (the paper sizes G like M in entries).

    ``victim()`` may move keys between S and M and decrement counters: promotion and re-queueing are part of
    choosing, as in the paper. It never drops a held key, and calling it again without a notification in
    between returns the same key.
    """

    name = "s3fifo"

    def __init__(
        self,
        *,
        capacity: int | None = None,
        small_fraction: float = 0.1,
        move_threshold: int = 2,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
            raise TypeError(f"capacity must be an int (bytes) or None, not {type(capacity).__name__}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        if not 1 <= move_threshold <= _MAX_FREQ:
            raise ValueError(f"move_threshold must be in 1..{_MAX_FREQ}, got {move_threshold!r}")
        super().__init__(clock=clock, rng=rng)
        self.capacity = capacity
        self.small_fraction = small_fraction
        self.move_threshold = move_threshold
        self._small = NsQueue()
        self._main = NsQueue()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._named: Hashable = _NOBODY
        self._named_in: str | None = None  # the ns argument of the victim() call that named it

    @classmethod
    def build(cls, context: BuildContext, **options: Any) -> EvictionPolicy:
        """Sized by the owner's capacity (see the class docstring)."""
        return cls(capacity=context.capacity, clock=context.clock, rng=context.rng, **options)

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        """Raises ``ValueError`` if ``key`` is held already (replacing is ``on_remove`` + ``on_insert``)."""
        if key in self._freq:
            raise ValueError(f"{key!r} is already held; replace it with on_remove then on_insert")
        self._named = _NOBODY
        queue = self._main if self._ghost.pop(key, _NOBODY) is not _NOBODY else self._small
        queue.push(key, info.ns, info.size if self.capacity is not None else 1)
        self._freq[key] = 0

    def on_hit(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        self._named = _NOBODY
        self._freq[key] = min(self._freq[key] + 1, _MAX_FREQ)

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held. Only a key evicted from S as named enters G."""
        del self._freq[key]
        evicted = self._named is not _NOBODY and key == self._named
        self._named = _NOBODY
        if key in self._main:
            self._main.remove(key)
            return
        self._small.remove(key)
        if evicted:
            self._ghost[key] = None
            limit = max(1, math.ceil((1.0 - self.small_fraction) * len(self)))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)

    def victim(self, ns: str | None = None) -> Hashable:
        if self._named is not _NOBODY and self._named_in == ns:
            # Asked again before acting: promotions made by the first call may have changed which queue is
            # due, but the answer must not change under the caller.
            return self._named
        picks: tuple[Callable[[str | None], Hashable], ...] = (self._from_main, self._from_small)
        if self._small_due(ns):
            picks = (self._from_small, self._from_main)
        for pick in picks:
            key = pick(ns)
            if key is not _NOBODY:
                self._named, self._named_in = key, ns
                return key
        raise KeyError("no key held" if ns is None else f"no key held in namespace {ns!r}")

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def _small_due(self, ns: str | None) -> bool:
        whole = self._small.measure(ns) + self._main.measure(ns)
        if ns is None and self.capacity is not None:
            whole = self.capacity
        main_over = self._main.measure(ns) > (1.0 - self.small_fraction) * whole
        return not main_over and self._small.measure(ns) >= self.small_fraction * whole

    def _from_small(self, ns: str | None) -> Hashable:
        while self._small.count(ns):
            key = self._small.oldest(ns)
            if self._freq[key] < self.move_threshold:
                return key
            self._main.push(key, *self._small.remove(key))
            self._freq[key] = 0
        return _NOBODY

    def _from_main(self, ns: str | None) -> Hashable:
        # Terminates: each pass either returns or lowers a counter, and counters never exceed 3.
        while self._main.count(ns):
            key = self._main.oldest(ns)
            if self._freq[key] == 0:
                return key
            self._freq[key] -= 1
            self._main.requeue(key)
        return _NOBODY
