"""The KV prefix cache of one replica: find a prompt's longest cached prefix, build a fresh ``DynamicCache`` from
its blocks, and keep the new full blocks after the model ran the rest.

A prompt's tokens are cut into blocks of ``block_size`` (full blocks only); block ``i``'s hash chains its
parent's, its tokens and the extra keys (model id and revision, dtype, adapter), and block 0 is salted with the
tenant namespace (``controller.block_hashes``), so no block is ever shared across tenants unless the rule
declares its prefixes shared (``kv: {shared_prefixes: true}``: a salt common to all tenants). A lookup walks the
chain in order and stops at the first block it cannot find: L1 (tensors on the model's device), then L2 and L3
(one batched read per tier for the rest of the chain; what they hold is promoted into L1). The model then runs
only on the remaining tokens, its positions continuing from the cached length; at least the last prompt token
is always computed, so the first generated token has its logits. Greedy decoding with the cache gives the
tokens it gives without (``tests/test_kv_cache.py``).

Why a block missed is kept per request (``KvUsage.miss``): ``never-seen``, ``evicted`` (from L1 and in no lower
tier), ``partial-block`` (the prompt ends before a full block), ``below-min-tokens`` (the rule's ``min_tokens``),
``off`` (the rule switches KV reuse off), ``corrupt`` (a block in L2/L3 failed this cache's checks: it is
dropped, never used, and misses name it until it is stored again; an entry failing the tier's signature is
dropped by the tier and reads as absent). A reason is decided from the request's own salted hashes only: the cache keeps no index across
namespaces, so a miss on leading tokens another tenant sent is ``never-seen``, exactly as if nobody had (a
reason telling them apart would let any tenant who can see a count test whether another sent a guessed
prompt).

``KvPlan.mode`` ``chunks`` adds chunk reuse after the exact prefix (serving/kv/_chunks.py: approximate, opt-in);
its blocks sit in the same L1 and tiers under chunk hashes, with the position they were computed at.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from evocache.controller import BlockHash, Entry, EntryInfo, KvReport, TierError, block_hashes
from evocache.controller.eviction import QueuedRequest

from ._chunks import ChunkBlock, chunk_salt, decode_chunk_group, encode_chunk_group
from ._store import BlockGeometry, CorruptBlock, DeviceBlocks, decode_group, encode_group, layer_groups

log = logging.getLogger("evocache.serving.kv")

SHARED_SALT = ".kv-shared"  # not a namespace any tenant id maps to (those never start with a dot)
LOWER_TIERS = ("l2", "l3")
_MEMORY = 65_536  # entries each bounded bookkeeping map keeps (blocks seen, prefetched)


class KvConfig(BaseModel):
    """A replica's KV prefix cache: ``l1_bytes`` of device memory for blocks,
    the L1 ``eviction`` policy (``lookahead`` keeps the blocks of waiting requests, over ``lru``; ``lookahead:learned``
    over the learned policy), the
    layers per L2/L3 payload (``layer_group``, 0: all), the ``ttl_s`` of blocks in L2/L3, and ``prefetch``:
    load a waiting request's blocks from L2/L3 into L1 while it waits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    l1_bytes: int = Field(256 << 20, ge=1)
    eviction: str = "lookahead"
    layer_group: int = Field(0, ge=0)
    ttl_s: float = Field(3600.0, gt=0)
    prefetch: bool = True
    adapter: str = ""


@dataclass(slots=True)
class KvUsage:
    """What the KV cache did for one request: tokens reused per tier (``chunk``: tokens taken from cached
    chunks at another position, not recomputed: approximate), tokens the model computed, the time spent
    loading blocks from L2/L3 (and how much of it the prefetch hid while the request waited), why the
    first block that missed did, and why chunk reuse was refused (``chunk_fallback``)."""

    prompt_tokens: int = 0
    reused: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0
    load_ms: float = 0.0
    prefetch_ms: float = 0.0
    hidden_ms: float = 0.0
    miss: str = ""
    stored_blocks: int = 0
    chunk_fallback: str = ""

    @property
    def cached_tokens(self) -> int:
        return sum(self.reused.values())

    def report(self) -> KvReport:
        """This usage as the call's outcome carries it (``controller.KvReport``)."""
        held = [tier for tier in ("l1", "l2", "l3") if self.reused.get(tier)]
        return KvReport(self.prompt_tokens, self.cached_tokens, held[-1] if held else None, self.load_ms,
                        self.miss, self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "reused": dict(self.reused), "recomputed": self.recomputed, "load_ms": round(self.load_ms, 3),
                "prefetch_ms": round(self.prefetch_ms, 3), "hidden_ms": round(self.hidden_ms, 3),
                "miss": self.miss, "stored_blocks": self.stored_blocks, "chunk_fallback": self.chunk_fallback}


@dataclass(frozen=True, slots=True)
class KvPlan:
    """One request's use of the cache: its namespace (or the shared salt), the tiers its rule allows,
    whether it may use the cache at all (``reason`` when not), and its ``mode``: ``prefix`` (exact) or
    ``chunks`` (also cached chunks at other positions, recomputing the first ``recompute_tokens`` tokens and
    a share ``recompute_fraction`` of each reused chunk; ``chunks``: the token offsets where the prompt's
    chunks start, from ``GenerateRequest.chunks``). ``hashes``: the prompt's block hashes under ``salt`` when
    the caller has them (the ingress computes them for the router); else the cache hashes the prompt."""

    salt: str
    tiers: tuple[str, ...] = ("l1", "l2", "l3")
    enabled: bool = True
    reason: str = ""
    mode: str = "prefix"
    recompute_tokens: int = 0
    recompute_fraction: float = 0.0
    chunks: tuple[int, ...] = ()
    hashes: tuple[BlockHash, ...] = ()


class KvPrefixCache:
    """The cache of one replica (see the module docstring). ``lower`` maps ``l2``/``l3`` to controller tiers
    (the replica's own, shared with its response cache); ``device`` is the model's."""

    def __init__(self, config: KvConfig, geometry: BlockGeometry, *, extras: tuple[str, ...], device: Any,
                 lower: dict[str, Any] | None = None, clock: Any = time.time) -> None:
        self.config = config
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.device = device
        self.extras = tuple(extras)  # what a block's hash binds: model id and revision, dtype, adapter
        self.l1 = DeviceBlocks(config.l1_bytes, geometry.block_bytes(), config.eviction)
        self.lower = {name: tier for name, tier in (lower or {}).items() if name in LOWER_TIERS}
        self.groups = layer_groups(geometry, config.layer_group)
        self.clock = clock
        self.errors = 0
        self.corrupt = 0
        self.chunk_fallbacks = 0  # chunk-mode requests served prefix-only (a RoPE that does not shift exactly)
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()
        # Blocks dropped for failing their checks, until stored again: a later miss on one is ``corrupt``.
        self._refused: OrderedDict[BlockHash, None] = OrderedDict()
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[BlockHash, ...]] = {}
        self._next_req = 0
        self.accessed: dict[BlockHash, int] = {}  # accesses per block in the current window (reuse rate)
        self._prefetched: dict[BlockHash, str] = {}  # blocks the prefetch put in L1 -> the tier they came from
        self._requests = itertools.count()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evocache-kv-write")
        self._pending: list[concurrent.futures.Future] = []
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evocache-kv-prefetch")

    # -- hashing -------------------------------------------------------------------------------------------

    def hashes(self, input_ids: Sequence[int], salt: str) -> tuple[BlockHash, ...]:
        return block_hashes(input_ids, self.block_size, self.extras, salt)

    @staticmethod
    def _key(block: BlockHash, group: tuple[int, int]) -> str:
        """The tier key of one layer group of a block: a digest of its own kind (the tiers take hex keys), so it
        never equals a response entry's key."""
        data = bytes(block) + group[0].to_bytes(4, "little") + group[1].to_bytes(4, "little")
        return hashlib.blake2b(data, digest_size=32, person=b"evocache.kv1").hexdigest()

    # -- the queue (prefetch and queue-aware eviction) -----------------------------------------------------

    def enqueue(self, hashes: tuple[BlockHash, ...]) -> int:
        """Register a request that waits for the model; returns its ticket for ``dequeue``."""
        with self._lock:
            self._next_req += 1
            req = self._next_req
            self._waiting[req] = hashes
            waiting = [QueuedRequest(r, tuple(h)) for r, h in self._waiting.items()]
        self.l1.on_queue(waiting)
        return req

    def dequeue(self, req: int) -> None:
        with self._lock:
            self._waiting.pop(req, None)
            waiting = [QueuedRequest(r, tuple(h)) for r, h in self._waiting.items()]
        self.l1.on_queue(waiting)

    def start_prefetch(self, plan: KvPlan, hashes: Sequence[BlockHash]) -> Any:
        """``prefetch`` on the cache's loader thread; the future's result is the seconds it spent."""
        return self._loader.submit(self.prefetch, plan, hashes)

    def prefetch(self, plan: KvPlan, hashes: Sequence[BlockHash]) -> float:
        """Load into L1, in position order, the blocks of ``hashes`` that sit only in L2/L3 (up to the first
        block no tier holds); returns the seconds it spent loading."""
        started = time.perf_counter()
        missing = [h for h in hashes if h not in self.l1]
        first_held = len(hashes) - len(missing)
        if not missing or not plan.enabled:
            return 0.0
        self._load_lower(plan, hashes, first_held, into_l1=True, prefetching=True)
        return time.perf_counter() - started

    # -- lookup and store ----------------------------------------------------------------------------------

    def lookup(self, plan: KvPlan, input_ids: Sequence[int], usage: KvUsage,
               hashes: tuple[BlockHash, ...] | None = None) -> tuple[tuple[BlockHash, ...], list[Any]]:
        """The prompt's block hashes and its longest cached prefix as blocks (each a (keys, values) pair per
        layer), filling ``usage``; the prefix stops one token short of the prompt at most."""
        usage.prompt_tokens = len(input_ids)
        bs = self.block_size
        if hashes is None:
            hashes = self.hashes(input_ids, plan.salt)
        usable = (len(input_ids) - 1) // bs  # the last prompt token is always computed
        blocks: list[Any] = []
        usage.reused["l1"] = 0
        for h in hashes[:usable]:
            block = self.l1.get(h) if "l1" in plan.tiers else None
            if block is None:
                break
            blocks.append(block)
            # A block the prefetch brought in counts for the tier it came from.
            with self._lock:
                origin = self._prefetched.pop(h, "l1")
            usage.reused[origin] = usage.reused.get(origin, 0) + bs
        if len(blocks) < usable and self.lower:
            started = time.perf_counter()
            more, per_tier = self._load_lower(plan, hashes[:usable], len(blocks), into_l1="l1" in plan.tiers)
            usage.load_ms += (time.perf_counter() - started) * 1000.0
            blocks += more
            for tier, n in per_tier.items():
                usage.reused[tier] = usage.reused.get(tier, 0) + n * bs
        usage.recomputed = len(input_ids) - len(blocks) * bs
        with self._lock:
            if len(self.accessed) > 1 << 20:  # nobody reads the window: keep it bounded
                self.accessed.clear()
            for h in hashes:
                self.accessed[h] = self.accessed.get(h, 0) + 1
        if len(blocks) < len(hashes[:usable]):
            usage.miss = usage.miss or self._why(hashes[len(blocks)])
        elif len(blocks) * bs < len(input_ids) - 1 and not usage.miss:
            usage.miss = "partial-block"
        return hashes, blocks

    def _why(self, block: BlockHash) -> str:
        """Why ``block`` missed, from this salted block alone: nothing another namespace stored enters."""
        with self._lock:
            refused = block in self._refused
        if refused:
            return "corrupt"
        if block in self.l1.evicted:
            return "evicted"
        if block not in self._seen:
            return "never-seen"
        return "evicted"

    def _info(self, plan: KvPlan, hashes: Sequence[BlockHash], i: int, req: int) -> EntryInfo:
        """What the L1 policy is told of block ``i`` of a request: its place in the request's chain, the
        request's number and length, and its parent, as the replay tells the learned policy."""
        return EntryInfo(size=self.geometry.block_bytes(), ns=plan.salt, req=req, pos=i, req_len=len(hashes),
                         parent=hashes[i - 1] if i else None)

    def _write_lower(self, salt: str, tiers: list[tuple[str, Any]], writes: list[tuple[BlockHash, Any]],
                     now: float) -> None:
        for h, block in writes:
            for tier_name, tier in tiers:
                items = [(self._key(h, g), Entry(encode_group(block[a:b], self.geometry, a), now + self.config.ttl_s,
                                                 now, "kv")) for g in self.groups for a, b in [g]]
                try:
                    tier.set_many(salt, items)
                except TierError as exc:
                    self.errors += 1
                    log.info("KV %s write failed (not stored): %s", tier_name, exc)

    def flush_writes(self, timeout: float | None = None) -> None:
        """Wait until the blocks stored so far are written to L2/L3."""
        for future in list(self._pending):
            future.result(timeout)

    def _load_lower(self, plan: KvPlan, hashes: Sequence[BlockHash], start: int, into_l1: bool,
                    prefetching: bool = False, chunk: bool = False) -> tuple[list[Any], dict[str, int]]:
        """Blocks ``hashes[start:]`` read from L2 then L3 in order, stopping at the first one no tier holds
        whole; each found block is put in L1 when ``into_l1``. ``chunk``: the blocks are ``ChunkBlock``s."""
        found: list[Any] = []
        per_tier: dict[str, int] = {}
        pending = list(hashes[start:])
        req = next(self._requests)
        for tier_name in LOWER_TIERS:
            tier = self.lower.get(tier_name)
            if tier is None or tier_name not in plan.tiers or not pending:
                continue
            keys = [self._key(h, g) for h in pending for g in self.groups]
            try:
                entries = tier.get_many(plan.salt, keys)
            except TierError as exc:
                self.errors += 1
                log.info("KV %s read failed (a miss): %s", tier_name, exc)
                continue
            taken = 0
            for i, h in enumerate(pending):
                parts = entries[i * len(self.groups) : (i + 1) * len(self.groups)]
                if any(e is None for e in parts):
                    break
                try:
                    block = self._decode(parts, chunk)
                except CorruptBlock as exc:
                    self.corrupt += 1
                    with self._lock:
                        self._refused[h] = None
                        if len(self._refused) > _MEMORY:
                            self._refused.popitem(last=False)
                    log.warning("KV block %s in %s dropped: %s", bytes(h).hex()[:12], tier_name, exc)
                    try:
                        tier.delete(plan.salt, [self._key(h, g) for g in self.groups])
                    except TierError:
                        pass
                    break
                found.append(block)
                if into_l1:
                    self.l1.put(h, block, self._info(plan, hashes, start + len(found) - 1, req))
                    if prefetching:
                        with self._lock:
                            self._prefetched[h] = tier_name
                            if len(self._prefetched) > _MEMORY:
                                self._prefetched.clear()
                taken += 1
            if taken:
                per_tier[tier_name] = taken
            pending = pending[taken:]
            if taken and pending:
                # A block missing here may sit in the next tier: keep looking from where this tier stopped.
                continue
        return found, per_tier

    def _decode(self, parts: Sequence[Any], chunk: bool) -> Any:
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

    def store(self, plan: KvPlan, input_ids: Sequence[int], hashes: Sequence[BlockHash], cache: Any,
              start_block: int, usage: KvUsage, stop_block: int | None = None) -> None:
        """Keep the full blocks ``start_block .. stop_block`` of the prompt ``input_ids`` from ``cache`` (the
        model's cache after the prefill): cloned into L1, and written to the lower tiers the plan allows."""
        bs = self.block_size
        n = min(len(hashes), cache.get_seq_length() // bs)
        if stop_block is not None:
            n = min(n, stop_block)
        now = self.clock()
        req = next(self._requests)
        writes: list[tuple[BlockHash, Any]] = []
        for i in range(start_block, n):
            h = hashes[i]
            block = tuple(
                (layer.keys[0, :, i * bs : (i + 1) * bs, :].clone(), layer.values[0, :, i * bs : (i + 1) * bs, :].clone())
                for layer in cache.layers
            )
            if "l1" in plan.tiers:
                self.l1.put(h, block, self._info(plan, hashes, i, req))
            writes.append((h, block))
            usage.stored_blocks += 1
            with self._lock:
                self._seen[h] = None
                self._refused.pop(h, None)
                if len(self._seen) > _MEMORY:
                    self._seen.popitem(last=False)
        tiers = [(name, self.lower[name]) for name in LOWER_TIERS if name in self.lower and name in plan.tiers]
        if writes and tiers:
            # Off the request's path: the first token does not wait for L2/L3 (flush_writes() waits for them).
            self._pending.append(self._writer.submit(self._write_lower, plan.salt, tiers, writes, now))
            self._pending = [f for f in self._pending if not f.done()]

    # -- chunks (reuse: chunks) ------------------------------------------------------------------------------

    def chunk_hashes(self, tokens: Sequence[int], salt: str) -> tuple[BlockHash, ...]:
        """The hashes of a chunk's full blocks: chained over the chunk's own tokens only, salted apart from
        prefix blocks (``chunk_salt``)."""
        return block_hashes(tokens, self.block_size, self.extras, chunk_salt(salt))

    def lookup_chunk(self, plan: KvPlan, tokens: Sequence[int], usable: int) -> list[ChunkBlock]:
        """The leading cached blocks of the chunk ``tokens`` (at most ``usable``): from L1, then L2/L3
        (promoted into L1)."""
        hashes = self.chunk_hashes(tokens, plan.salt)[:usable]
        found: list[ChunkBlock] = []
        for h in hashes:
            block = self.l1.get(h) if "l1" in plan.tiers else None
            if block is None:
                break
            found.append(block)
        if len(found) < len(hashes) and self.lower:
            more, _ = self._load_lower(plan, hashes, len(found), into_l1="l1" in plan.tiers, chunk=True)
            found += more
        return found

    def store_chunk(self, plan: KvPlan, tokens: Sequence[int], start: int, cache: Any) -> int:
        """Keep the full blocks of the chunk ``tokens``, which sits at ``start`` in ``cache``, under chunk
        hashes with their positions (L1 and the plan's lower tiers); returns the blocks kept."""
        bs = self.block_size
        hashes = self.chunk_hashes(tokens, plan.salt)
        now = self.clock()
        kept = 0
        for j, h in enumerate(hashes):
            a = start + j * bs
            if a + bs > cache.get_seq_length():
                break
            layers = tuple((layer.keys[0, :, a : a + bs].clone(), layer.values[0, :, a : a + bs].clone())
                           for layer in cache.layers)
            block = ChunkBlock(layers, a)
            if "l1" in plan.tiers:
                self.l1.put(h, block, EntryInfo(size=self.geometry.block_bytes(), ns=plan.salt, pos=j))
            for tier_name in LOWER_TIERS:
                tier = self.lower.get(tier_name)
                if tier is None or tier_name not in plan.tiers:
                    continue
                expires = now + self.config.ttl_s
                items = [(self._key(h, (x, y)), Entry(encode_chunk_group(block, self.geometry, x, y), expires, now,
                                                      "kv")) for x, y in self.groups]
                try:
                    tier.set_many(plan.salt, items)
                except TierError as exc:
                    self.errors += 1
                    log.info("KV %s write of a chunk failed (not stored): %s", tier_name, exc)
            kept += 1
        return kept

    def refuse_chunks(self, usage: KvUsage, reason: str, why: str) -> None:
        """Serve a chunk-mode request prefix-only: counted, logged (a warning the first time), and ``reason``
        said in ``usage.chunk_fallback``."""
        with self._lock:
            self.chunk_fallbacks += 1
            first = self.chunk_fallbacks == 1
        usage.chunk_fallback = reason
        (log.warning if first else log.info)("KV chunk reuse refused, prefix reuse only: %s", why)

    # -- building a model cache ----------------------------------------------------------------------------

    def build(self, model_config: Any, blocks: Sequence[Any]) -> Any:
        """A fresh ``DynamicCache`` holding ``blocks`` in order (batch 1)."""
        import torch  # noqa: PLC0415
        from transformers import DynamicCache  # noqa: PLC0415

        cache = DynamicCache(config=model_config)
        if blocks:
            for layer in range(self.geometry.layers):
                keys = torch.cat([b[layer][0] for b in blocks], dim=1).unsqueeze(0)
                values = torch.cat([b[layer][1] for b in blocks], dim=1).unsqueeze(0)
                cache.update(keys, values, layer)
        return cache

    def reuse_rate(self) -> float:
        """The share of blocks accessed more than once among those accessed since the last call (the KV reuse
        rate of the window); resets the window."""
        with self._lock:
            counts, self.accessed = self.accessed, {}
        if not counts:
            return 0.0
        return sum(1 for c in counts.values() if c > 1) / len(counts)

    def held(self) -> list[Hashable]:
        return self.l1.keys()

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=True)
