"""``TieredStore``: tiers composed in order (L1, L2, L3); the boundary where a tier failure becomes a miss."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple
from types import MappingProxyType

from .._types import CacheKey, Entry, Namespace, TierName
from ..errors import TierError
from ._base import Tier

log = logging.getLogger("evocache.controller.tiers")

ErrorHook = Callable[[TierName, str, TierError], None]
"""``hook(tier, op, error)``, called for every tier failure the store absorbs; ``op``: get, set or delete."""

# A failing tier fails on every request; one log line per tier and operation per interval is enough to see it.
_LOG_EVERY_S = 10.0


class Lookup(NamedTuple):
    """The result of a read: the live entry and the tier that held it, or ``(None, None)`` for a miss.
    (A named tuple: one is made on every read.)"""

    entry: Entry | None
    tier: TierName | None

    @property
    def hit(self) -> bool:
        return self.entry is not None


MISS = Lookup(None, None)
_new_tuple = tuple.__new__


class TieredStore:
    """Read-through, write-through composition of tiers, fastest first.

    Reads ask each tier in order for the keys still missing and promote what a lower tier holds into the
    tiers above it. ``tiers=`` restricts a call to some of the store's tiers (a rule's tier list): names the
    store does not hold are skipped, so one policy serves deployments with and without Redis; the store's own
    order always applies. Writes go to every selected tier. ``delete`` always reaches every tier: invalidation
    must not leave a copy behind.

    A ``TierError`` from a tier is absorbed here and only here: it is logged (at most one line per tier and
    operation every few seconds), counted in ``error_counts[(tier, op)]``, passed to ``on_error`` and the call
    goes on as if that tier had missed (or skipped the write). Any other exception is a bug and propagates.
    A read never returns an entry that has expired on ``clock``.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        clock: Callable[[], float] = time.time,
        on_error: ErrorHook | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        by_name: dict[TierName, Tier] = {}
        for tier in tiers:
            if not isinstance(tier, Tier):
                raise TypeError(f"{tier!r} is not a Tier")
            if tier.name in by_name:
                raise ValueError(f"tier {tier.name!r} given twice")
            by_name[tier.name] = tier
        self._tiers = by_name
        self._clock = clock
        self._on_error = on_error
        self.error_counts: Counter[tuple[TierName, str]] = Counter()
        self._chains: dict[tuple[str, ...] | None, tuple[Tier, ...]] = {None: tuple(by_name.values())}
        self._last_logged: dict[tuple[TierName, str], float] = {}
        self._unlogged: Counter[tuple[TierName, str]] = Counter()
        self._error_lock = threading.Lock()  # replicas call the store from several threads

    @property
    def tiers(self) -> Mapping[TierName, Tier]:
        """The tiers by name, in lookup order."""
        return MappingProxyType(self._tiers)

    def get(self, ns: Namespace, key: CacheKey, tiers: Iterable[str] | None = None) -> Lookup:
        """``get_many(ns, [key], tiers)[0]`` without the batch bookkeeping: the request path's lookup."""
        try:
            chain = self._chains.get(tiers)  # type: ignore[arg-type]  # _chain's first step, inlined
        except TypeError:
            chain = None
        if chain is None:
            chain = self._chain(tiers)
        now = self._clock()
        failed: set[TierName] | None = None  # made on the first failure: this is the request path
        for depth, tier in enumerate(chain):
            try:
                entry = tier.get_one(ns, key)
            except TierError as exc:
                self._absorb(tier.name, "get", exc)
                failed = failed or set()
                failed.add(tier.name)
                continue
            if entry is not None and (entry.expires_at is None or now < entry.expires_at):
                for upper in chain[:depth]:
                    if failed is None or upper.name not in failed:
                        self._write(upper, ns, [(key, entry)])
                return _new_tuple(Lookup, (entry, tier.name))  # Lookup(...) without its Python-level __new__
        return MISS

    def get_many(
        self, ns: Namespace, keys: Sequence[CacheKey], tiers: Iterable[str] | None = None
    ) -> list[Lookup]:
        """One ``Lookup`` per key, in order. Each tier is asked only for the keys the ones above it missed."""
        chain = self._chain(tiers)
        found: list[Lookup] = [MISS] * len(keys)
        missing = list(range(len(keys)))
        now = self._clock()
        promote: list[list[int]] = []  # promote[i]: positions found in chain[i]
        failed: set[TierName] = set()
        for tier in chain:
            hits: list[int] = []
            promote.append(hits)
            if not missing:
                continue
            try:
                entries = tier.get_many(ns, [keys[i] for i in missing])
            except TierError as exc:
                self._absorb(tier.name, "get", exc)
                failed.add(tier.name)
                continue
            still: list[int] = []
            for i, entry in zip(missing, entries, strict=True):
                if entry is None or entry.expired(now):
                    still.append(i)
                else:
                    found[i] = Lookup(entry, tier.name)
                    hits.append(i)
            missing = still
        # Each tier above the one that held an entry gets a copy, so the next read stops higher up; a tier
        # that has just failed this read is not asked to write.
        for upper, tier in enumerate(chain):
            items = [(keys[i], found[i].entry) for lower in promote[upper + 1 :] for i in lower]
            if items and tier.name not in failed:
                self._write(tier, ns, items)  # type: ignore[arg-type]  # promoted entries are not None
        return found

    def set(
        self, ns: Namespace, key: CacheKey, entry: Entry, tiers: Iterable[str] | None = None
    ) -> tuple[TierName, ...]:
        """``set_many(ns, [(key, entry)], tiers)``."""
        return self.set_many(ns, [(key, entry)], tiers)

    def set_many(
        self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]], tiers: Iterable[str] | None = None
    ) -> tuple[TierName, ...]:
        """Write every item to every selected tier; a tier that fails is skipped (and counted). Returns the
        tiers that took the write, in the store's order (none when every item had expired already)."""
        now = self._clock()
        live = [(key, entry) for key, entry in items if not entry.expired(now)]
        if not live:
            return ()
        return tuple(tier.name for tier in self._chain(tiers) if self._write(tier, ns, live))

    def delete(self, ns: Namespace, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys`` from every tier; returns the number of stored copies removed, summed over tiers."""
        removed = 0
        for tier in self._tiers.values():
            try:
                removed += tier.delete(ns, keys)
            except TierError as exc:
                self._absorb(tier.name, "delete", exc)
        return removed

    def close(self) -> None:
        """Close every tier, even when one of them fails to close."""
        for tier in self._tiers.values():
            try:
                tier.close()
            except TierError as exc:
                log.warning("closing tier %s failed: %s", tier.name, exc)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _chain(self, tiers: Iterable[str] | None) -> tuple[Tier, ...]:
        # Rules pass the same tuple of names on every call: look that up first, before building a set.
        try:
            chain = self._chains.get(tiers)  # type: ignore[arg-type]
        except TypeError:  # an unhashable iterable (a list)
            chain = None
        if chain is not None:
            return chain
        wanted = frozenset(tiers)  # type: ignore[arg-type]
        chain = tuple(tier for name, tier in self._tiers.items() if name in wanted)
        if isinstance(tiers, tuple) and len(self._chains) < 256:
            self._chains[tiers] = chain
        return chain

    def _write(self, tier: Tier, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]]) -> bool:
        """Whether ``tier`` took the write; a failure is absorbed."""
        try:
            tier.set_many(ns, items)
        except TierError as exc:
            self._absorb(tier.name, "set", exc)
            return False
        return True

    def _absorb(self, tier: TierName, op: str, exc: TierError) -> None:
        slot, skipped = (tier, op), 0
        with self._error_lock:
            self.error_counts[slot] += 1
            now = time.monotonic()
            last = self._last_logged.get(slot)
            report = last is None or now - last >= _LOG_EVERY_S
            if report:
                skipped = self._unlogged.pop(slot, 0)
                self._last_logged[slot] = now
            else:
                self._unlogged[slot] += 1
        if report:
            more = f" (and {skipped} more since the last report)" if skipped else ""
            log.warning("tier %s %s failed, treated as a miss: %s%s", tier, op, exc, more)
        if self._on_error is not None:
            self._on_error(tier, op, exc)
