"""L1: a replica's KV blocks as tensors on the model's device, and what the cache remembers about blocks.

The pool holds blocks up to a byte bound, ordered by one of the controller's eviction policies
(``make_eviction_policy``: the same classes the replay simulator runs). Beside the blocks it keeps what only
it can answer, each bounded: which requests wait for the model and the blocks each needs (told to a
queue-aware policy, the look-ahead, at every change), the blocks stored since the replica started (``seen``),
those it evicted, those a lower tier held but that failed the cache's checks (``refused``, until stored
again), the tier each prefetched block came from, and how often each block was accessed in the current
reuse-rate window. From these ``why`` names a missed block's reason, from the request's own salted hash alone:
nothing here is indexed across namespaces.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from evocache.controller import EntryInfo, make_eviction_policy
from evocache.controller.eviction import LookaheadPolicy, QueuedRequest

MEMORY = 65_536  # entries each bounded bookkeeping map keeps (blocks seen, refused, evicted, prefetched)
_WINDOW = 1 << 20  # accessed blocks a reuse-rate window keeps when nobody closes it

Block = tuple  # one block: a (keys, values) pair of tensors per layer, or a ``ChunkBlock``


class DeviceBlocks:
    """L1: blocks as tensors on the model's device, at most ``capacity_bytes``, evicted by ``policy`` (a name
    of the controller's eviction registry, e.g. ``lru`` or ``lookahead``; ``lookahead:learned`` is the
    look-ahead over another base), with the bookkeeping of the module docstring. Thread-safe: one lock guards
    the blocks, the policy and the bookkeeping. ``on_evict`` is told each key the policy evicts (under the
    lock: it must not call back into the pool), for an owner that mirrors what L1 holds elsewhere."""

    def __init__(self, capacity_bytes: int, block_bytes: int, policy: str = "lru",
                 on_evict: Callable[[Hashable], None] | None = None) -> None:
        if capacity_bytes < block_bytes:
            raise ValueError(f"KV L1 of {capacity_bytes} bytes cannot hold one block of {block_bytes}")
        self.capacity = capacity_bytes
        self.block_bytes = block_bytes
        name, _, base = policy.partition(":")  # "lookahead:learned": the look-ahead over another policy
        options = {"base": base} if base else {}
        self.policy = make_eviction_policy(name, capacity=capacity_bytes, **options)
        self._on_evict = on_evict
        self._blocks: dict[Hashable, Block] = {}
        self._lock = threading.Lock()
        self.used = 0
        self.evictions = 0
        self.evicted: set[Hashable] = set()  # for the "evicted" miss reason
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._refused: OrderedDict[Hashable, None] = OrderedDict()
        self._origin: dict[Hashable, str] = {}  # a block the prefetch put here -> the tier it came from
        self._waiting: dict[int, tuple[Hashable, ...]] = {}
        self._tickets = 0
        self.accessed: dict[Hashable, int] = {}  # accesses per block in the current window

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: Hashable) -> Block | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self.policy.on_hit(key)
            return block

    def put(self, key: Hashable, block: Block, info: EntryInfo) -> bool:
        """Hold ``block`` (evicting others as the policy says); False when the policy does not admit it."""
        with self._lock:
            if key in self._blocks:
                self.policy.on_hit(key)
                return True
            if self.used + self.block_bytes > self.capacity and not self.policy.admit(key, info):
                return False
            while self.used + self.block_bytes > self.capacity and self._blocks:
                victim = self.policy.victim()
                self._blocks.pop(victim, None)
                self.policy.on_remove(victim)
                self.used -= self.block_bytes
                self.evictions += 1
                if len(self.evicted) > MEMORY:
                    self.evicted.clear()
                self.evicted.add(victim)
                if self._on_evict is not None:
                    self._on_evict(victim)
            self._blocks[key] = block
            self.used += self.block_bytes
            self.policy.on_insert(key, info)
            self.evicted.discard(key)
            return True

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._blocks)

    # -- the queue -----------------------------------------------------------------------------------------

    def enqueue(self, keys: Sequence[Hashable]) -> int:
        """Register a request that waits for the model and the blocks it needs, in prefix order; returns its
        ticket for ``dequeue``."""
        with self._lock:
            self._tickets += 1
            self._waiting[self._tickets] = tuple(keys)
            self._tell_queue()
            return self._tickets

    def dequeue(self, ticket: int) -> None:
        """The request of ``ticket`` has the model (or left): it no longer waits."""
        with self._lock:
            self._waiting.pop(ticket, None)
            self._tell_queue()

    def _tell_queue(self) -> None:
        # Only the look-ahead orders blocks by the queue; every other policy has no use for it.
        if isinstance(self.policy, LookaheadPolicy):
            self.policy.on_queue([QueuedRequest(r, keys) for r, keys in self._waiting.items()])

    # -- what the cache remembers about blocks -------------------------------------------------------------

    def stored(self, key: Hashable) -> None:
        """``key`` was stored (in L1 or a lower tier): a later miss on it is ``evicted``, no longer
        ``corrupt``."""
        with self._lock:
            self._seen[key] = None
            self._refused.pop(key, None)
            if len(self._seen) > MEMORY:
                self._seen.popitem(last=False)

    def refuse(self, key: Hashable) -> None:
        """A lower tier's copy of ``key`` failed the cache's checks and was dropped."""
        with self._lock:
            self._refused[key] = None
            if len(self._refused) > MEMORY:
                self._refused.popitem(last=False)

    def prefetched(self, key: Hashable, tier: str) -> None:
        """The prefetch put ``key`` here from ``tier``: the request that uses it counts it for that tier."""
        with self._lock:
            self._origin[key] = tier
            if len(self._origin) > MEMORY:
                self._origin.clear()

    def origin(self, key: Hashable) -> str:
        """The tier a found block counts for: where the prefetch read it from (once per prefetch), else
        ``l1``."""
        with self._lock:
            return self._origin.pop(key, "l1")

    def why(self, key: Hashable) -> str:
        """Why ``key`` missed, from this salted block alone: nothing another namespace stored enters."""
        with self._lock:
            if key in self._refused:
                return "corrupt"
            if key in self.evicted:
                return "evicted"
            if key not in self._seen:
                return "never-seen"
            return "evicted"

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Count an access of each of ``keys`` in the current reuse-rate window."""
        with self._lock:
            if len(self.accessed) > _WINDOW:  # nobody reads the window: keep it bounded
                self.accessed.clear()
            for key in keys:
                self.accessed[key] = self.accessed.get(key, 0) + 1

    def reuse_rate(self) -> float:
        """The share of blocks accessed more than once among those accessed since the last call (the KV reuse
        rate of the window); resets the window."""
        with self._lock:
            counts, self.accessed = self.accessed, {}
        if not counts:
            return 0.0
        return sum(1 for c in counts.values() if c > 1) / len(counts)
