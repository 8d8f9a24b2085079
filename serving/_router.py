"""The prefix-affinity request router of the model deployment (Ray Serve's custom request-router API).

Each deployment handle (one per ingress replica) runs its own ``PrefixAffinityRouter``; nothing on the
request path is shared between them. For a request whose first positional argument carries ``blocks`` (the
chained block hashes of its prompt) the router ranks, in tiers that Ray tries in order:

1. the candidate holding the longest leading run of those blocks, most recently: what this router routed
   (fresh) and what replicas report through ``record_routing_stats`` (``BlockLedger.stats``, seconds stale);
   then the other candidates holding as much;
2. for a prefix no candidate holds, the rendezvous (highest-random-weight) choice over the candidates' ids by
   the first block, so every router sends a fresh prefix to the same replica without talking to the others;
3. two random other candidates (power of two choices), so a full preferred replica delays nobody.

When the candidates' queue lengths differ by more than ``imbalance_threshold``, or the request carries no
blocks (health checks, other methods, no arguments), the tiers are plain power of two choices.

Every lookup is dict and set work in O(blocks); the router never waits on a remote call of its own.

The router does not mix in Ray's ``FIFOMixin``: that mixin hands a replica found for one request to whichever
request is oldest, which would send a prefix to the replica chosen for another prefix.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ._affinity import BLOCK_HASH_BYTES, AffinityIndex, parse_report, rendezvous_order

logger = logging.getLogger(__name__)

DEFAULT_IMBALANCE_THRESHOLD = 10
DEFAULT_MEMORY_BLOCKS = 65536


@runtime_checkable
class PrefixedRequest(Protocol):
    """What the router reads of a request: the first positional argument of the deployment call."""

    blocks: tuple[bytes, ...]
    request_id: str


def request_blocks(pending_request: PendingRequest | None) -> tuple[bytes, ...] | None:
    """The block hashes of a pending request, or None when it carries none (then it is routed by load).

    Raises ``TypeError`` when the first argument has ``blocks`` that are not a tuple of 32-byte hashes.
    """
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if not isinstance(request, PrefixedRequest):
        return None
    blocks = request.blocks
    if not isinstance(blocks, tuple) or not all(
        isinstance(b, bytes) and len(b) == BLOCK_HASH_BYTES for b in blocks
    ):
        raise TypeError(
            f"request {request.request_id!r}: blocks must be a tuple of {BLOCK_HASH_BYTES}-byte hashes"
        )
    return blocks or None


def _check_kwargs(imbalance_threshold: int, memory_blocks: int) -> None:
    if type(imbalance_threshold) is not int or imbalance_threshold < 0:
        raise ValueError(f"imbalance_threshold must be an int >= 0, got {imbalance_threshold!r}")
    if type(memory_blocks) is not int or memory_blocks < 1:
        raise ValueError(f"memory_blocks must be an int >= 1, got {memory_blocks!r}")


class PrefixAffinityRouter(RequestRouter):
    """Routes requests that share a prompt prefix to the replica that holds it (see the module docstring).

    ``request_router_kwargs``: ``imbalance_threshold`` (int >= 0: the largest queue-length spread among the
    candidates that still routes by prefix) and ``memory_blocks`` (int >= 1: the (block, replica) pairs this
    router remembers routing).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._imbalance_threshold = DEFAULT_IMBALANCE_THRESHOLD
        self._index = AffinityIndex(DEFAULT_MEMORY_BLOCKS)
        self._reported_queue: dict[str, int] = {}
        self._stats_seen: dict[str, object] = {}  # the stats object last read per replica, to skip re-reading
        self._rng = random.Random()
        self._warned_bad_blocks = False

    def initialize_state(
        self,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        memory_blocks: int = DEFAULT_MEMORY_BLOCKS,
    ) -> None:
        _check_kwargs(imbalance_threshold, memory_blocks)
        self._imbalance_threshold = imbalance_threshold
        self._index = AffinityIndex(memory_blocks)

    # -- the routing decision -------------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Without it Ray retries a request whose every tier is full at once, in a tight loop.
            pending_request.routing_context.should_backoff = True
        blocks = self._blocks(pending_request)
        if blocks is None or self._imbalanced(candidate_replicas):
            return [self._two_choices(candidate_replicas)]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        _, holders = self._index.holders(blocks, by_name)
        preferred = holders or rendezvous_order(blocks[0], by_name)[:1]
        tiers = [[by_name[preferred[0]]]]
        if len(preferred) > 1:
            tiers.append([by_name[name] for name in preferred[1:]])
        chosen = set(preferred)
        rest = [r for name, r in by_name.items() if name not in chosen]
        if rest:
            tiers.append(self._two_choices(rest))
        return tiers

    def _blocks(self, pending_request: PendingRequest | None) -> tuple[bytes, ...] | None:
        try:
            return request_blocks(pending_request)
        except TypeError as exc:
            # The ingress's bug, not the caller's: route the request by load and say so once.
            if not self._warned_bad_blocks:
                self._warned_bad_blocks = True
                logger.warning(f"{self._deployment_id}: routing by load, not prefix: {exc}")
            return None

    def _queue_len(self, replica: RunningReplica) -> int | None:
        # The router's own cache is fresher than a replica's report; either may be missing.
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:
            queue_len = self._reported_queue.get(replica.replica_id.unique_id)
        return queue_len

    def _imbalanced(self, candidates: Sequence[RunningReplica]) -> bool:
        known = [q for q in map(self._queue_len, candidates) if q is not None]
        return len(known) > 1 and max(known) - min(known) > self._imbalance_threshold

    def _two_choices(self, candidates: Sequence[RunningReplica]) -> list[RunningReplica]:
        # Ray picks the shorter queue of the tier (probing replicas missing from its cache).
        return self._rng.sample(list(candidates), k=min(2, len(candidates)))

    # -- keeping the view current ---------------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        blocks = self._blocks(pending_request)
        if blocks is not None and replica_id in self.curr_replicas:
            self._index.routed(replica_id.unique_id, blocks)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        names = {r.replica_id.unique_id for r in replicas}
        self._index.retain(names)
        for name in set(self._stats_seen) - names:
            self._forget_report(name)
        for replica in replicas:
            self._read_report(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.unique_id)
        self._forget_report(replica_id.unique_id)

    def _forget_report(self, name: str) -> None:
        self._stats_seen.pop(name, None)
        self._reported_queue.pop(name, None)

    def _read_report(self, replica: RunningReplica) -> None:
        name = replica.replica_id.unique_id
        stats = replica.routing_stats
        if self._stats_seen.get(name) is stats:
            return
        self._stats_seen[name] = stats
        try:
            report = parse_report(stats)
        except ValueError as exc:
            logger.warning(f"{replica.replica_id}: routing stats ignored: {exc}")
            return
        self._index.reported(name, report.blocks)
        if report.queue is None:
            self._reported_queue.pop(name, None)
        else:
            self._reported_queue[name] = report.queue


def prefix_router_config(
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    memory_blocks: int = DEFAULT_MEMORY_BLOCKS,
    stats_period_s: float = 2.0,
) -> RequestRouterConfig:
    """The ``request_router_config`` of a deployment routed by ``PrefixAffinityRouter``; ``stats_period_s`` is
    how often Ray asks each replica for ``record_routing_stats``. Raises ``ValueError`` for a bad value."""
    _check_kwargs(imbalance_threshold, memory_blocks)
    return RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={"imbalance_threshold": imbalance_threshold, "memory_blocks": memory_blocks},
        request_routing_stats_period_s=stats_period_s,
    )
