"""Queue look-ahead: a base policy that is told which requests wait in the server's queue, and keeps their blocks.

A serving system knows the prompts of the requests it has accepted but not started: their KV blocks are needed
soon, and the order of the queue says which first. The owner tells the policy with ``on_queue(waiting)`` at
every service start (the replay does it from an honest queue model, ``replay._queue``); nothing later than the
moment of the call is ever told. Blocks a waiting request needs are *protected*: they are evicted only when no
other block is held, and then the one needed furthest in the visible queue first (Belady within the window the
queue shows). Every other block is ordered by the base policy. What it achieves on the Mooncake trace, and how
to reproduce it, is in docs/eviction.md, "Queue look-ahead".
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ._base import BuildContext, Clock, EntryInfo, EvictionPolicy
from ._lru import LRUPolicy


class QueuedRequest(NamedTuple):
    """A request waiting in the server's queue: its number (unique per request) and the cache keys of its
    blocks, in prefix order, as the owner keys them."""

    req: int
    keys: tuple[Hashable, ...]


class LookaheadPolicy(EvictionPolicy):
    """Keeps the blocks of waiting requests; evicts the rest by the ``base`` policy.

    ``base``: the policy that orders every unprotected block, new and not a look-ahead itself (default: an LRU
    sharing this policy's clock and rng). Built by name, ``make_eviction_policy("lookahead", base="learned")``,
    the base is any other registered policy, given the owner's capacity, background flag, clock and the same
    rng. ``admission`` (default on): with a ``capacity`` (the owner's, in its size unit), a missed key that no
    waiting request needs is not stored when every held key is protected (storing it would evict a block the
    queue shows is needed, for one it does not).

    The base policy holds exactly the unprotected keys and sees every notification about them, so with an
    empty queue (an owner that never calls ``on_queue``, or a lightly loaded server) this policy decides
    exactly as its base does (built by name, with the same rng). A key that becomes protected leaves the base;
    one that stops being protected (the last request waiting for it has started) re-enters it as a new
    insertion: that request accesses it at once, so for a recency base it lands where the access would put it
    anyway; a frequency base forgets the key's count.

    Costs: per ``on_queue``, O(queue length) to find the requests that left or arrived, plus O(blocks) of
    those; per eviction of a protected key, O(log protected) amortised. ``victim(ns)`` with a namespace and
    only protected keys in it scans them: O(held).
    """

    name = "lookahead"
    uses_context = True

    def __init__(
        self,
        *,
        base: EvictionPolicy | None = None,
        capacity: int | None = None,
        admission: bool = True,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if base is not None and not isinstance(base, EvictionPolicy):
            raise TypeError(f"base must be an EvictionPolicy, not {type(base).__name__} (by name: "
                            "make_eviction_policy('lookahead', base=NAME))")
        if isinstance(base, LookaheadPolicy):
            raise ValueError("base must be another policy, not a look-ahead itself")
        if base is not None and len(base):
            raise ValueError("base must be a new policy: it already tracks keys")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be an int >= 1 or None, got {capacity!r}")
        super().__init__(clock=clock, rng=rng)
        self.capacity = capacity
        self.admission = admission
        # The same rng, not a child of it: with an empty queue the base then draws exactly what it would alone.
        self.base = base if base is not None else LRUPolicy(clock=clock, rng=self.rng)
        self._held: dict[Hashable, EntryInfo] = {}
        self._used = 0
        # req -> (its rank in arrival order, its keys); needs: key -> {req: (rank, pos)} in arrival order, so
        # the first item is the key's earliest need in the visible queue.
        self._waiting: dict[int, tuple[int, tuple[Hashable, ...]]] = {}
        self._needs: dict[Hashable, dict[int, tuple[int, int]]] = {}
        self._rank = 0
        # Protected held keys, furthest need on top: (-rank, -pos, key). Stale entries (the key left, or its
        # earliest need changed) are dropped when they reach the top. (rank, pos) is unique per key: no tie
        # ever compares two keys.
        self._heap: list[tuple[int, int, Hashable]] = []
        self._bypassed = 0

    @classmethod
    def build(cls, context: BuildContext, *, base: str = "lru", **options: Any) -> EvictionPolicy:
        """``base`` by name: any other registered policy, built for the same owner with the same rng."""
        if base == cls.name:
            raise ValueError("base must be another policy, not 'lookahead' itself")
        return cls(base=context.build(base), capacity=context.capacity, clock=context.clock, rng=context.rng,
                   **options)

    @property
    def bypassed(self) -> int:
        """Misses not stored by admission."""
        return self._bypassed

    def protected(self, key: Hashable) -> bool:
        """Whether a waiting request needs ``key`` (held or not)."""
        return key in self._needs

    # -- the queue ------------------------------------------------------------------------------------------

    def on_queue(self, waiting: Sequence[QueuedRequest]) -> None:
        """The requests waiting now (arrived, not started), in queue order. Each call replaces the last: a
        request missing from it has started (or left); one not seen before has arrived. Raises
        ``ValueError`` for a request number given twice."""
        current = {w.req for w in waiting}
        if len(current) != len(waiting):
            raise ValueError("on_queue: a request number appears twice among the waiting requests")
        for req in [r for r in self._waiting if r not in current]:
            self._leave(req)
        for w in waiting:
            if w.req not in self._waiting:
                self._arrive(w)

    def _arrive(self, request: QueuedRequest) -> None:
        rank = self._rank
        self._rank += 1
        self._waiting[request.req] = (rank, request.keys)
        for pos, key in enumerate(request.keys):
            needs = self._needs.get(key)
            if needs is None:
                needs = self._needs[key] = {}
                if key in self._held:
                    self.base.on_remove(key)
                    heapq.heappush(self._heap, (-rank, -pos, key))
            needs.setdefault(request.req, (rank, pos))  # a key twice in one request: its first place counts

    def _leave(self, req: int) -> None:
        _, keys = self._waiting.pop(req)
        for key in keys:
            needs = self._needs.get(key)
            if needs is None or req not in needs:
                continue  # the key came twice in this request, and was handled at its first place
            first = next(iter(needs))
            del needs[req]
            held = key in self._held
            if not needs:
                del self._needs[key]
                if held:
                    self.base.on_insert(key, self._held[key])
            elif held and first == req:
                rank, pos = next(iter(needs.values()))
                heapq.heappush(self._heap, (-rank, -pos, key))

    # -- notifications --------------------------------------------------------------------------------------

    def on_access(self, key: Hashable, info: EntryInfo) -> None:
        self.base.on_access(key, info)

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        """Raises ``ValueError`` if ``key`` is held already (replacing is ``on_remove`` + ``on_insert``)."""
        if key in self._held:
            raise ValueError(f"{key!r} is already held; replace it with on_remove then on_insert")
        self._held[key] = info
        self._used += info.size
        needs = self._needs.get(key)
        if needs is None:
            self.base.on_insert(key, info)
        else:
            rank, pos = next(iter(needs.values()))
            heapq.heappush(self._heap, (-rank, -pos, key))

    def on_hit(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        if key not in self._held:
            raise KeyError(key)
        if key not in self._needs:
            self.base.on_hit(key)

    def on_remove(self, key: Hashable) -> None:
        """Raises ``KeyError`` if ``key`` is not held."""
        info = self._held.pop(key)
        self._used -= info.size
        if key not in self._needs:
            self.base.on_remove(key)
        # A protected key's heap entry goes stale and is dropped when it reaches the top.

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self.base.close()

    def __contains__(self, key: object) -> bool:
        return key in self._held

    # -- decisions ------------------------------------------------------------------------------------------

    def victim(self, ns: str | None = None) -> Hashable:
        if ns is None:
            if len(self.base):
                return self.base.victim()
            return self._furthest()
        try:
            return self.base.victim(ns)
        except KeyError:
            pass
        # Only protected keys in ns: the one needed furthest, by a scan (the heap is not split by namespace).
        candidates = [(next(iter(self._needs[k].values())), k) for k, info in self._held.items()
                      if info.ns == ns and k in self._needs]
        if not candidates:
            raise KeyError(f"no key held in namespace {ns!r}") from None
        return max(candidates, key=lambda c: c[0])[1]

    def _furthest(self) -> Hashable:
        heap, needs, held = self._heap, self._needs, self._held
        while heap:
            neg_rank, neg_pos, key = heap[0]
            need = needs.get(key)
            if key in held and need is not None and next(iter(need.values())) == (-neg_rank, -neg_pos):
                return key
            heapq.heappop(heap)
        raise KeyError("no key held")

    def admit(self, key: Hashable, info: EntryInfo) -> bool:
        """Bypass a ``key`` no waiting request needs when storing it would evict a protected one (every held
        key is protected); otherwise the base policy decides."""
        if (self.admission and self.capacity is not None and not len(self.base) and self._held
                and key not in self._needs and self._used + info.size > self.capacity):
            self._bypassed += 1
            return False
        return self.base.admit(key, info)
