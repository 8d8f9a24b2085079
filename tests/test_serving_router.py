"""The prefix-affinity router: its decision through Ray's real RequestRouter routing loop, the replica's
BlockLedger and the index behind it, and one deployment on a real local Ray.

The unit tests route through ``RequestRouter._choose_replica_for_request``: Ray's own loop asks
``choose_replicas`` for tiers, probes queue lengths, skips full replicas and fulfils the request. The replicas
are ``RunningReplica`` objects with a real ``RunningReplicaInfo`` whose queue length the test sets, as Ray's
own router tests do; ``on_request_routed`` is then called as Ray's handle calls it once a replica accepts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    RunningReplicaInfo,
)
from ray.serve.request_router import PendingRequest, RunningReplica

from evocache.controller import block_hashes
from evocache.serving._affinity import (
    AffinityIndex,
    BlockLedger,
    checkpoints,
    parse_report,
    rendezvous_order,
)
from evocache.serving._router import PrefixAffinityRouter, prefix_router_config

DEPLOYMENT = DeploymentID(name="model", app_name="app")
BLOCK = 4


def prompt(tenant: str, *parts: int, n_blocks: int = 6) -> tuple[bytes, ...]:
    """The block hashes of a prompt whose blocks are ``parts`` then zeros, ``n_blocks`` blocks in all."""
    tokens = [t for part in parts for t in [part] * BLOCK]
    tokens += [0] * (BLOCK * n_blocks - len(tokens))
    return block_hashes(tokens, BLOCK, ["tiny-model@1"], first_salt=tenant)


def request(blocks: tuple[bytes, ...]) -> SimpleNamespace:
    return SimpleNamespace(blocks=blocks, request_id=uuid.uuid4().hex)


class Replica(RunningReplica):
    """A RunningReplica with no actor behind it: the test sets the queue length it answers with."""

    def __init__(self, name: str, queue_len: int = 0, max_ongoing_requests: int = 8) -> None:
        self._replica_info = RunningReplicaInfo(
            replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT),
            node_id=None,
            node_ip=None,
            availability_zone=None,
            actor_name=name,
            max_ongoing_requests=max_ongoing_requests,
        )
        self._multiplexed_model_ids: set[str] = set()
        self.queue_len = queue_len

    def report(self, stats: dict) -> None:
        """What a controller broadcast does: a new replica info carrying the replica's latest stats."""
        self._replica_info = dataclasses.replace(self._replica_info, routing_stats=stats)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(replicas: list[Replica], **kwargs: int) -> PrefixAffinityRouter:
    """Must be called inside a running event loop (the router creates tasks on it)."""
    router = PrefixAffinityRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    router.update_replicas(list(replicas))
    return router


def pending(*args: object) -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id=uuid.uuid4().hex, call_method="generate")
    return PendingRequest(args=list(args), kwargs={}, metadata=metadata)


async def route(router: PrefixAffinityRouter, *args: object) -> str:
    """Route one request through Ray's routing loop; the name of the replica it went to."""
    pr = pending(*args)
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), timeout=10)
    router.on_request_routed(pr, replica.replica_id, None)
    return replica.replica_id.unique_id


def routed(router: PrefixAffinityRouter, name: str, blocks: tuple[bytes, ...]) -> None:
    """What Ray's handle reports once ``name`` accepted a request for ``blocks``."""
    router.on_request_routed(pending(request(blocks)), ReplicaID(name, DEPLOYMENT), None)


async def first_choice(router: PrefixAffinityRouter, blocks: tuple[bytes, ...]) -> list[str]:
    """The router's first tier for ``blocks``, without routing (so nothing is recorded)."""
    tiers = await router.choose_replicas(router._replicas_list, pending(request(blocks)))
    return [r.replica_id.unique_id for r in tiers[0]]


async def settle() -> None:
    """Let the queue-length probes that ``update_replicas`` started finish."""
    for _ in range(5):
        await asyncio.sleep(0)


def winner(blocks: tuple[bytes, ...], names: list[str]) -> str:
    return rendezvous_order(blocks[0], names)[0]


NAMES = ["r-a", "r-b", "r-c", "r-d"]


# -- the routing decision ------------------------------------------------------------------------------------


def test_same_prefix_goes_to_the_same_replica() -> None:
    async def run() -> set[str]:
        router = make_router([Replica(n) for n in NAMES])
        return {await route(router, request(prompt("t", 7, 8, 9, tail))) for tail in range(1, 9)}

    assert asyncio.run(run()) == {winner(prompt("t", 7), NAMES)}


def test_fresh_prefixes_spread_by_rendezvous_over_the_replicas() -> None:
    prompts = [prompt(f"tenant-{i}", 1, 2) for i in range(40)]

    async def run() -> list[str]:
        router = make_router([Replica(n) for n in NAMES])
        return [await route(router, request(p)) for p in prompts]

    chosen = asyncio.run(run())
    assert chosen == [winner(p, NAMES) for p in prompts]
    assert set(chosen) == set(NAMES)


def test_two_routers_agree_on_fresh_prefixes_whatever_their_replica_order() -> None:
    prompts = [prompt("t", i, 5) for i in range(1, 21)]

    async def run() -> tuple[list[str], list[str]]:
        one = make_router([Replica(n) for n in NAMES])
        two = make_router([Replica(n) for n in reversed(NAMES)])
        first = [await route(one, request(p)) for p in prompts]
        return first, [await route(two, request(p)) for p in prompts]

    first, second = asyncio.run(run())
    assert first == second
    assert len(set(first)) > 1


def test_a_prefix_follows_the_replica_it_was_last_routed_to_not_its_rendezvous_home() -> None:
    first = prompt("t", 3, 4, n_blocks=4)
    continuation = prompt("t", 3, 4, n_blocks=9)  # the same conversation, one turn on
    home = winner(first, NAMES)

    async def run() -> tuple[str, str]:
        replicas = {n: Replica(n) for n in NAMES}
        router = make_router(list(replicas.values()))
        full = replicas[home].max_ongoing_requests
        replicas[home].queue_len = full  # Ray passes over a full replica to the next tier
        router.on_new_queue_len_info(replicas[home].replica_id, full)
        went = await route(router, request(first))
        replicas[home].queue_len = 0
        router.on_new_queue_len_info(replicas[home].replica_id, 0)
        return went, await route(router, request(continuation))

    went, followed = asyncio.run(run())
    assert went != home
    assert followed == went


def test_the_longest_leading_run_wins_and_recency_breaks_ties() -> None:
    blocks = prompt("t", 1, 2, 3, 4, 5, 6, 7, 8, n_blocks=10)
    # Names picked so that rendezvous order alone would give the other answer each time.
    shallow, _, deep, later = rendezvous_order(blocks[0], NAMES)

    async def run() -> tuple[str, str]:
        router = make_router([Replica(n) for n in NAMES])
        routed(router, deep, blocks[:8])
        routed(router, shallow, blocks[:2])
        deepest = await route(router, request(blocks))
        routed(router, later, blocks[:8])
        return deepest, await route(router, request(blocks[:9]))

    assert asyncio.run(run()) == (deep, later)


def test_imbalanced_queues_fall_back_to_the_shorter_of_two_choices() -> None:
    blocks = prompt("t", 9, 9)

    async def run(threshold: int) -> str:
        replicas = [Replica("r-a"), Replica("r-b")]
        router = make_router(replicas, imbalance_threshold=threshold)
        routed(router, "r-a", blocks)
        replicas[0].queue_len = 5
        router.on_new_queue_len_info(replicas[0].replica_id, 5)  # what a replica's reply does
        router.on_new_queue_len_info(replicas[1].replica_id, 0)
        return await route(router, request(blocks))

    assert asyncio.run(run(threshold=10)) == "r-a"  # spread 5: still by prefix
    assert asyncio.run(run(threshold=2)) == "r-b"  # spread 5 > 2: by load


def test_reported_queue_lengths_count_when_the_router_has_none() -> None:
    blocks = prompt("t", 9, 9)

    async def run() -> str:
        replicas = [Replica("r-a"), Replica("r-b")]
        router = make_router(replicas, imbalance_threshold=2)
        routed(router, "r-a", blocks)
        await settle()
        replicas[0].queue_len = 6
        replicas[0].report({"blocks": [], "queue": 6})
        replicas[1].report({"blocks": [], "queue": 0})
        router.update_replicas(replicas)
        router.replica_queue_len_cache.invalidate_key(replicas[0].replica_id)
        router.replica_queue_len_cache.invalidate_key(replicas[1].replica_id)
        return await route(router, request(blocks))

    assert asyncio.run(run()) == "r-b"


def test_a_dead_replica_is_forgotten_even_if_a_stale_broadcast_lists_it_again() -> None:
    blocks = prompt("t", 2, 2)
    home = winner(blocks, NAMES)
    other = next(n for n in NAMES if n != home)

    async def run() -> tuple[list[str], list[str], str]:
        replicas = [Replica(n) for n in NAMES]
        router = make_router(replicas)
        routed(router, other, blocks)
        before = await first_choice(router, blocks)
        router.on_replica_actor_died(ReplicaID(other, DEPLOYMENT))
        after_death = await first_choice(router, blocks)
        router.update_replicas(replicas)  # the controller has not seen the death yet
        return before, after_death, await route(router, request(blocks))

    assert asyncio.run(run()) == ([other], [home], home)


def test_a_replica_removed_from_the_deployment_is_forgotten() -> None:
    blocks = prompt("t", 2, 2)
    home = winner(blocks, NAMES)
    other = next(n for n in NAMES if n != home)

    async def run() -> tuple[str, str]:
        replicas = [Replica(n) for n in NAMES]
        router = make_router(replicas)
        routed(router, other, blocks)
        before = await route(router, request(blocks))
        router.update_replicas([r for r in replicas if r.replica_id.unique_id != other])
        router.update_replicas(replicas)
        return before, await route(router, request(blocks))

    assert asyncio.run(run()) == (other, home)


@pytest.mark.parametrize(
    "args",
    [
        (),
        (SimpleNamespace(request_id="health"),),
        ("plain text",),
        (request(()),),
        (SimpleNamespace(blocks=["not", "hashes"], request_id="bad"),),
        (SimpleNamespace(blocks=(b"short",), request_id="bad"),),
    ],
    ids=["no-args", "no-blocks", "a-string", "empty-blocks", "blocks-of-str", "short-hash"],
)
def test_requests_without_usable_blocks_are_routed_by_load(args: tuple) -> None:
    async def run() -> tuple[str, list[list[RunningReplica]]]:
        router = make_router([Replica(n) for n in NAMES])
        tiers = await router.choose_replicas(router._replicas_list, None)
        return await route(router, *args), tiers

    name, tiers = asyncio.run(run())
    assert name in NAMES
    assert len(tiers) == 1 and len(tiers[0]) == 2


def test_no_candidates_no_tiers() -> None:
    async def run() -> list:
        router = make_router([])
        return await router.choose_replicas([], pending(request(prompt("t", 1))))

    assert asyncio.run(run()) == []


def test_a_full_preferred_replica_leaves_two_other_choices() -> None:
    blocks = prompt("t", 4, 4)

    async def run() -> tuple[list[list[str]], bool]:
        router = make_router([Replica(n) for n in NAMES])
        pr = pending(request(blocks))
        tiers = await router.choose_replicas(router._replicas_list, pr)
        return [[r.replica_id.unique_id for r in tier] for tier in tiers], pr.routing_context.should_backoff

    tiers, backs_off = asyncio.run(run())
    assert backs_off  # else Ray's loop retries a request whose every tier is full without pausing
    assert tiers[0] == [winner(blocks, NAMES)]
    assert len(tiers) == 2 and len(tiers[1]) == 2 and winner(blocks, NAMES) not in tiers[1]


# -- replica reports -----------------------------------------------------------------------------------------


def test_a_replica_report_draws_its_prefixes_and_a_new_report_replaces_it() -> None:
    blocks = prompt("t", 5, 6, n_blocks=8)
    home = winner(blocks, NAMES)
    holder = next(n for n in NAMES if n != home)
    ledger = BlockLedger(capacity_blocks=16)
    ledger.served(blocks[:5])

    async def run() -> tuple[list[str], list[str]]:
        replicas = {n: Replica(n) for n in NAMES}
        router = make_router(list(replicas.values()))
        replicas[holder].report(ledger.stats(queue_len=0))
        router.update_replicas(list(replicas.values()))
        reported = await first_choice(router, blocks)
        replicas[holder].report(BlockLedger().stats(queue_len=0))
        router.update_replicas(list(replicas.values()))
        return reported, await first_choice(router, blocks)

    assert asyncio.run(run()) == ([holder], [home])


def test_a_deeper_report_beats_a_shallower_route_and_fresh_beats_reported_at_equal_depth() -> None:
    blocks = prompt("t", 5, 6, 7, 8, n_blocks=10)
    # Names picked so that rendezvous order alone would give the other answer each time.
    shallow, reporter, _, fresh = rendezvous_order(blocks[0], NAMES)
    ledger = BlockLedger()
    ledger.served(blocks[:8])

    async def run() -> tuple[list[str], list[str]]:
        replicas = {n: Replica(n) for n in NAMES}
        router = make_router(list(replicas.values()))
        routed(router, shallow, blocks[:2])
        replicas[reporter].report(ledger.stats(queue_len=0))
        router.update_replicas(list(replicas.values()))
        deeper = await first_choice(router, blocks)
        routed(router, fresh, blocks[:8])
        return deeper, await first_choice(router, blocks)

    assert asyncio.run(run()) == ([reporter], [fresh])


def test_malformed_reports_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    blocks = prompt("t", 5, 6)

    async def run() -> str:
        replicas = [Replica(n) for n in NAMES]
        router = make_router(replicas)
        replicas[0].report({"blocks": ["zz" * 32]})
        replicas[1].report({"blocks": "not a list"})
        replicas[2].report({"blocks": [], "queue": -1})
        router.update_replicas(replicas)
        return await route(router, request(blocks))

    with caplog.at_level(logging.WARNING, logger="evocache.serving._router"):
        assert asyncio.run(run()) == winner(blocks, NAMES)
    assert sum("routing stats ignored" in r.getMessage() for r in caplog.records) == 3


def test_router_kwargs_are_validated() -> None:
    async def run(**kwargs: object) -> None:
        make_router([Replica("r-a")], **kwargs)

    with pytest.raises(ValueError, match="imbalance_threshold"):
        asyncio.run(run(imbalance_threshold=-1))
    with pytest.raises(ValueError, match="memory_blocks"):
        asyncio.run(run(memory_blocks=0))
    with pytest.raises(TypeError):
        asyncio.run(run(imbalanced_threshold=3))
    with pytest.raises(ValueError, match="memory_blocks"):
        prefix_router_config(memory_blocks=0)
    config = prefix_router_config(imbalance_threshold=3, memory_blocks=100, stats_period_s=0.5)
    assert config.get_request_router_class() is PrefixAffinityRouter
    assert config.request_router_kwargs == {"imbalance_threshold": 3, "memory_blocks": 100}
    assert config.request_routing_stats_period_s == 0.5


# -- the ledger and the index --------------------------------------------------------------------------------


def test_checkpoints() -> None:
    assert list(checkpoints(0)) == []
    assert list(checkpoints(1)) == [0]
    assert list(checkpoints(2)) == [0, 1]
    assert list(checkpoints(9)) == [0, 1, 3, 7, 8]
    assert list(checkpoints(16)) == [0, 1, 3, 7, 15]


def test_ledger_reports_newest_first_leading_blocks_last_to_go_and_stays_bounded() -> None:
    ledger = BlockLedger(capacity_blocks=4)
    a = prompt("t", 1, n_blocks=9)  # checkpoints 0, 1, 3, 7, 8
    ledger.served(a)
    assert ledger.stats(queue_len=2) == {"blocks": [a[i].hex() for i in (0, 1, 3, 7)], "queue": 2}
    b = prompt("u", 1, n_blocks=2)
    ledger.served(b)
    report = ledger.stats(queue_len=0)
    assert report["blocks"] == [b[0].hex(), b[1].hex(), a[0].hex(), a[1].hex()]
    assert json.loads(json.dumps(report)) == report
    assert parse_report(report).blocks == {b[0], b[1], a[0], a[1]}


def test_ledger_refuses_what_is_not_a_block_hash() -> None:
    ledger = BlockLedger()
    with pytest.raises(TypeError, match=r"blocks\[0\]"):
        ledger.served(("ab" * 16,))
    with pytest.raises(TypeError, match="tuple"):
        ledger.served(b"x" * 32)
    with pytest.raises(ValueError, match="queue_len"):
        ledger.stats(queue_len=-1)
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockLedger(capacity_blocks=0)


@pytest.mark.parametrize(
    ("stats", "field"),
    [
        ([], "dict"),
        ({"blocks": "ab"}, "list"),
        ({"blocks": ["ab"]}, r"blocks\[0\]"),
        ({"blocks": ["zz" * 32]}, "not hex"),
        ({"blocks": ["00" * 32] * 5000}, "more than"),
        ({"queue": "3"}, "queue"),
    ],
)
def test_parse_report_names_what_is_wrong(stats: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_report(stats)


def test_parse_report_of_a_replica_that_has_not_reported() -> None:
    report = parse_report({})
    assert report.blocks == frozenset() and report.queue is None


def test_index_stays_within_its_capacity_and_forgets_replicas() -> None:
    index = AffinityIndex(capacity_blocks=6)
    first, second = prompt("t", 1, n_blocks=4), prompt("t", 2, n_blocks=4)  # 3 checkpoints each: 0, 1, 3
    index.routed("r-a", first)
    index.routed("r-b", second)
    assert len(index) == 6
    assert index.holders(first, NAMES) == (4, ["r-a"])
    index.routed("r-c", prompt("t", 3, n_blocks=2))  # two more pairs: first's deepest ones go
    assert len(index) == 6
    assert index.holders(first, NAMES) == (1, ["r-a"])
    index.forget("r-b")
    assert len(index) == 3 and index.holders(second, NAMES) == (0, [])
    index.reported("r-d", frozenset(second))
    index.retain({"r-a", "r-c"})
    assert index.holders(second, NAMES) == (0, [])


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    keys = [prompt(f"t{i}", 1)[0] for i in range(200)]
    before = {k: rendezvous_order(k, NAMES)[0] for k in keys}
    after = {k: rendezvous_order(k, NAMES[:3])[0] for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == "r-d"}


# -- one deployment on a real local Ray ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_handle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp_dir = f"/tmp/ray-{uuid.uuid4().hex[:6]}"  # Ray's socket paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")

        # Defined here, so Ray ships the class by value: the test module is not importable in the replicas.
        @serve.deployment(
            num_replicas=2,
            ray_actor_options={"num_cpus": 0.25},
            request_router_config=prefix_router_config(stats_period_s=0.5),
        )
        class Model:
            def __init__(self) -> None:
                self._ledger = BlockLedger(capacity_blocks=64)

            def generate(self, request: SimpleNamespace) -> str:
                self._ledger.served(request.blocks)
                return serve.get_replica_context().replica_id.unique_id

            def ping(self) -> str:
                return serve.get_replica_context().replica_id.unique_id

            def record_routing_stats(self) -> dict:
                return self._ledger.stats(queue_len=0)

        yield serve.run(Model.bind(), name="router-test", route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_a_real_deployment_routes_by_prefix(model_handle) -> None:
    shared = [
        model_handle.generate.remote(request(prompt("tenant-a", 1, 2, 3, tail))).result() for tail in range(8)
    ]
    assert len(set(shared)) == 1

    fresh = [prompt(f"tenant-{i}", 4, 5) for i in range(16)]
    chosen = [model_handle.generate.remote(request(p)).result() for p in fresh]
    replicas = sorted(set(chosen))
    assert len(replicas) == 2
    assert chosen == [winner(p, replicas) for p in fresh]

    assert model_handle.ping.remote().result() in replicas
    reports = [model_handle.record_routing_stats.remote().result() for _ in range(4)]
    assert all(set(r) == {"blocks", "queue"} for r in reports)
    assert any(prompt("tenant-a", 1)[0].hex() in r["blocks"] for r in reports)
