"""L1: entries in process memory, bounded in bytes, evicted by an injected policy."""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from .._codec import check_keys, check_ns
from .._types import L1, CacheKey, Entry, Namespace
from ..eviction import EntryInfo, EvictionPolicy, LRUPolicy
from ._base import FaultHook, Tier, log_fault

Slot = tuple[Namespace, CacheKey]
"""How the tier and its policy name an entry: the namespace is part of the key, so no lookup can cross it."""


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Counters since the tier was made. ``expirations`` counts entries dropped because their TTL ran out
    (on read, on delete, or when making room); ``rejected`` counts writes not stored because the entry alone
    exceeds the capacity, ``max_entry_bytes`` or its namespace's quota; ``bypassed`` counts writes the eviction
    policy chose not to admit (``EvictionPolicy.admit``: storing them would cost more valuable entries)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    rejected: int = 0
    bypassed: int = 0


class HotRead(NamedTuple):
    """The parts of a lock-free L1 read, for a caller that inlines ``MemoryTier.peek`` (see there)."""

    entries_get: Callable[[Slot], Entry | None]
    append: Callable[[Slot], None]
    reads: Any  # the read buffer (a bounded deque); only its len() is read
    note_reads: Callable[[], None]


class MemoryTier(Tier):
    """The L1 tier: a dict of entries in this process, bounded in bytes.

    Size: an entry weighs ``len(entry.value) + len(key)`` bytes, the payload and its key. Python object
    headers are not counted, so the capacity bounds what callers store, not the process's resident memory.

    Writes: a write always removes the previous value of its key first (a superseded value is never served).
    An entry already expired, or heavier than the capacity, ``max_entry_bytes`` or its namespace's quota, is
    then not stored and evicts nothing. Otherwise room is made: expired entries go first (an expiry heap makes
    that O(log n) each); then, while the namespace would exceed its quota, the policy's victims within that
    namespace; then, while the tier would exceed its capacity, the policy's victims overall.

    Names: namespaces and keys are checked like in every tier (``_codec.check_ns``, ``check_keys``): a bad one
    raises ``ValueError`` before anything in the batch is read or written.

    Reads: an expired entry is dropped and reported absent; a hit on a sliding entry stores and returns it
    renewed (``Entry.renewed``). ``get_many`` only ever sees the namespace it is given.

    Thread safety: one lock around every method, the policy's notifications included (policies are not
    thread-safe themselves); Ray replicas call tiers from several threads. The one exception is ``peek``, the
    request path's read, which takes no lock: it records its hit in a read buffer that is replayed to the policy
    under the lock before the next locked operation (the read buffer of Caffeine), so the policy sees every
    hit, in order, before it next chooses a victim.

    ``policy`` must be new (tracking no key): the tier keeps it in step with its contents and is its only
    notifier. ``quota(ns)`` gives a namespace's byte quota (``None``: none) and ``weight(ns)`` the tenant
    weight passed to the policy in ``EntryInfo``; both are read on every write, so they may change.
    """

    name = L1

    def __init__(
        self,
        capacity_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        quota: Callable[[Namespace], int | None] | None = None,
        weight: Callable[[Namespace], float] | None = None,
        max_entry_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
        on_fault: FaultHook = log_fault,
    ) -> None:
        _check_bytes("capacity_bytes", capacity_bytes)
        if max_entry_bytes is not None:
            _check_bytes("max_entry_bytes", max_entry_bytes)
        policy = LRUPolicy() if policy is None else policy
        if len(policy):
            raise ValueError(
                f"the {type(policy).__name__} already tracks {len(policy)} keys; give the tier a new one"
            )
        super().__init__(on_fault=on_fault)
        self.capacity_bytes = capacity_bytes
        self.max_entry_bytes = max_entry_bytes
        self._policy = policy
        self._quota = quota
        self._weight = weight
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Slot, Entry] = {}
        self._bytes = 0
        self._ns_bytes: dict[Namespace, int] = {}
        # (expires_at, seq, slot), lazily invalidated: renewing or replacing an entry leaves its old item
        # behind, which is skipped when it surfaces because the live entry no longer expires then.
        self._expiry: list[tuple[float, int, Slot]] = []
        self._seq = itertools.count()
        self._hits = self._misses = self._evictions = self._expirations = self._rejected = self._bypassed = 0
        # Bounded so that a tier read only through peek() under lock contention cannot grow without limit;
        # a full buffer forgets its oldest reads (recency hints, never data).
        self._reads: collections.deque[Slot] = collections.deque(maxlen=_READ_BUFFER_MAX)
        # A lock-free hit is: ``entry = entries_get(slot)``, check it is live and not sliding, ``append(slot)``,
        # and once ``len(reads) >= READ_BUFFER_DRAIN`` call ``note_reads()``. ``peek`` does exactly that.
        self.hot_read = HotRead(self._entries.get, self._reads.append, self._reads, self._note_reads)
        self.peek = self._make_peek()

    # -- the request path's lock-free read ---------------------------------------------------------------

    def _make_peek(self) -> Callable[[Slot, float], Entry | None]:
        """``peek(slot, now)``: the live entry at ``slot = (ns, key)`` for a hit that needs no write, read
        without the lock; ``None`` means "ask ``get_many``" (absent, expired or sliding), not "absent". The
        slot is not validated here: the caller derived it, and a dict lookup on ``(ns, key)`` cannot reach
        another namespace. A closure over the tier's dict and read buffer (both live as long as the tier):
        it runs on every L1 hit, and locals are cheaper than attribute lookups. ``@cache_if``'s hit path
        inlines the same steps from ``hot_read`` (one Python call less on the path that matters most); the two
        must stay in step."""
        entries_get, append, reads, note_reads = self.hot_read

        def peek(slot: Slot, now: float) -> Entry | None:
            entry = entries_get(slot)
            if entry is None or entry.sliding_ttl is not None:
                return None
            expires_at = entry.expires_at
            if expires_at is not None and now >= expires_at:
                return None
            append(slot)
            if len(reads) >= _READ_BUFFER_DRAIN:
                note_reads()
            return entry

        return peek

    def _note_reads(self) -> None:
        """Apply the buffered reads to the policy when the lock is free; a reader never waits for it (the
        buffer is bounded and lossy, so skipping a drain costs recency hints, never data)."""
        lock = self._lock
        if lock.acquire(blocking=False):
            try:
                self._drain_reads()
            finally:
                lock.release()

    # -- the Tier interface ------------------------------------------------------------------------------

    def get_many(self, ns: Namespace, keys: Sequence[CacheKey]) -> list[Entry | None]:
        check_ns(ns)
        check_keys(keys)
        with self._lock:
            self._drain_reads()
            now = self._clock()
            return [self._get((ns, key), now) for key in keys]

    def set_many(self, ns: Namespace, items: Sequence[tuple[CacheKey, Entry]]) -> None:
        check_ns(ns)
        check_keys([key for key, _ in items])
        with self._lock:
            self._drain_reads()
            now = self._clock()
            for key, entry in items:
                self._set((ns, key), entry, now)

    def delete(self, ns: Namespace, keys: Sequence[CacheKey]) -> int:
        """Remove ``keys``; returns how many were present and live (an expired one counts as absent)."""
        check_ns(ns)
        check_keys(keys)
        with self._lock:
            self._drain_reads()
            now = self._clock()
            present = 0
            for key in keys:
                entry = self._entries.get((ns, key))
                if entry is None:
                    continue
                self._drop((ns, key))
                if entry.expired(now):
                    self._expirations += 1
                else:
                    present += 1
            return present

    def usage(self, ns: Namespace | None = None) -> int:
        """Bytes held (for ``ns``), expired entries not yet dropped included: they still hold the memory."""
        if ns is not None:
            check_ns(ns)
        with self._lock:
            return self._bytes if ns is None else self._ns_bytes.get(ns, 0)

    def close(self) -> None:
        """Drop every entry (the policy is told of each), then close the policy."""
        with self._lock:
            self._reads.clear()
            for slot in list(self._entries):
                self._drop(slot)
            self._expiry.clear()
        self._policy.close()

    def replace_policy(self, policy: EvictionPolicy) -> None:
        """Switch to another eviction policy (a new policy document named one). ``policy`` must be new; it is
        told of every held entry, oldest write first, before it makes its first choice."""
        if len(policy):
            raise ValueError(f"the {type(policy).__name__} already tracks {len(policy)} keys; give a new one")
        with self._lock:
            self._drain_reads()
            for slot, entry in self._entries.items():
                weight = self._weight(slot[0]) if self._weight is not None else 1.0
                info = EntryInfo(
                    size=_sizeof(slot, entry), ns=slot[0], saved_ms=entry.saved_ms, weight=weight, rule=entry.rule
                )
                policy.on_insert(slot, info)
            old, self._policy = self._policy, policy
        old.close()  # outside the lock: a learned policy's close waits for its trainer thread

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    # -- introspection -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self, ns: Namespace) -> list[CacheKey]:
        """The keys held in ``ns`` (expired ones not yet dropped included), oldest write first. O(entries)."""
        check_ns(ns)
        with self._lock:
            return [key for entry_ns, key in self._entries if entry_ns == ns]

    @property
    def stats(self) -> MemoryStats:
        with self._lock:
            self._drain_reads()
            return MemoryStats(
                self._hits, self._misses, self._evictions, self._expirations, self._rejected, self._bypassed
            )

    # -- internals (called with the lock held) -----------------------------------------------------------

    def _drain_reads(self) -> None:
        reads = self._reads
        if not reads:
            return
        # Copy then clear, each one C call (no iteration that a racing peek() could break); a hit appended
        # between the two is lost, which costs one recency hint (the buffer is lossy by design).
        batch = tuple(reads)
        reads.clear()
        entries = self._entries
        held = [slot for slot in batch if slot in entries]  # evicted or deleted since: nothing to tell
        self._hits += len(held)
        self._policy.on_hits(held)

    def _get(self, slot: Slot, now: float) -> Entry | None:
        entry = self._entries.get(slot)
        if entry is not None and entry.expired(now):
            self._drop(slot)
            self._expirations += 1
            entry = None
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        renewed = entry.renewed(now)
        if renewed is not entry:
            self._entries[slot] = renewed
            self._watch_expiry(slot, renewed)
        self._policy.on_hit(slot)
        return renewed

    def _set(self, slot: Slot, entry: Entry, now: float) -> None:
        if slot in self._entries:
            self._drop(slot)
        if entry.expired(now):
            return
        ns = slot[0]
        size = _sizeof(slot, entry)
        quota = self._quota(ns) if self._quota is not None else None
        if not self._admissible(size, quota):
            self._rejected += 1
            return
        weight = self._weight(ns) if self._weight is not None else 1.0
        info = EntryInfo(size=size, ns=ns, saved_ms=entry.saved_ms, weight=weight, rule=entry.rule)
        policy = self._policy
        # Only a policy that decides admission is asked (the base class admits everything).
        if type(policy).admit is not EvictionPolicy.admit and not policy.admit(slot, info):
            self._bypassed += 1
            return
        self._make_room(ns, size, quota, now)
        self._entries[slot] = entry
        self._bytes += size
        self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + size
        self._watch_expiry(slot, entry)
        policy.on_insert(slot, info)

    def _admissible(self, size: int, quota: int | None) -> bool:
        if size > self.capacity_bytes:
            return False
        if self.max_entry_bytes is not None and size > self.max_entry_bytes:
            return False
        return quota is None or size <= quota

    def _make_room(self, ns: Namespace, size: int, quota: int | None, now: float) -> None:
        if not self._over_quota(ns, size, quota) and self._bytes + size <= self.capacity_bytes:
            return  # the common case, on every write: no room to make
        self._drop_expired(now)
        while self._over_quota(ns, size, quota):
            self._evict(self._policy.victim(ns))
        while self._bytes + size > self.capacity_bytes:
            self._evict(self._policy.victim())

    def _over_quota(self, ns: Namespace, size: int, quota: int | None) -> bool:
        return quota is not None and self._ns_bytes.get(ns, 0) + size > quota

    def _evict(self, victim: Hashable) -> None:
        slot = cast(Slot, victim)
        assert slot in self._entries, f"the policy named {slot!r}, which the tier does not hold"
        self._drop(slot)
        self._evictions += 1

    def _drop(self, slot: Slot) -> None:
        entry = self._entries.pop(slot)
        size = _sizeof(slot, entry)
        self._bytes -= size
        left = self._ns_bytes[slot[0]] - size
        if left:
            self._ns_bytes[slot[0]] = left
        else:
            del self._ns_bytes[slot[0]]
        self._policy.on_remove(slot)

    def _watch_expiry(self, slot: Slot, entry: Entry) -> None:
        if entry.expires_at is None:
            return
        heapq.heappush(self._expiry, (entry.expires_at, next(self._seq), slot))
        if len(self._expiry) > 2 * len(self._entries) + 64:  # mostly stale items from renewals: start over
            self._expiry = [
                (e.expires_at, next(self._seq), s)
                for s, e in self._entries.items()
                if e.expires_at is not None
            ]
            heapq.heapify(self._expiry)

    def _drop_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, slot = heapq.heappop(self._expiry)
            entry = self._entries.get(slot)
            if entry is not None and entry.expired(now):
                self._drop(slot)
                self._expirations += 1


_READ_BUFFER_DRAIN = 64
READ_BUFFER_DRAIN = _READ_BUFFER_DRAIN  # for the inlined reader in controller/_cache_if.py
_READ_BUFFER_MAX = 16 * _READ_BUFFER_DRAIN


def _sizeof(slot: Slot, entry: Entry) -> int:
    return entry.size + len(slot[1])


def _check_bytes(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{label} must be >= 0, got {value}")
