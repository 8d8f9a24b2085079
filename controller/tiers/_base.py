"""The one tier interface. L1 memory, L2 Redis and L3 disk implement it; ``TieredStore`` composes them."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence

from .._types import CacheKey, Entry, Namespace, TierName

log = logging.getLogger("evocache.controller.tiers")

FaultHook = Callable[[TierName, str], None]
"""Called as ``hook(tier, kind)`` for per-entry faults a tier absorbs itself (``kind`` = ``"corrupt"``)."""


def log_fault(tier: TierName, kind: str) -> None:
    log.warning("tier %s: %s entry dropped", tier, kind)


class Tier(abc.ABC):
    """Batched get/set/delete inside one namespace.

    Contract:
    - ``get_many`` returns one item per key, in order: the live ``Entry`` or ``None`` (absent or expired).
      A payload that fails its checksum is deleted, reported through ``on_fault(name, "corrupt")`` and
      returned as ``None``: a corrupt entry is never returned.
    - ``set_many`` stores every item with its own ``expires_at``; an entry already expired is not stored.
    - A backend failure (down, timeout, disk full) raises ``TierUnavailable``; nothing else escapes.
    - No method can read or write an entry outside the namespace it is given.
    """

    name: TierName

    def __init__(self, *, on_fault: FaultHook = log_fault) -> None:
        self.on_fault = on_fault

    @abc.abstractmethod
    def get_many(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[Entry | None]: ...

    def get_one(self, ns: Namespace, key: CacheKey) -> Entry | None:
        """``get_many(ns, [key])[0]``: the request path reads one key, and a tier may do that with less work."""
        return self.get_many(ns, [key])[0]

    @abc.abstractmethod
    def set_many(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]]) -> None: ...

    @abc.abstractmethod
    def delete(self, ns: Namespace, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys``; returns how many were present."""

    @abc.abstractmethod
    def usage(self, ns: Namespace | None = None) -> int:
        """Bytes held, for one namespace or (``None``) for all."""

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing
        """Release connections and files."""
