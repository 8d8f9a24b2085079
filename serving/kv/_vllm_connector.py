"""evocache's KV tiers as a vLLM KV connector (vLLM 0.32's ``KVConnectorBase_V1``, CPU attention backend).

    python -m vllm.entrypoints.openai.api_server --model DIR ... --kv-transfer-config '{
        "kv_connector": "EvocacheConnector",
        "kv_connector_module_path": "evocache.serving.kv._vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l1_bytes": 268435456, "disk": {"path": "/var/cache/evocache-kv"}}}'

What it does. Every full block a request computes (vLLM's block size) is copied out of vLLM's paged KV cache
after the step that completed it, into a host-memory L1 and, when configured, to the controller's L2 (Redis)
and L3 (disk) tiers, keyed by vLLM's own chained block hash (``_vllm_store`` has the store, its checks and
its namespace). When vLLM schedules a new request, the scheduler asks how many tokens beyond its own prefix
cache the connector holds: the longest run of held blocks after them, never the block holding the prompt's
last token (vLLM must compute at least one token). Those blocks are copied into the blocks vLLM allocated
before the step's forward.

Loads are synchronous (``get_num_new_matched_tokens`` answers ``(tokens, False)``): the copy from host memory
or disk runs in the worker before the forward that needs it, and the step waits for it. An asynchronous
load (answer ``None`` or ``True`` and report the request in ``get_finished``) would let other requests run
while a disk or Redis read is in flight; it is not done yet.

A block that cannot be loaded (gone from L1 and the lower tiers since the scheduler counted it, a payload
that fails its signature, size or geometry check) is reported through ``get_block_ids_with_load_errors``,
and vLLM recomputes from the first such block: a request never gets a wrong token and never fails because of
the cache. The step that found it saves nothing of that request (its forward attended to the block that did
not load, so what it computed after it is wrong); the worker says so in its report, and the scheduler asks
for the request's blocks again once vLLM has recomputed them. This needs ``"kv_load_failure_policy":
"recompute"`` (vLLM's default, ``fail``, would fail the request instead): the connector refuses to start
without it.

Processes. vLLM builds two instances of this class: the scheduler's (role ``SCHEDULER``, in the engine
process) and the worker's (role ``WORKER``, in the worker process; the same process when
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). They share no memory even then: each talks only through what vLLM
carries between them. The worker owns the blocks (L1) and writes L2/L3. The scheduler owns an index of the
blocks it believes held (``HeldIndex``), fed by

- the worker's report after every step (``build_connector_worker_meta`` -> ``update_connector_output``):
  the blocks it stored, the blocks L1 evicted that no lower tier keeps, and the blocks a load found missing
  or refused;
- a probe of L2/L3 for a chain's blocks the index does not know (another replica wrote them, or this
  process restarted): the tiers check each entry's signature, and a found block is remembered.

The index can be ahead of the store (an eviction not reported yet, an entry deleted since it was probed):
the load then fails for that block and vLLM recomputes it, as above. It is never consulted for anything
but a count, so a stale entry costs a recompute, not a wrong answer.

The per-step instructions travel in ``EvocacheMetadata``: for each request, the blocks to load (hashes and
vLLM block ids) and the blocks to save. Counts of what happened (blocks loaded per tier, load errors,
stored, evicted, refused as corrupt, dropped by a tier's signature check) reach vLLM's ``/metrics`` as
``evocache:vllm_kv_blocks_total{event=...}``.

The per-layer KV tensor on the CPU backend is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; the
attention kernel reads it as ``[num_blocks, kv_heads, 2 * block_size, head_dim]``, keys in the first
``block_size`` rows of each head and values in the rest. A block is stored as those keys and values
(``_store.encode_group``); another layout is refused when the caches are registered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from evocache.controller import BlockHash

from ._store import BlockGeometry, layer_groups
from ._vllm_store import EVENTS, BlockStore, ConnectorConfig, Counters, HeldIndex, TierProbe, build_tiers
from ._vllm_store import model_namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("evocache.serving.kv.vllm")

CPU_LAYOUT = "[num_blocks, kv_heads, block_size, 2 * head_dim]"


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to copy: ``hashes[i]`` is vLLM's hash of the block in vLLM's block
    ``block_ids[i]``."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass
class EvocacheMetadata(KVConnectorMetadata):
    """One step's instructions, scheduler to worker: load before the forward, save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class EvocacheReport(KVConnectorWorkerMetadata):
    """What the worker's store changed in a step, for the scheduler: blocks it now holds, blocks it no longer
    holds (evicted with no lower tier, or found missing or corrupt at a load), and the requests whose blocks
    it did not save because one of their loads failed (the scheduler asks for them again once vLLM has
    recomputed them)."""

    stored: tuple[bytes, ...] = ()
    dropped: tuple[bytes, ...] = ()
    unsaved: tuple[str, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, EvocacheReport)
        return EvocacheReport(self.stored + other.stored, self.dropped + other.dropped,
                              self.unsaved + other.unsaved)


@dataclass
class EvocacheStats(KVConnectorStats):
    """Block counts by event (``_vllm_store.EVENTS``) over an interval; intervals add up."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for event, n in other.data.items():
            self.data[event] = self.data.get(event, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class EvocachePromMetrics(KVConnectorPromMetrics):
    """``evocache:vllm_kv_blocks_total{event=...}`` on vLLM's ``/metrics``."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(name="evocache:vllm_kv_blocks",
                                    documentation="KV blocks through evocache's connector, by event",
                                    labelnames=[*labelnames, "event"])
        self._counters = {(engine, event): counter.labels(*values, event)
                          for engine, values in per_engine_labelvalues.items() for event in EVENTS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for event, n in transfer_stats_data.items():
            metric = self._counters.get((engine_idx, event))
            if metric is not None and n:
                metric.inc(n)


class EvocacheConnector(KVConnectorBase_V1):
    """The connector (module docstring). Built by vLLM, once per role; configured by
    ``kv_connector_extra_config`` (``_vllm_store.ConnectorConfig``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                "EvocacheConnector needs \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config: "
                "with vLLM's default, \"fail\", a block that fails its checks would fail the request "
                "instead of being recomputed")
        self.config = ConnectorConfig.parse(transfer.kv_connector_extra_config or {})
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"EvocacheConnector handles models with one KV cache group, not {len(groups)}")
        spec = groups[0].kv_cache_spec
        self.block_size = vllm_config.cache_config.block_size
        self.hash_block_size = kv_cache_config.hash_block_size or self.block_size
        if self.block_size % self.hash_block_size:
            raise ValueError(f"block size {self.block_size} is not a multiple of the hash block size "
                             f"{self.hash_block_size}")
        self.layer_names = list(groups[0].layer_names)
        self.geometry = BlockGeometry(len(self.layer_names), spec.num_kv_heads, spec.head_size,
                                      self.block_size, str(spec.dtype).removeprefix("torch."))
        model = vllm_config.model_config
        self.namespace = model_namespace({
            "model": str(model.model), "revision": str(model.revision or ""), "dtype": self.geometry.dtype,
            "hash": str(vllm_config.cache_config.prefix_caching_hash_algo),
            "hash_block_size": str(self.hash_block_size), "layout": CPU_LAYOUT,
            "layers": ",".join(self.layer_names),
        })
        self.counters = Counters()
        tiers = build_tiers(self.config, self.counters)
        if role is KVConnectorRole.SCHEDULER:
            probe = TierProbe(tiers, layer_groups(self.geometry, self.config.layer_group), self.namespace,
                              self.counters)
            self.index = HeldIndex(self.config.index_blocks, probe)
            self._requests: dict[str, Request] = {}
            self._asked: dict[str, int] = {}  # request -> the first block of its last answered run
            self._saved: dict[str, int] = {}  # request -> blocks before this one were saved or held
            self._loads: list[BlockTransfer] = []
        else:
            self._tiers = tiers
            self.store: BlockStore | None = None
            self._layers: list[torch.Tensor] = []
            self._load_errors: set[int] = set()
            self._missing: list[bytes] = []
            self._failed: set[str] = set()  # requests with a failed load in this step
        log.info("evocache KV connector (%s): namespace %s, L1 %d bytes, lower tiers %s", role.name,
                 self.namespace, self.config.l1_bytes, sorted(tiers) or "none")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss, never a lost hand-off

    # -- both sides ----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        counts = self.counters.take()
        return EvocacheStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return EvocacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return EvocachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- the scheduler's side ------------------------------------------------------------------------------

    def _hashes(self, request: Request) -> list[bytes]:
        """vLLM's hash of each of ``request``'s full blocks (a block's hash is the one of its last hash
        block: the hashes chain)."""
        step = self.block_size // self.hash_block_size
        hashes = request.block_hashes
        return [hashes[i] for i in range(step - 1, len(hashes), step)]

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        hashes = self._hashes(request)
        # Never the block with the last token: vLLM computes at least one token of a prompt.
        usable = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        if start >= usable:
            return 0, False
        run = self.index.run(hashes[start:usable])
        # Remembered for update_state_after_alloc, which is not told where the run starts; a later call
        # overwrites it, so asking again changes nothing.
        self._asked[request.request_id] = start
        return run * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        start = self._asked.pop(req_id, None)
        self.counters.add("lookups")
        if num_external_tokens == 0 or start is None:
            return
        count = num_external_tokens // self.block_size
        self.counters.add("matched_blocks", count)
        block_ids = blocks.get_block_ids()[0][start:start + count]
        hashes = self._hashes(request)[start:start + count]
        self._loads.append(BlockTransfer(req_id, tuple(hashes), tuple(block_ids)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = EvocacheMetadata(loads=self._loads)
        self._loads = []
        assert self._kv_cache_manager is not None
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            # Blocks whose every token has its keys and values once this step's forward ran.
            hashes = self._hashes(request)
            full = min(len(hashes), (request.num_computed_tokens + scheduled) // self.block_size)
            first = self._saved.get(req_id, 0)
            if full <= first:
                continue
            self._saved[req_id] = full
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            todo = [i for i in range(first, full) if hashes[i] not in self.index]
            if todo:
                meta.saves.append(BlockTransfer(req_id, tuple(hashes[i] for i in todo),
                                                tuple(block_ids[i] for i in todo)))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, EvocacheReport):
            self.index.discard([BlockHash(h) for h in report.dropped])
            self.index.add([BlockHash(h) for h in report.stored])
            for req_id in report.unsaved:
                self._saved.pop(req_id, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._asked.pop(req_id, None)
        self._saved.pop(req_id, None)
        return False, None  # every save is done within its step: vLLM may free the blocks now

    # -- the worker's side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        g = self.geometry
        expected = (g.kv_heads, g.block_size, 2 * g.head_dim)
        layers = []
        for name in self.layer_names:
            cache = kv_caches[name]
            if tuple(cache.shape[1:]) != expected or cache.dtype != getattr(torch, g.dtype):
                raise ValueError(
                    f"EvocacheConnector copies KV blocks of the CPU layout {CPU_LAYOUT} = [*, {expected}] "
                    f"{g.dtype}; layer {name} is {tuple(cache.shape)} {cache.dtype}")
            layers.append(cache)
        self._layers = layers
        self.store = BlockStore(self.config, g, self.namespace, self._tiers, self.counters)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EvocacheMetadata) and self.store is not None
        for transfer in meta.loads:
            loaded = self.store.load([BlockHash(h) for h in transfer.hashes])
            for block_id, block in zip(transfer.block_ids, loaded.blocks, strict=False):
                self._write_block(block_id, block)
            failed = transfer.block_ids[len(loaded.blocks):]
            if failed:
                self._failed.add(transfer.req_id)
                self._load_errors.update(failed)
                self._missing += transfer.hashes[len(loaded.blocks):]
                self.counters.add("load_errors", len(failed))
                log.warning("request %s: %d of %d KV blocks could not be loaded; vLLM recomputes them",
                            transfer.req_id, len(failed), len(transfer.block_ids))

    def _write_block(self, block_id: int, block: tuple) -> None:
        size = self.block_size
        for cache, (keys, values) in zip(self._layers, block, strict=True):
            rows = cache[block_id].view(self.geometry.kv_heads, 2 * size, self.geometry.head_dim)
            rows[:, :size].copy_(keys)
            rows[:, size:].copy_(values)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load was done whole in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Blocks are copied once per step, in wait_for_save, from every layer at once: on the CPU a copy
        # gains nothing from overlapping the forward's later layers.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, EvocacheMetadata) and self.store is not None
        g = self.geometry
        for transfer in meta.saves:
            if transfer.req_id in self._failed:
                # This step's forward attended to blocks that did not load: what it computed after them is
                # wrong, and vLLM computes it again. Nothing of the request is saved until then.
                continue
            ids = torch.tensor(transfer.block_ids, dtype=torch.long)
            per_layer = [cache.index_select(0, ids).view(len(ids), g.kv_heads, 2 * g.block_size, g.head_dim)
                         for cache in self._layers]
            items = []
            for j, h in enumerate(transfer.hashes):
                block = tuple((rows[j, :, :g.block_size].clone(), rows[j, :, g.block_size:].clone())
                              for rows in per_layer)
                items.append((BlockHash(h), block))
            self.store.put(items)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.store is None:
            return None
        stored, dropped = self.store.take_report()
        dropped = (*dropped, *self._missing)
        unsaved = tuple(self._failed)
        self._missing, self._failed = [], set()
        if not stored and not dropped and not unsaved:
            return None
        return EvocacheReport(tuple(bytes(h) for h in stored), tuple(bytes(h) for h in dropped), unsaved)

    def shutdown(self) -> None:
        if self._role is KVConnectorRole.WORKER and self.store is not None:
            self.store.close()  # finishes the L2/L3 writes queued so far
