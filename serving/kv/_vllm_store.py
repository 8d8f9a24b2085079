"""The blocks behind evocache's vLLM KV connector (``_vllm_connector``), without vLLM: its configuration, the
worker's block store and the scheduler's index of held blocks.

A block is what vLLM calls one: ``block_size`` tokens of every attention layer's keys and values, named by
vLLM's own chained block hash (which carries the request's ``cache_salt`` in its first block, so two tenants
share a block only when they share a salt). The worker keeps blocks in host memory (``DeviceBlocks`` on the
CPU: L1, bounded in bytes, ordered by an eviction class of the controller's registry, ``lru`` unless told
otherwise) and writes them through ``LowerTiers`` to the controller's L2 (Redis) and L3 (disk) tiers: signed
entries bound to a namespace and key, a geometry header checked on every read, nothing unpickled. The
namespace is ``model_namespace``: a digest of the model and of everything that makes vLLM's hashes and block
layout what they are, so blocks of another model, dtype or hash function are never looked up.

The scheduler never touches a tensor. ``HeldIndex`` is what it believes the store holds: the blocks the
worker reported stored (and not since dropped), and the blocks a probe of L2/L3 found (the tier checked
their signature; their payload is decoded only when the worker loads them). A belief can be stale (an
eviction the worker has not reported yet, an entry another process deleted): the worker's load then fails
for that block, vLLM is told, and recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evocache.controller import (
    BlockHash,
    DiskConfig,
    DiskTier,
    EntryInfo,
    RedisConfig,
    RedisTier,
    StoreConfig,
    StoreConfigError,
    Tier,
    TierError,
    entry_secret,
)

from ._hashing import BlockHasher
from ._lower import LOWER_TIERS, LowerTiers
from ._pool import Block, DeviceBlocks
from ._store import BlockGeometry

log = logging.getLogger("evocache.serving.kv.vllm")

MiB = 1 << 20
EVENTS = ("lookups", "matched_blocks", "probed_l2", "probed_l3", "loaded_l1", "loaded_l2", "loaded_l3",
          "load_errors", "stored", "evicted", "corrupt", "tier_faults", "tier_errors")
"""What the connector counts (``Counters``): numbers of blocks, but ``lookups`` (requests asked about)."""


class ConnectorConfig(BaseModel):
    """``kv_connector_extra_config``, validated once: ``l1_bytes`` of host memory for blocks, evicted by the
    registered policy ``eviction``; ``redis`` (L2) and ``disk`` (L3), the controller's own parts, each
    optional; ``layer_group`` layers per L2/L3 entry (0: a whole block in one); ``ttl_s`` of an L2/L3 entry;
    ``index_blocks``, the most blocks the scheduler's index remembers. The entries' secret comes from where
    ``controller._secret`` says (``redis.secret``, ``redis.secret_file``, ``$EVOCACHE_SECRET``, a key file in
    the disk tier's directory)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    l1_bytes: int = Field(256 * MiB, gt=0)
    eviction: str = "lru"
    redis: RedisConfig | None = None
    disk: DiskConfig | None = None
    layer_group: int = Field(0, ge=0)
    ttl_s: float = Field(7 * 24 * 3600.0, gt=0)
    index_blocks: int = Field(1 << 20, gt=0)

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> ConnectorConfig:
        """Validate ``data``; ``StoreConfigError`` naming each bad field as
        ``kv_connector_extra_config.<field>``."""
        try:
            return cls(**data)
        except ValidationError as exc:
            issues: list[str] = []
            for error in exc.errors():
                nested = error.get("ctx", {}).get("error")
                if isinstance(nested, StoreConfigError):  # a controller part named its own fields already
                    issues += [f"kv_connector_extra_config.{issue}" for issue in nested.issues]
                else:
                    place = ".".join(map(str, error["loc"]))
                    issues.append(f"kv_connector_extra_config.{place}: "
                                  f"{error['msg'].removeprefix('Value error, ')}")
            raise StoreConfigError("invalid evocache connector configuration: " + "; ".join(issues),
                                   issues) from None

    def secret(self) -> bytes:
        return entry_secret(StoreConfig(redis=self.redis, disk=self.disk))


def model_namespace(identity: Mapping[str, str]) -> str:
    """The tier namespace of one model's blocks: a digest of ``identity`` (model, revision, dtype, hash
    function, block sizes, layout: whatever changes a block's hash or bytes)."""
    data = json.dumps(dict(sorted(identity.items())), separators=(",", ":")).encode()
    return "vllm-" + hashlib.blake2b(data, digest_size=12, person=b"evocache.vllm").hexdigest()


class Counters:
    """Block counts by event (``EVENTS``), thread-safe; ``take`` hands over what was counted since the last
    call (vLLM sums the deltas into its metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, event: str, n: int = 1) -> None:
        assert event in EVENTS, event
        if n:
            with self._lock:
                self._counts[event] = self._counts.get(event, 0) + n

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


def build_tiers(config: ConnectorConfig, counters: Counters) -> dict[str, Tier]:
    """The L2/L3 tiers ``config`` names, signing with its secret; a payload a tier drops for failing its
    signature is counted as ``tier_faults``."""
    if config.redis is None and config.disk is None:
        return {}
    secret = config.secret()

    def fault(tier: str, kind: str) -> None:
        counters.add("tier_faults")
        log.warning("KV %s: a %s entry dropped", tier, kind)

    tiers: dict[str, Tier] = {}
    if config.redis is not None:
        r = config.redis
        tiers["l2"] = RedisTier(r.url, secret=secret, prefix=r.prefix, socket_timeout=r.timeout_s,
                                connect_timeout=r.timeout_s, retry_after=r.retry_after_s, on_fault=fault)
    if config.disk is not None:
        tiers["l3"] = DiskTier(config.disk.path, size_limit=config.disk.bytes, secret=secret, on_fault=fault)
    return tiers


# -- the worker's side ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loaded:
    """The leading blocks of a chain the store had (``blocks``, each with the tier it came from in
    ``tiers``); the chain's blocks after them are not loaded."""

    blocks: tuple[Block, ...]
    tiers: tuple[str, ...]


class BlockStore:
    """The worker's blocks: L1 in host memory (``DeviceBlocks``) over ``tiers`` (L2/L3, through
    ``LowerTiers``), under ``namespace``. ``put`` keeps blocks in L1 and has them written below on the
    writer thread; ``load`` walks a chain through L1, then L2/L3 (promoting what it finds into L1).
    ``take_report`` says what changed for the scheduler's index since the last call: the blocks stored, and
    those L1 evicted that no lower tier keeps."""

    def __init__(self, config: ConnectorConfig, geometry: BlockGeometry, namespace: str,
                 tiers: Mapping[str, Tier], counters: Counters) -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.counters = counters
        self.lower = LowerTiers(dict(tiers), geometry, layer_group=config.layer_group, ttl_s=config.ttl_s,
                                device="cpu")
        self.l1 = DeviceBlocks(config.l1_bytes, geometry.block_bytes(), config.eviction,
                               on_evict=self._evicted)
        self._report_lock = threading.Lock()
        self._stored: list[BlockHash] = []
        self._dropped: list[BlockHash] = []
        self._seen_corrupt = 0
        self._seen_errors = 0

    def _evicted(self, key: Hashable) -> None:
        self.counters.add("evicted")
        if not self.lower:  # with L2/L3 the block is still held there (its write was queued when stored)
            with self._report_lock:
                self._dropped.append(BlockHash(key))  # type: ignore[arg-type]

    def put(self, items: Sequence[tuple[BlockHash, Block]], now: float | None = None) -> None:
        """Hold ``items`` in L1 and queue their L2/L3 writes; returns before the writes are done."""
        info = EntryInfo(size=self.geometry.block_bytes(), ns=self.namespace)
        kept = [h for h, block in items if self.l1.put(h, block, info)]
        self.lower.write(self.namespace, LOWER_TIERS, items, time.time() if now is None else now)
        self.counters.add("stored", len(items))
        with self._report_lock:
            self._stored += kept if not self.lower else [h for h, _ in items]

    def load(self, hashes: Sequence[BlockHash]) -> Loaded:
        """The leading blocks of ``hashes`` that L1, L2 or L3 hold and that pass the checks; a payload that
        fails them is deleted from its tier and counted (``corrupt``)."""
        blocks: list[Block] = []
        for h in hashes:
            block = self.l1.get(h)
            if block is None:
                break
            blocks.append(block)
        tiers = ["l1"] * len(blocks)
        rest = hashes[len(blocks):]
        if rest and self.lower:
            read = self.lower.read(self.namespace, LOWER_TIERS, rest)
            info = EntryInfo(size=self.geometry.block_bytes(), ns=self.namespace)
            for h, block in zip(rest, read.blocks, strict=False):
                self.l1.put(h, block, info)
            blocks += read.blocks
            tiers += read.tiers
            self._count_lower()
        for tier in tiers:
            self.counters.add(f"loaded_{tier}")
        return Loaded(tuple(blocks), tuple(tiers))

    def _count_lower(self) -> None:
        corrupt, errors = self.lower.corrupt, self.lower.errors
        self.counters.add("corrupt", corrupt - self._seen_corrupt)
        self.counters.add("tier_errors", errors - self._seen_errors)
        self._seen_corrupt, self._seen_errors = corrupt, errors

    def take_report(self) -> tuple[tuple[BlockHash, ...], tuple[BlockHash, ...]]:
        """(blocks stored, blocks dropped) since the last call."""
        self._count_lower()
        with self._report_lock:
            stored, dropped = tuple(self._stored), tuple(self._dropped)
            self._stored, self._dropped = [], []
        return stored, dropped

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every block stored so far is written to L2/L3 (or failed there)."""
        self.lower.flush(timeout)

    def close(self) -> None:
        self.lower.close()


# -- the scheduler's side ------------------------------------------------------------------------------------


class TierProbe:
    """Which leading blocks of a chain L2, then L3, hold under ``namespace``: one batched read per tier for
    the blocks the tiers before it lacked, stopping at the first missing block (as ``LowerTiers.read``). A
    read checks each entry's signature (a tier drops a bad one: a miss); the payload is not decoded here.
    A tier that fails is a miss, counted as ``tier_errors``."""

    def __init__(self, tiers: Mapping[str, Tier], geometry_groups: Sequence[tuple[int, int]], namespace: str,
                 counters: Counters) -> None:
        self.tiers = [(name, tiers[name]) for name in LOWER_TIERS if name in tiers]
        self.groups = list(geometry_groups)
        self.namespace = namespace
        self.counters = counters

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def leading(self, hashes: Sequence[BlockHash]) -> list[str]:
        """The tier of each leading block of ``hashes`` found (as many as were found, in order)."""
        found: list[str] = []
        pending = list(hashes)
        for name, tier in self.tiers:
            if not pending:
                break
            keys = [BlockHasher.tier_key(h, g) for h in pending for g in self.groups]
            try:
                entries = tier.get_many(self.namespace, keys)
            except TierError as exc:
                self.counters.add("tier_errors")
                log.info("KV %s probe failed (a miss): %s", name, exc)
                continue
            taken = 0
            for i in range(len(pending)):
                if any(e is None for e in entries[i * len(self.groups):(i + 1) * len(self.groups)]):
                    break
                taken += 1
            found += [name] * taken
            self.counters.add(f"probed_{name}", taken)
            # A block missing here may sit in the next tier: look there from where this tier stopped.
            pending = pending[taken:]
        return found


class HeldIndex:
    """The scheduler's belief of which blocks the store holds, at most ``capacity`` of them (the least
    recently matched forgotten first): what the worker reported stored, and what ``probe`` (L2/L3) found.
    ``run`` answers how many leading blocks of a chain are held; it adds what the probe found, which changes
    no later answer but saves the next probe."""

    def __init__(self, capacity: int, probe: TierProbe | None = None) -> None:
        self.capacity = capacity
        self.probe = probe
        self._held: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, block: object) -> bool:
        with self._lock:
            return block in self._held

    def __len__(self) -> int:
        return len(self._held)

    def add(self, blocks: Sequence[BlockHash]) -> None:
        with self._lock:
            for block in blocks:
                self._held[bytes(block)] = None
                self._held.move_to_end(bytes(block))
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)

    def discard(self, blocks: Sequence[BlockHash]) -> None:
        with self._lock:
            for block in blocks:
                self._held.pop(bytes(block), None)

    def run(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` are held: those the index knows, then those the probe
        finds after them."""
        with self._lock:
            known = 0
            for h in hashes:
                if bytes(h) not in self._held:
                    break
                self._held.move_to_end(bytes(h))
                known += 1
        if known == len(hashes) or not self.probe:
            return known
        found = self.probe.leading(hashes[known:])
        self.add(hashes[known:known + len(found)])
        return known + len(found)
