"""The KV cache's lower tiers: blocks read from L2 (Redis) and L3 (disk) with the cache's checks, and written by
one writer thread.

A read walks a chain of block hashes through L2, then L3: one batched ``get_many`` per tier for the blocks the
tiers before it did not have, stopping at the first block the tier lacks (its later blocks would be of no use
before it). Every payload is decoded against this model's geometry (``_store.decode_group``; a chunk block's
layer groups must also agree on its position): one that fails is a ``CorruptBlock``, deleted from its tier,
counted (``corrupt``), logged and named in the read's ``refused``; the chain then goes on in the next tier. A
tier that fails (``TierError``) is a miss there, counted in ``errors`` and logged.

Writes, of prefix blocks and chunk blocks alike, go to one writer thread in the order they were stored, so a
request never waits for Redis or the disk and ``flush`` waits for all of them; a tier that fails a write is
counted in ``errors`` and logged, and the blocks are not stored there.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from evocache.controller import BlockHash, Entry, TierError

from ._chunks import ChunkBlock, decode_chunk_group, encode_chunk_group
from ._hashing import BlockHasher
from ._pool import Block
from ._store import BlockGeometry, CorruptBlock, decode_group, encode_group, layer_groups

log = logging.getLogger("evocache.serving.kv")

LOWER_TIERS = ("l2", "l3")


@dataclass(frozen=True, slots=True)
class LowerRead:
    """What a read found: the leading ``blocks`` of the chain asked for, the tier each came from (``tiers``),
    and the blocks dropped for failing the cache's checks (``refused``)."""

    blocks: tuple[Block, ...]
    tiers: tuple[str, ...]
    refused: tuple[BlockHash, ...]


class LowerTiers:
    """The ``l2``/``l3`` of ``tiers`` (controller tiers: the replica's own, shared with its response cache) as
    the KV cache reads and writes them: ``layer_group`` layers per entry (0: all), each entry living ``ttl_s``;
    decoded blocks are put on ``device``."""

    def __init__(self, tiers: dict[str, Any], geometry: BlockGeometry, *, layer_group: int, ttl_s: float,
                 device: Any) -> None:
        self.tiers = {name: tiers[name] for name in LOWER_TIERS if name in tiers}
        self.geometry = geometry
        self.groups = layer_groups(geometry, layer_group)
        self.ttl_s = ttl_s
        self.device = device
        self.errors = 0  # reads and writes lost to a failing tier
        self.corrupt = 0  # blocks dropped for failing the cache's checks
        self._count = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evocache-kv-write")
        self._pending: list[concurrent.futures.Future[None]] = []
        self._pending_lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def allowed(self, names: Sequence[str]) -> list[tuple[str, Any]]:
        """The tiers among ``names`` (a plan's) this replica has, L2 first."""
        return [(name, tier) for name, tier in self.tiers.items() if name in names]

    # -- reads ---------------------------------------------------------------------------------------------

    def read(self, salt: str, names: Sequence[str], hashes: Sequence[BlockHash],
             chunk: bool = False) -> LowerRead:
        """The leading blocks of ``hashes`` that the tiers among ``names`` hold, under the namespace ``salt``,
        L2 then L3 (see the module docstring). ``chunk``: the blocks are ``ChunkBlock``s."""
        found: list[Block] = []
        origins: list[str] = []
        refused: list[BlockHash] = []
        pending = list(hashes)
        for name, tier in self.allowed(names):
            if not pending:
                break
            keys = [BlockHasher.tier_key(h, g) for h in pending for g in self.groups]
            try:
                entries = tier.get_many(salt, keys)
            except TierError as exc:
                self._error()
                log.info("KV %s read failed (a miss): %s", name, exc)
                continue
            taken = 0
            for i, h in enumerate(pending):
                parts = entries[i * len(self.groups) : (i + 1) * len(self.groups)]
                if any(e is None for e in parts):
                    break
                try:
                    block = self._decode(parts, chunk)
                except CorruptBlock as exc:
                    self._drop(salt, name, tier, h, exc)
                    refused.append(h)
                    break
                found.append(block)
                origins.append(name)
                taken += 1
            # A block missing here may sit in the next tier: look there from where this tier stopped.
            pending = pending[taken:]
        return LowerRead(tuple(found), tuple(origins), tuple(refused))

    def _decode(self, parts: Sequence[Any], chunk: bool) -> Block:
        if not chunk:
            layers: list[Any] = []
            for (a, b), entry in zip(self.groups, parts, strict=True):
                layers += decode_group(entry.value, self.geometry, a, b, self.device)
            return tuple(layers)
        positions, layers = set(), []
        for (a, b), entry in zip(self.groups, parts, strict=True):
            position, group = decode_chunk_group(entry.value, self.geometry, a, b, self.device)
            positions.add(position)
            layers += group
        if len(positions) != 1:
            raise CorruptBlock(f"KV chunk block whose layer groups disagree on its position: "
                               f"{sorted(positions)}")
        return ChunkBlock(tuple(layers), positions.pop())

    def _drop(self, salt: str, name: str, tier: Any, block: BlockHash, exc: CorruptBlock) -> None:
        with self._count:
            self.corrupt += 1
        log.warning("KV block %s in %s dropped: %s", bytes(block).hex()[:12], name, exc)
        try:
            tier.delete(salt, [BlockHasher.tier_key(block, g) for g in self.groups])
        except TierError:
            pass  # the read already refused it; the entry expires with its ttl

    def _error(self) -> None:
        with self._count:
            self.errors += 1

    # -- writes --------------------------------------------------------------------------------------------

    def write(self, salt: str, names: Sequence[str], blocks: Sequence[tuple[BlockHash, Block]],
              now: float) -> None:
        """Write ``blocks`` (prefix blocks and ``ChunkBlock``s, each under its hash) to the tiers among
        ``names`` on the writer thread, as stored at ``now``; returns at once."""
        tiers = self.allowed(names)
        if not blocks or not tiers:
            return
        future = self._writer.submit(self._write, salt, tiers, list(blocks), now)
        with self._pending_lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)

    def _write(self, salt: str, tiers: list[tuple[str, Any]], blocks: list[tuple[BlockHash, Block]],
               now: float) -> None:
        expires = now + self.ttl_s
        for h, block in blocks:
            items = [(BlockHasher.tier_key(h, (a, b)), Entry(self._encode(block, a, b), expires, now, "kv"))
                     for a, b in self.groups]
            for name, tier in tiers:
                try:
                    tier.set_many(salt, items)
                except TierError as exc:
                    self._error()
                    log.info("KV %s write failed (not stored): %s", name, exc)

    def _encode(self, block: Block, a: int, b: int) -> bytes:
        if isinstance(block, ChunkBlock):
            return encode_chunk_group(block, self.geometry, a, b)
        return encode_group(block[a:b], self.geometry, a)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every block written so far is in its tiers (or failed there)."""
        with self._pending_lock:
            pending = list(self._pending)
        for future in pending:
            future.result(timeout)

    def close(self) -> None:
        """Finish the writes submitted so far, then stop the writer."""
        self._writer.shutdown(wait=True)
