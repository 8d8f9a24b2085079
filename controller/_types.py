"""Identifiers and the stored entry: the values that cross between tiers, the store and the decorator."""

from __future__ import annotations

from typing import NamedTuple, NewType

CacheKey = NewType("CacheKey", str)
"""Hex digest binding function, model, revision, template, params, namespace and arguments."""

Namespace = NewType("Namespace", str)
"""Tenant scope. Every tier call names one; no call can reach an entry of another."""

TierName = NewType("TierName", str)

L1 = TierName("l1")
L2 = TierName("l2")
L3 = TierName("l3")


class Entry(NamedTuple):
    """A cached value with its lifetime. The TTL travels with the value through every tier.

    A named tuple rather than a frozen dataclass: one is made for every store and every L2/L3 read, and a
    named tuple is built in half the time. Immutable all the same.

    ``value`` is the serialised payload (``controller._serialize``; tiers wrap it with ``controller._codec``);
    ``expires_at`` is an absolute time on the store's clock (wall clock by default, so L2 and L3 entries written
    by one process expire for all), ``None`` for no expiry. ``sliding_ttl`` is set only when the rule opted into sliding renewal: each hit moves
    ``expires_at`` to ``now + sliding_ttl``. ``saved_ms`` is what computing the value cost (an eviction signal);
    ``saved_tokens`` and ``saved_cost`` what it cost in an engine's tokens and in money, as the engine reported
    (``CallHandle.report_usage``; 0 when none did): what each hit on it saves.
    """

    value: bytes
    expires_at: float | None
    created_at: float
    rule: str = ""
    saved_ms: float = 0.0
    sliding_ttl: float | None = None
    saved_tokens: int = 0
    saved_cost: float = 0.0

    @property
    def size(self) -> int:
        return len(self.value)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def renewed(self, now: float) -> Entry:
        """The entry as it stands after a hit: a sliding entry gets a fresh lifetime, others are unchanged."""
        if self.sliding_ttl is None:
            return self
        return self._replace(expires_at=now + self.sliding_ttl)

    def remaining_ttl(self, now: float) -> float | None:
        return None if self.expires_at is None else max(self.expires_at - now, 0.0)
