"""The KV prefix cache of one replica, as its model runner sees it: two calls.

``prefill(plan, ids, usage, engine)`` does everything between a request's arrival and its prompt's last
logits: it registers the request in the replica's queue (what the look-ahead eviction reads) and, with
``prefetch`` on, loads its blocks that sit only in L2/L3 into L1 on a loader thread while it waits for the
engine's lock; then it finds the prompt's longest cached prefix (L1, then one batched read per lower tier,
stopping at the first block no tier holds), builds a fresh ``DynamicCache`` from its blocks and runs the
engine on the rest, the positions continuing from the cached length (at least the last prompt token is always
computed, so the first generated token has its logits), or, for a ``chunks`` plan, the chunk prefill of
serving/kv/_chunks.py. It returns the filled cache, the logits and what to keep, still holding the engine's
lock. ``store(result)`` keeps the prompt's new full blocks (and the chunks the model computed whole): cloned
into L1, handed to the lower tiers' writer thread, and then releases the lock, so a request waiting behind it
finds them. Greedy decoding with the cache gives the tokens it gives without (``tests/test_kv_cache.py``).

Behind the two calls sit three parts: ``BlockHasher`` (serving/kv/_hashing.py: prefix and chunk hashes, tier
keys), ``DeviceBlocks`` (serving/kv/_pool.py: L1 and what the cache remembers about blocks, the queue among
it) and ``LowerTiers`` (serving/kv/_lower.py: checked reads from L2/L3, and one writer thread for every write).
The engine is anything with the members of ``KvEngine`` (serving/kv/_engine.py).

A prompt's blocks are hashed under the plan's salt: the tenant's namespace, or a salt common to all tenants
when the rule declares its prefixes shared (``kv: {shared_prefixes: true}``); the ingress's hashes
(``KvPlan.hashes``) are used when the request carries them. Why a block missed is kept per request
(``KvUsage.miss``): ``never-seen``, ``evicted`` (from L1 and in no lower tier), ``partial-block`` (the prompt
ends before a full block), ``below-min-tokens`` (the rule's ``min_tokens``), ``off`` (the rule switches KV
reuse off), ``corrupt`` (a block in L2/L3 failed this cache's checks: it is dropped, never used, and misses
name it until it is stored again; an entry failing the tier's signature is dropped by the tier and reads as
absent). A reason is decided from the request's own salted hashes only: the cache keeps no index across
namespaces, so a miss on leading tokens another tenant sent is ``never-seen``, exactly as if nobody had (a
reason telling them apart would let any tenant who can see a count test whether another sent a guessed
prompt).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from evocache.controller import BlockHash, EntryInfo, KvReport

from ._chunks import ChunkBlock, ChunkPrefill
from ._engine import KvEngine
from ._hashing import BlockHasher
from ._lower import LowerTiers
from ._pool import Block, DeviceBlocks
from ._store import BlockGeometry
from .errors import RopeShiftUnsupported

log = logging.getLogger("evocache.serving.kv")

SHARED_SALT = ".kv-shared"  # not a namespace any tenant id maps to (those never start with a dot)


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


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What ``KvPrefixCache.prefill`` hands back: the model's ``cache`` holding the whole prompt, the last
    forward's ``logits`` (the prompt's last token's at ``[0, -1]``), and what ``store`` keeps of them: the full
    prefix blocks from ``first_block`` (the first the lookup did not find) up to ``stop_block`` (None: the
    prompt's last full block), named by ``hashes``, and the ``chunks`` (``[start, stop)`` spans of ``ids``) the
    model computed whole. ``lock`` is the engine's, held until ``store``."""

    cache: Any
    logits: Any
    plan: KvPlan
    ids: Sequence[int]
    usage: KvUsage
    hashes: tuple[BlockHash, ...]
    first_block: int
    lock: threading.Lock
    stop_block: int | None = None
    chunks: tuple[tuple[int, int], ...] = ()


class KvPrefixCache:
    """The cache of one replica (see the module docstring). ``lower`` maps ``l2``/``l3`` to controller tiers
    (the replica's own, shared with its response cache); ``device`` is the model's; ``extras`` what a block's
    hash binds besides its tokens and salt (model id and revision, dtype, adapter); ``clock`` stamps the
    entries written to L2/L3."""

    def __init__(self, config: KvConfig, geometry: BlockGeometry, *, extras: tuple[str, ...], device: Any,
                 lower: dict[str, Any] | None = None, clock: Any = time.time) -> None:
        self.config = config
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.hasher = BlockHasher(geometry.block_size, extras)
        self.l1 = DeviceBlocks(config.l1_bytes, geometry.block_bytes(), config.eviction)
        self.lower = LowerTiers(lower or {}, geometry, layer_group=config.layer_group, ttl_s=config.ttl_s,
                                device=device)
        self.clock = clock
        self.chunk_fallbacks = 0  # chunk-mode requests served prefix-only (a RoPE that does not shift exactly)
        self._fallbacks = threading.Lock()
        self._requests = itertools.count()  # the request number each L1 insertion tells the policy
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evocache-kv-prefetch")

    # -- the two calls -------------------------------------------------------------------------------------

    def prefill(self, plan: KvPlan, ids: Sequence[int], usage: KvUsage, engine: KvEngine, *,
                ticket: int | None = None) -> Prefilled:
        """Run the prompt ``ids`` on ``engine`` from its longest cached prefix (see the module docstring),
        filling ``usage``. Returns holding ``engine.lock``: call ``store`` with the result, which releases it.
        A tier that fails is a miss; an error of the engine propagates, the lock released. The request waits
        in the queue the look-ahead eviction reads until it holds the lock; ``ticket``: the queue's ticket of a
        caller that put it there when it arrived (``l1.enqueue``), else it is put there now."""
        hashes = plan.hashes or self.hasher.prefix(ids, plan.salt)
        if ticket is None:
            ticket = self.l1.enqueue(hashes)
        prefetch = self._loader.submit(self.prefetch, plan, hashes) if self.config.prefetch else None
        waited = time.perf_counter()
        engine.lock.acquire()
        try:
            waited = time.perf_counter() - waited
            self.l1.dequeue(ticket)
            if prefetch is not None:
                loaded = prefetch.result()
                usage.prefetch_ms = loaded * 1000.0
                usage.hidden_ms = min(loaded, waited) * 1000.0
            blocks = self._lookup(plan, ids, hashes, usage)
            cache = self._build(engine.model_config, blocks)
            chunks = self._chunk_prefill(plan, usage, cache, engine) if plan.mode == "chunks" else None
            if chunks is None:
                out = engine.forward(ids[len(blocks) * self.block_size :], cache)
                return Prefilled(cache, out.logits, plan, ids, usage, hashes, len(blocks), engine.lock)
            out = chunks.run(ids, cache, plan.chunks)
            usage.reused["chunk"] = chunks.reused_tokens
            usage.recomputed = len(ids) - usage.cached_tokens
            # Prefix blocks are exact: none after the first reused chunk, whose keys and values are not.
            exact = len(ids) if chunks.first_reused < 0 else chunks.first_reused
            return Prefilled(cache, out.logits, plan, ids, usage, hashes, len(blocks), engine.lock,
                             stop_block=exact // self.block_size, chunks=tuple(chunks.computed or ()))
        except BaseException:
            engine.lock.release()
            raise

    def store(self, filled: Prefilled) -> None:
        """Keep what ``filled`` says: its new full prefix blocks and computed chunks, cloned into L1 (when the
        plan allows L1) and written to the plan's lower tiers on the writer thread; then release the engine's
        lock."""
        plan = filled.plan
        try:
            now = self.clock()
            writes = self._keep_prefix(filled) + self._keep_chunks(filled)
        finally:
            filled.lock.release()
        self.lower.write(plan.salt, plan.tiers, writes, now)

    def flush_writes(self, timeout: float | None = None) -> None:
        """Wait until the blocks stored so far, prefix and chunk blocks alike, are written to L2/L3."""
        self.lower.flush(timeout)

    # -- waiting: the prefetch -----------------------------------------------------------------------------

    def prefetch(self, plan: KvPlan, hashes: Sequence[BlockHash]) -> float:
        """Load into L1, in position order, the blocks of ``hashes`` that sit only in L2/L3 (up to the first
        block no tier holds); returns the seconds it spent loading. Runs on the loader thread while the
        request waits."""
        started = time.perf_counter()
        missing = [h for h in hashes if h not in self.l1]
        first_held = len(hashes) - len(missing)
        if not missing or not plan.enabled:
            return 0.0
        self._load(plan, hashes, first_held, into_l1=True, prefetching=True)
        return time.perf_counter() - started

    # -- the lookup ----------------------------------------------------------------------------------------

    def _lookup(self, plan: KvPlan, ids: Sequence[int], hashes: Sequence[BlockHash],
                usage: KvUsage) -> list[Any]:
        """The prompt's longest cached prefix as blocks (each a (keys, values) pair per layer), filling
        ``usage``; the prefix stops one token short of the prompt at most."""
        usage.prompt_tokens = len(ids)
        bs = self.block_size
        usable = (len(ids) - 1) // bs  # the last prompt token is always computed
        blocks: list[Any] = []
        usage.reused["l1"] = 0
        for h in hashes[:usable]:
            block = self.l1.get(h) if "l1" in plan.tiers else None
            if block is None:
                break
            blocks.append(block)
            origin = self.l1.origin(h)  # a block the prefetch brought in counts for the tier it came from
            usage.reused[origin] = usage.reused.get(origin, 0) + bs
        if len(blocks) < usable and self.lower:
            started = time.perf_counter()
            more, per_tier = self._load(plan, hashes[:usable], len(blocks), into_l1="l1" in plan.tiers)
            usage.load_ms += (time.perf_counter() - started) * 1000.0
            blocks += more
            for tier, n in per_tier.items():
                usage.reused[tier] = usage.reused.get(tier, 0) + n * bs
        usage.recomputed = len(ids) - len(blocks) * bs
        self.l1.touch(hashes)
        if len(blocks) < len(hashes[:usable]):
            usage.miss = usage.miss or self.l1.why(hashes[len(blocks)])
        elif len(blocks) * bs < len(ids) - 1 and not usage.miss:
            usage.miss = "partial-block"
        return blocks

    def lookup_chunk(self, plan: KvPlan, tokens: Sequence[int], usable: int) -> list[ChunkBlock]:
        """The leading cached blocks of the chunk ``tokens`` (at most ``usable``): from L1, then L2/L3
        (promoted into L1)."""
        hashes = self.hasher.chunk(tokens, plan.salt)[:usable]
        found: list[ChunkBlock] = []
        for h in hashes:
            block = self.l1.get(h) if "l1" in plan.tiers else None
            if block is None:
                break
            found.append(block)
        if len(found) < len(hashes) and self.lower:
            more, _ = self._load(plan, hashes, len(found), into_l1="l1" in plan.tiers, chunk=True)
            found += more
        return found

    def _load(self, plan: KvPlan, hashes: Sequence[BlockHash], start: int, into_l1: bool,
              prefetching: bool = False, chunk: bool = False) -> tuple[list[Any], dict[str, int]]:
        """Blocks ``hashes[start:]`` read from the plan's lower tiers in order, up to the first no tier holds
        whole, each put in L1 when ``into_l1``; with the count per tier they came from."""
        read = self.lower.read(plan.salt, plan.tiers, hashes[start:], chunk)
        for h in read.refused:
            self.l1.refuse(h)
        req = next(self._requests)
        per_tier: dict[str, int] = {}
        for i, (block, tier) in enumerate(zip(read.blocks, read.tiers, strict=True)):
            if into_l1:
                h = hashes[start + i]
                self.l1.put(h, block, self._info(plan, hashes, start + i, req))
                if prefetching:
                    self.l1.prefetched(h, tier)
            per_tier[tier] = per_tier.get(tier, 0) + 1
        return list(read.blocks), per_tier

    def _info(self, plan: KvPlan, hashes: Sequence[BlockHash], i: int, req: int) -> EntryInfo:
        """What the L1 policy is told of block ``i`` of a request: its place in the request's chain, the
        request's number and length, and its parent, as the replay tells the learned policy."""
        return EntryInfo(size=self.geometry.block_bytes(), ns=plan.salt, req=req, pos=i, req_len=len(hashes),
                         parent=hashes[i - 1] if i else None)

    # -- running the prompt --------------------------------------------------------------------------------

    def _build(self, model_config: Any, blocks: Sequence[Any]) -> Any:
        """A fresh ``DynamicCache`` for ``model_config`` holding ``blocks`` in order (batch 1)."""
        import torch  # noqa: PLC0415
        from transformers import DynamicCache  # noqa: PLC0415

        cache = DynamicCache(config=model_config)
        if blocks:
            for layer in range(self.geometry.layers):
                keys = torch.cat([b[layer][0] for b in blocks], dim=1).unsqueeze(0)
                values = torch.cat([b[layer][1] for b in blocks], dim=1).unsqueeze(0)
                cache.update(keys, values, layer)
        return cache

    def _chunk_prefill(self, plan: KvPlan, usage: KvUsage, cache: Any,
                       engine: KvEngine) -> ChunkPrefill | None:
        """The chunk-reuse prefill for ``plan`` (serving/kv/_chunks.py), or None (prefix reuse only, counted
        and said in ``usage.chunk_fallback``) when the engine's RoPE cannot be shifted exactly or its
        ``cache`` has sliding-window layers (which drop the entries a chunk is placed and refreshed by)."""
        try:
            shift = engine.rope_shift()
        except RopeShiftUnsupported as exc:
            self._refuse_chunks(usage, "rope-unsupported", str(exc))
            return None
        config = engine.model_config
        if any(layer.is_sliding for layer in cache.layers):
            self._refuse_chunks(usage, "sliding-window",
                                f"{config.model_type} model with sliding-window attention layers")
            return None
        fraction = plan.recompute_fraction
        attention = config._attn_implementation
        if fraction and attention not in ("sdpa", "eager"):
            # The refresh forward needs a custom 4D mask, which other attention kernels do not take.
            log.warning("KV chunk reuse: attention %r takes no 4D mask, recompute_fraction is not applied",
                        attention)
            usage.chunk_fallback = "no-refresh-mask"
            fraction = 0.0
        def lookup(tokens: Sequence[int], usable: int) -> list[ChunkBlock]:
            return self.lookup_chunk(plan, tokens, usable)

        return ChunkPrefill(forward=engine.forward, lookup=lookup, shift=shift, block_size=self.block_size, recompute_tokens=plan.recompute_tokens,
                            recompute_fraction=fraction)

    def _refuse_chunks(self, usage: KvUsage, fallback: str, why: str) -> None:
        """Serve a chunk-mode request prefix-only: counted, logged (a warning the first time), and
        ``fallback`` said in ``usage.chunk_fallback``."""
        with self._fallbacks:
            self.chunk_fallbacks += 1
            first = self.chunk_fallbacks == 1
        usage.chunk_fallback = fallback
        (log.warning if first else log.info)("KV chunk reuse refused, prefix reuse only: %s", why)

    # -- storing -------------------------------------------------------------------------------------------

    def _keep_prefix(self, filled: Prefilled) -> list[tuple[BlockHash, Block]]:
        """Clone the new full prefix blocks of ``filled`` into L1 (when the plan allows it); returns the blocks
        to write."""
        plan, hashes, cache, bs = filled.plan, filled.hashes, filled.cache, self.block_size
        n = min(len(hashes), cache.get_seq_length() // bs)
        if filled.stop_block is not None:
            n = min(n, filled.stop_block)
        req = next(self._requests)
        kept: list[tuple[BlockHash, Block]] = []
        for i in range(filled.first_block, n):
            h = hashes[i]
            block = tuple((layer.keys[0, :, i * bs : (i + 1) * bs, :].clone(),
                           layer.values[0, :, i * bs : (i + 1) * bs, :].clone()) for layer in cache.layers)
            if "l1" in plan.tiers:
                self.l1.put(h, block, self._info(plan, hashes, i, req))
            kept.append((h, block))
            filled.usage.stored_blocks += 1
            self.l1.stored(h)
        return kept

    def _keep_chunks(self, filled: Prefilled) -> list[tuple[BlockHash, Block]]:
        """Clone the full blocks of each chunk the model computed whole into L1 (when the plan allows it),
        under chunk hashes and with the position each was computed at; the blocks to write."""
        plan, cache, bs = filled.plan, filled.cache, self.block_size
        length = cache.get_seq_length()
        kept: list[tuple[BlockHash, Block]] = []
        for start, stop in filled.chunks:
            for j, h in enumerate(self.hasher.chunk(filled.ids[start:stop], plan.salt)):
                a = start + j * bs
                if a + bs > length:
                    break
                layers = tuple((layer.keys[0, :, a : a + bs].clone(), layer.values[0, :, a : a + bs].clone())
                               for layer in cache.layers)
                block = ChunkBlock(layers, a)
                if "l1" in plan.tiers:
                    self.l1.put(h, block, EntryInfo(size=self.geometry.block_bytes(), ns=plan.salt, pos=j))
                kept.append((h, block))
        return kept

    # -- what the replica reads ----------------------------------------------------------------------------

    def reuse_rate(self) -> float:
        """The share of blocks accessed more than once among those accessed since the last call (the KV reuse
        rate of the window); resets the window."""
        return self.l1.reuse_rate()

    def held(self) -> list[Hashable]:
        return self.l1.keys()

    def close(self) -> None:
        """Stop prefetching; finish the L2/L3 writes stored so far."""
        self._loader.shutdown(wait=False, cancel_futures=True)
        self.lower.close()
