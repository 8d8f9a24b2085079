"""One eviction policy = one small class making one decision.

The owner (the L1 memory tier, or the replay simulator on a virtual clock) does all accounting: it stores
values, counts bytes, enforces capacity and quotas. The policy only keeps its order structure up to date
through the ``on_*`` notifications and, when asked, names the key to evict next with ``victim()``.
Time comes from the injected ``clock`` and randomness from the injected ``rng``, never from globals, so
that replay is deterministic.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

Clock = Callable[[], float]


class EntryInfo(NamedTuple):
    """What a policy may know about an entry when it is inserted. (A named tuple: one is made per write.)"""

    size: int
    ns: str = ""
    saved_ms: float = 0.0
    weight: float = 1.0  # the tenant's weight (policy `tenants.<name>.weight`), for score-based policies


class EvictionPolicy(abc.ABC):
    """Tracks the keys held by its owner and chooses victims.

    Contract (checked by the shared suite in tests/test_eviction.py):
    - ``on_insert`` is called once per key added, ``on_hit`` (or ``on_hits``, batched) on every hit,
      ``on_remove`` whenever the owner
      drops a key for any reason (evicted, expired, deleted, replaced: a replacement is remove + insert).
    - ``victim()`` returns a key currently held and does not remove it; the owner calls ``on_remove`` after.
      ``victim(ns)`` restricts the choice to keys inserted with that namespace (tenant quotas).
      It raises ``KeyError`` when no key qualifies.
    - Policies are deterministic given the same notifications, clock readings and rng seed.
    """

    name: str = ""

    def __init__(self, *, clock: Clock = time.monotonic, rng: random.Random | None = None) -> None:
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)

    @abc.abstractmethod
    def on_insert(self, key: Hashable, info: EntryInfo) -> None: ...

    @abc.abstractmethod
    def on_hit(self, key: Hashable) -> None: ...

    def on_hits(self, keys: Sequence[Hashable]) -> None:
        """Hits in the order they happened (the L1 tier replays its read buffer in batches). A policy may
        override it when a batch can be applied more cheaply than hit by hit, with the same result."""
        on_hit = self.on_hit
        for key in keys:
            on_hit(key)

    @abc.abstractmethod
    def on_remove(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def victim(self, ns: str | None = None) -> Hashable: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...
