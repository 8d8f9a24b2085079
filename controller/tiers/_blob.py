"""The part L2 (Redis) and L3 (disk) share: entries kept outside the process as signed blobs."""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence

from .._codec import EntryCodec, check_keys, check_ns, check_slot
from .._types import CacheKey, Entry, Namespace
from ..errors import CorruptEntry
from ._base import FaultHook, Tier, log_fault

log = logging.getLogger("evocache.controller.tiers")


class BlobTier(Tier):
    """A tier whose backend holds ``controller._codec`` blobs, signed with ``secret``.

    The base does what every such tier must do the same way: verify and decode each blob, drop (delete and
    report through ``on_fault``) a corrupt one, hide expired entries, write back renewed sliding entries, and
    skip already-expired writes. A backend supplies ``_fetch`` (one blob or ``None`` per key, in order) and
    ``_store`` (encode with ``self._codec`` and write with the backend's own TTL), both raising
    ``TierUnavailable`` on failure.
    """

    def __init__(
        self, *, secret: bytes, clock: Callable[[], float] = time.time, on_fault: FaultHook = log_fault
    ) -> None:
        super().__init__(on_fault=on_fault)
        self._codec = EntryCodec(secret)
        self._clock = clock

    @abc.abstractmethod
    def _fetch(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[bytes | None]: ...

    @abc.abstractmethod
    def _store(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]], now: float) -> None: ...

    def _fetch_one(self, ns: Namespace, key: CacheKey) -> bytes | None:
        return self._fetch(ns, [key])[0]

    def get_many(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[Entry | None]:
        check_ns(ns)
        check_keys(keys)
        if not keys:
            return []
        blobs = self._fetch(ns, keys)
        now = self._clock()
        return [self._live(ns, key, blob, now) for key, blob in zip(keys, blobs, strict=True)]

    def get_one(self, ns: Namespace, key: CacheKey) -> Entry | None:
        check_slot(ns, key)
        blob = self._fetch_one(ns, key)
        return None if blob is None else self._live(ns, key, blob, self._clock())

    def _live(self, ns: Namespace, key: CacheKey, blob: bytes | None, now: float) -> Entry | None:
        """The entry a fetched blob holds, if it is sound and live. A corrupt blob is deleted and reported;
        a sliding entry is written back renewed."""
        if blob is None:
            return None
        try:
            entry = self._codec.decode(ns, key, blob, tier=self.name)
        except CorruptEntry as exc:
            log.warning("%s", exc)
            self.delete(ns, [key])
            self.on_fault(self.name, "corrupt")
            return None
        if entry.expires_at is not None and now >= entry.expires_at:  # Entry.expired, inlined (request path)
            return None
        if entry.sliding_ttl is not None:
            entry = entry.renewed(now)
            self._store(ns, [(key, entry)], now)
        return entry

    def set_many(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]]) -> None:
        check_ns(ns)
        check_keys([key for key, _ in items])
        now = self._clock()
        live = [(key, entry) for key, entry in items if not entry.expired(now)]
        if live:
            self._store(ns, live, now)
