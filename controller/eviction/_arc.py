"""ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST '03)."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from ._base import BuildContext, Clock, EntryInfo, EvictionPolicy
from ._index import NsQueue

_NOBODY: Hashable = object()  # "no key": keys are arbitrary hashables, so None could be one


class _Ghosts:
    """Keys the cache evicted, oldest first, each with the measure it had, and their total: a ghost list
    holds no value, only the memory that the key was there."""

    __slots__ = ("keys", "measure")

    def __init__(self) -> None:
        self.keys: OrderedDict[Hashable, int] = OrderedDict()
        self.measure = 0

    def add(self, key: Hashable, measure: int) -> None:
        self.keys[key] = measure
        self.measure += measure

    def pop(self, key: Hashable) -> int:
        measure = self.keys.pop(key)
        self.measure -= measure
        return measure

    def drop_oldest(self) -> None:
        _, measure = self.keys.popitem(last=False)
        self.measure -= measure


class ARCPolicy(EvictionPolicy):
    """Two LRU lists of held keys, T1 (seen once recently) and T2 (seen at least twice), and two ghost lists
    of keys evicted from them, B1 and B2. A target ``p`` for T1's share moves towards whichever list's ghosts
    are hit: a hit in B1 means T1 was too small (``p`` grows), a hit in B2 that T2 was (``p`` shrinks).

    As in the paper, with ``c`` the capacity:

    - a hit moves its key to the new end of T2; a new key enters T1, a key found in B1 or B2 enters T2;
    - a hit in B1 adds ``max(1, |B2| / |B1|)`` to ``p`` (at most ``c``), a hit in B2 takes
      ``max(1, |B1| / |B2|)`` from it (at least 0); ``p`` is a float, as the ratios are;
    - the victim (the paper's REPLACE) is T1's oldest key when T1 holds more than ``p``, or exactly ``p`` and
      the missed key is in B2; T2's oldest otherwise (the other list's when that one is empty);
    - the named victim enters the ghost list of its list when the owner removes it; other removals
      (deletions, expiry, replacement) leave no ghost;
    - ghosts are dropped oldest first so that ``|T1| + |B1| <= c`` (from B1) and
      ``|T1| + |T2| + |B1| + |B2| <= 2c`` (from B2, then B1), checked after each insertion. The paper drops
      them before choosing the victim; counted in keys, the same ghosts go.

    Capacity: the owner decides when to evict; ``c`` only bounds the ghosts and ``p``. With ``capacity`` every
    list is measured in the unit of ``EntryInfo.size`` (the owner's bytes, or 1 per object when it counts
    objects) against it, and a ghost hit moves ``p`` by the ghost's own size times the ratio above (the
    paper's unit is a page). With ``capacity=None`` every key weighs 1 and ``c`` is the most keys held at
    once so far (the owner's capacity in keys, as far as the policy can see). Counted in objects it hits
    exactly what libCacheSim's ARC hits; in bytes the two generalise the paper differently and differ
    (docs/eviction.md, "ARC").

    The paper adapts ``p``, and reads "the missed key is in B2", before choosing the victim of a miss. The
    owner names the missed key in ``on_access`` (``uses_context``), before it asks for victims; an owner that
    does not (the L1 tier) gets the adaptation at ``on_insert``, after that miss's victims were chosen, and
    no B2 tie-break.

    ``victim(ns)`` applies the same rule to the lists as a whole, then takes the oldest key of the
    namespace in the chosen list (in the other when the chosen one has none of it). ``victim()`` changes
    nothing, so it names the same key until the next notification.
    """

    name = "arc"
    uses_context = True

    def __init__(
        self,
        *,
        capacity: int | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
            raise TypeError(f"capacity must be an int (the size unit) or None, not {type(capacity).__name__}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        super().__init__(clock=clock, rng=rng)
        self.capacity = capacity
        self.p = 0.0
        self._t1 = NsQueue()
        self._t2 = NsQueue()
        self._b1 = _Ghosts()
        self._b2 = _Ghosts()
        self._most_keys = 0
        self._missed: Hashable = _NOBODY  # the key of the access announced by on_access
        self._adapted = False  # p already moved for that access (its key was a ghost)
        self._named: Hashable = _NOBODY

    @classmethod
    def build(cls, context: BuildContext, **options: Any) -> EvictionPolicy:
        """Sized by the owner's capacity (see the class docstring)."""
        return cls(capacity=context.capacity, clock=context.clock, rng=context.rng, **options)

    # -- notifications ------------------------------------------------------------------------------------

    def on_access(self, key: Hashable, info: EntryInfo) -> None:
        self._named = _NOBODY
        self._missed = key
        self._adapted = self._adapt(key)

    def on_hit(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        self._named = self._missed = _NOBODY
        if key in self._t1:
            self._t2.push(key, *self._t1.remove(key))
        else:
            self._t2.requeue(key)

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        """Raises ``ValueError`` if ``key`` is held already (replacing is ``on_remove`` + ``on_insert``)."""
        if key in self:
            raise ValueError(f"{key!r} is already held; replace it with on_remove then on_insert")
        announced = self._missed is not _NOBODY and self._missed == key and self._adapted
        self._named = self._missed = _NOBODY
        if not announced:
            self._adapt(key)
        measure = 1 if self.capacity is None else info.size
        for ghosts in (self._b1, self._b2):
            if key in ghosts.keys:
                ghosts.pop(key)
                self._t2.push(key, info.ns, measure)
                break
        else:
            self._t1.push(key, info.ns, measure)
        self._most_keys = max(self._most_keys, len(self))
        self._trim()

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held. Only the named victim enters a ghost list."""
        evicted = self._named is not _NOBODY and self._named == key
        self._named = _NOBODY
        if key in self._t1:
            ghosts, (_, measure) = self._b1, self._t1.remove(key)
        else:
            ghosts, (_, measure) = self._b2, self._t2.remove(key)
        if evicted:
            ghosts.add(key, measure)

    def victim(self, ns: str | None = None) -> Hashable:
        t1 = self._t1.measure()
        missed = self._missed
        from_t1 = t1 > self.p or (t1 == self.p and missed is not _NOBODY and missed in self._b2.keys)
        for queue in (self._t1, self._t2) if from_t1 else (self._t2, self._t1):
            if queue.count(ns):
                self._named = key = queue.oldest(ns)
                return key
        raise KeyError("no key held" if ns is None else f"no key held in namespace {ns!r}")

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    # -- adaptation ---------------------------------------------------------------------------------------

    @property
    def c(self) -> int:
        """The capacity the ghosts and ``p`` are bounded by (see the class docstring)."""
        return self.capacity if self.capacity is not None else max(self._most_keys, 1)

    def _adapt(self, key: Hashable) -> bool:
        """Move ``p`` for a ghost hit on ``key`` (not held); False when ``key`` is no ghost."""
        b1, b2 = self._b1, self._b2
        if key in b1.keys:
            step = b1.keys[key] * max(1.0, b2.measure / b1.measure)
            self.p = min(self.p + step, float(self.c))
            return True
        if key in b2.keys:
            step = b2.keys[key] * max(1.0, b1.measure / b2.measure)
            self.p = max(self.p - step, 0.0)
            return True
        return False

    def _trim(self) -> None:
        c, b1, b2 = self.c, self._b1, self._b2
        while b1.keys and self._t1.measure() + b1.measure > c:
            b1.drop_oldest()
        while (b1.keys or b2.keys) and (
            self._t1.measure() + self._t2.measure() + b1.measure + b2.measure > 2 * c
        ):
            (b2 if b2.keys else b1).drop_oldest()
