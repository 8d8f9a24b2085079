"""Where prompt prefixes live, without Ray: what a replica served and what a router knows of its replicas.

A request carries the chained hashes of its prompt's full blocks (``evocache.controller.block_hashes``, the
tenant namespace salting the first block). The hash of block ``i`` names the whole prefix through block ``i``,
so one recorded hash vouches for every shallower depth too. Both sides therefore record a request only at its
checkpoint depths (``checkpoints``: blocks 0, 1, 3, 7, ... and the last one): a record costs O(log blocks)
instead of O(blocks), and memory and reports are bounded by how many requests they cover, not by prompt
length. Recording the last block means a continuation of a served prompt (the next turn of a conversation)
matches that prompt in full; any other match is found at the deepest checkpoint it reaches.

* ``BlockLedger``: kept by each model replica; ``served(blocks)`` after a request, ``stats(queue_len)`` for
  the deployment's ``record_routing_stats`` (a small JSON-friendly dict that Ray sends to every router).
* ``parse_report``: reads such a dict back; the router's only way in, so the wire format lives in one module.
* ``AffinityIndex``: a router's view: what it routed itself (fresh) and what replicas reported (stale);
  ``holders(blocks, candidates)`` ranks the candidates holding the longest leading run of ``blocks``.
* ``rendezvous_order``: highest-random-weight hashing, so independent routers agree on a fresh prefix's home.

Replicas are named by ``str`` (Ray's replica unique id): the names are what routers hash and compare.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from evocache.controller import BlockHash

BLOCK_HASH_BYTES = 32
STATS_BLOCKS = "blocks"  # the report's keys, read by parse_report
STATS_QUEUE = "queue"
MAX_REPORT_BLOCKS = 4096  # a report holding more is refused: it reaches every router every period
_RENDEZVOUS_PERSON = b"evocache.rdv1"


def checkpoints(n_blocks: int) -> Iterator[int]:
    """The block indices recorded for a prompt of ``n_blocks`` full blocks: 0, 1, 3, 7, ... below
    ``n_blocks``, then ``n_blocks - 1`` (ascending, no repeats; nothing for an empty prompt)."""
    i = 0
    while i < n_blocks - 1:
        yield i
        i = 2 * i + 1
    if n_blocks:
        yield n_blocks - 1


def _checked(blocks: Sequence[bytes], where: str) -> Sequence[bytes]:
    if not isinstance(blocks, tuple | list):
        raise TypeError(f"{where}: blocks must be a tuple of block hashes, got {type(blocks).__qualname__}")
    for i in checkpoints(len(blocks)):
        block = blocks[i]
        if not isinstance(block, bytes) or len(block) != BLOCK_HASH_BYTES:
            raise TypeError(f"{where}: blocks[{i}] must be {BLOCK_HASH_BYTES} bytes, got {block!r:.60}")
    return blocks


class BlockLedger:
    """The block hashes a replica served most recently, bounded to ``capacity_blocks`` hashes.

    Thread-safe: a replica may serve requests from several threads while Ray asks for ``stats``.
    """

    def __init__(self, capacity_blocks: int = 256) -> None:
        if type(capacity_blocks) is not int or not 1 <= capacity_blocks <= MAX_REPORT_BLOCKS:
            raise ValueError(
                f"capacity_blocks must be an int in [1, {MAX_REPORT_BLOCKS}], got {capacity_blocks!r}"
            )
        self._capacity = capacity_blocks
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def served(self, blocks: Sequence[BlockHash]) -> None:
        """Record a served request's block hashes. Raises ``TypeError`` when they are not 32-byte hashes."""
        _checked(blocks, "BlockLedger.served")
        with self._lock:
            # Deepest first: the leading blocks (shared by the most prompts) end newest, so are evicted last.
            for i in reversed(list(checkpoints(len(blocks)))):
                self._recent[blocks[i]] = None
                self._recent.move_to_end(blocks[i])
            while len(self._recent) > self._capacity:
                self._recent.popitem(last=False)

    def stats(self, queue_len: int) -> dict[str, object]:
        """The report for ``record_routing_stats``: ``{"blocks": [hex, newest first], "queue": queue_len}``.
        """
        if type(queue_len) is not int or queue_len < 0:
            raise ValueError(f"queue_len must be an int >= 0, got {queue_len!r}")
        with self._lock:
            hexes = [block.hex() for block in reversed(self._recent)]
        return {STATS_BLOCKS: hexes, STATS_QUEUE: queue_len}

    def __len__(self) -> int:
        return len(self._recent)


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's report read back: the block hashes it served recently and its queue length then."""

    blocks: frozenset[bytes]
    queue: int | None


def parse_report(stats: object) -> ReplicaReport:
    """Read a replica's routing stats (``BlockLedger.stats``). An empty dict (a replica that has not reported
    yet) is an empty report. Raises ``ValueError`` naming the field when the stats are malformed."""
    if not isinstance(stats, Mapping):
        raise ValueError(f"routing stats must be a dict, got {type(stats).__qualname__}")
    hexes = stats.get(STATS_BLOCKS, [])
    if not isinstance(hexes, list | tuple):
        raise ValueError(f"routing stats {STATS_BLOCKS!r} must be a list of hex strings")
    if len(hexes) > MAX_REPORT_BLOCKS:
        raise ValueError(
            f"routing stats {STATS_BLOCKS!r} holds {len(hexes)} hashes, more than {MAX_REPORT_BLOCKS}"
        )
    blocks = set()
    for i, text in enumerate(hexes):
        if not isinstance(text, str) or len(text) != 2 * BLOCK_HASH_BYTES:
            raise ValueError(f"routing stats {STATS_BLOCKS}[{i}] must be {2 * BLOCK_HASH_BYTES} hex digits")
        try:
            blocks.add(bytes.fromhex(text))
        except ValueError:
            raise ValueError(f"routing stats {STATS_BLOCKS}[{i}] is not hex: {text!r}") from None
    queue = stats.get(STATS_QUEUE)
    if queue is not None and (type(queue) is not int or queue < 0):
        raise ValueError(f"routing stats {STATS_QUEUE!r} must be an int >= 0, got {queue!r}")
    return ReplicaReport(frozenset(blocks), queue)


def rendezvous_order(key: bytes, replicas: Iterable[str]) -> list[str]:
    """``replicas`` by descending highest-random-weight score for ``key``: the same order in every process
    for the same names, and removing a replica moves only the keys it was first for."""

    def weight(name: str) -> tuple[bytes, str]:
        data = key + b"\x00" + name.encode("utf-8")
        return hashlib.blake2b(data, digest_size=8, person=_RENDEZVOUS_PERSON).digest(), name

    return sorted(replicas, key=weight, reverse=True)


class AffinityIndex:
    """A router's view of which replica holds which prefix.

    Two sources, one lookup: what this router itself routed (fresh, ranked by a routing tick, bounded to
    ``capacity_blocks`` (hash, replica) pairs, least recently routed dropped first) and what each replica last
    reported (replaced whole on each report). Not thread-safe: a router uses it from its event loop only.
    """

    def __init__(self, capacity_blocks: int = 65536) -> None:
        if type(capacity_blocks) is not int or capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
        self._capacity = capacity_blocks
        self._tick = 0
        # Instead of one dict per replica: a lookup is one dict probe per block, whatever the replica count.
        self._routed: dict[bytes, dict[str, int]] = {}  # hash -> replica -> tick of its latest routing
        self._routed_order: OrderedDict[tuple[bytes, str], None] = OrderedDict()  # least recent first
        self._routed_by_replica: dict[str, set[bytes]] = {}  # so forgetting a replica touches its pairs only
        self._reported: dict[bytes, set[str]] = {}  # hash -> replicas whose latest report holds it
        self._reports: dict[str, frozenset[bytes]] = {}

    def routed(self, replica: str, blocks: Sequence[bytes]) -> None:
        """Record that ``blocks`` were just routed to ``replica``."""
        self._tick += 1
        mine = self._routed_by_replica.setdefault(replica, set())
        for i in reversed(list(checkpoints(len(blocks)))):  # leading blocks newest, as in BlockLedger
            block = blocks[i]
            self._routed.setdefault(block, {})[replica] = self._tick
            mine.add(block)
            pair = (block, replica)
            self._routed_order[pair] = None
            self._routed_order.move_to_end(pair)
        while len(self._routed_order) > self._capacity:
            (block, owner), _ = self._routed_order.popitem(last=False)
            self._drop_routed(block, owner)
            self._routed_by_replica[owner].discard(block)

    def _drop_routed(self, block: bytes, replica: str) -> None:
        holders = self._routed[block]
        del holders[replica]
        if not holders:
            del self._routed[block]

    def reported(self, replica: str, blocks: frozenset[bytes]) -> None:
        """Replace ``replica``'s report with ``blocks`` (work in proportion to what changed)."""
        old = self._reports.get(replica, frozenset())
        if old == blocks:
            return
        for block in old - blocks:
            self._unreport(block, replica)
        for block in blocks - old:
            self._reported.setdefault(block, set()).add(replica)
        self._reports[replica] = blocks

    def _unreport(self, block: bytes, replica: str) -> None:
        holders = self._reported[block]
        holders.discard(replica)
        if not holders:
            del self._reported[block]

    def forget(self, replica: str) -> None:
        """Drop everything known of ``replica`` (it died or left the deployment)."""
        for block in self._routed_by_replica.pop(replica, ()):
            self._drop_routed(block, replica)
            del self._routed_order[(block, replica)]
        for block in self._reports.pop(replica, ()):
            self._unreport(block, replica)

    def retain(self, replicas: Collection[str]) -> None:
        """Forget every replica not in ``replicas``."""
        for replica in set(self._routed_by_replica) | set(self._reports):
            if replica not in replicas:
                self.forget(replica)

    def holders(self, blocks: Sequence[bytes], candidates: Collection[str]) -> tuple[int, list[str]]:
        """``(depth, ranked)``: the most blocks of ``blocks``' leading run that any candidate holds, and the
        candidates holding that many: those this router routed it to, most recent first, then those that only
        reported it, in rendezvous order of the first block. ``(0, [])`` when no candidate holds any."""
        for i in range(len(blocks) - 1, -1, -1):  # the first hit from the end is the deepest
            block = blocks[i]
            routed = self._routed.get(block)
            reported = self._reported.get(block)
            if routed is None and reported is None:
                continue
            routed = routed or {}
            fresh = sorted((r for r in routed if r in candidates), key=routed.__getitem__, reverse=True)
            stale = [r for r in reported or () if r in candidates and r not in routed]
            if fresh or stale:
                return i + 1, fresh + rendezvous_order(blocks[0], stale)
        return 0, []

    def __len__(self) -> int:
        """The (hash, replica) pairs this router remembers routing."""
        return len(self._routed_order)
