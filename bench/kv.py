"""The KV prefix cache (serving/kv) measured: time to first token from cached prefixes, chunk reuse, the
Mooncake trace through two replicas' L1s under two routers, and what a cached token costs in memory.

    make bench-kv     (or: .venv/bin/python bench/kv.py [--parts a,b,c,d] [--quick] [--device cpu|cuda]
                                                          [--results DIR] [--json FILE])

The model is a Llama built locally from a ``LlamaConfig`` with random weights (fp32, nothing downloaded), served
by the production ``HFGenerator`` with a ``KvPrefixCache`` attached, on ``torch.set_num_threads(2)``. This
machine is shared and noisy, so each comparison runs its cases in the same run, interleaved in rounds (the case
that goes first rotates), and reports medians and their ratios.

a. ``kv-ttft``: time to first token (the prefill and the first token's pick, ``max_tokens=1``) of a
   ``--tokens``-token prompt (2,048): cold (no cache attached) against prompts whose first 50 % and 90 % (whole
   blocks) were cached by an earlier prompt, the blocks in L1 (the replica's memory), in L2 (a redis-server
   started here) or in L3 (disk), loaded on the request path (no prefetch) or prefetched while the request
   waits behind another request's prefill (a thread runs a cold prompt first; the measured request's time is
   from the end of that prefill to its own first token). Each L2/L3 case starts from an empty L1 (a cold
   replica sharing the tiers). Hidden fraction: ``hidden_ms / (prefetch_ms + load_ms)``. Targets: 90 % from L1
   >= 5x faster than cold; from L2 with prefetch >= 3x, with >= 80 % of the tier's load time hidden.
b. ``kv-chunks``: chunk reuse (``KvPlan.mode = "chunks"``): a chunk computed after one preamble, reused after
   another of a different length, for ``recompute_tokens`` k = 0, 16, 32: the chunk tokens reused, the KL
   divergence of the next-token distribution and the greedy tokens agreeing with a full recompute, and the
   prefill time against the full recompute's (saved: one less the median over rounds of the round's ratio).
   Random weights: their next-token distribution is nearly flat, so the agreement is a floor, not what a trained
   model shows.
c. ``kv-routing``: the Mooncake trace replayed through the production classes on a virtual clock, not a timed
   run of the model: two replicas, each a ``KvPrefixCache`` whose L1 (``DeviceBlocks``) holds tiny blocks keyed
   by the trace's hash ids, each serving one request at a time from its FIFO queue, a request's service time
   ``QueueModel(per_block=...)`` times the blocks it recomputes; requests arrive at the trace's timestamps
   scaled to ``--rate`` requests per second. Routing by the production affinity logic (``AffinityIndex`` and
   ``rendezvous_order`` as ``PrefixAffinityRouter`` ranks, with its imbalance threshold) against Ray's default
   (power of two choices on the queue lengths); eviction LRU (vLLM's policy), ``lookahead`` (over LRU) and
   ``lookahead`` over ``learned``, told the waiting requests (``DeviceBlocks.enqueue``/``dequeue`` from arrival
   to service start; each request runs through the cache's ``prefill`` at its start and ``store`` at its end,
   on an engine that runs no model, ``TraceEngine``), and Belady per replica (``controller.replay.belady_unit`` on the block accesses each replica saw under LRU).
   KV hit ratio: blocks reused / blocks requested. Targets: affinity >= 1.5x the default router's; queue-aware
   >= LRU + 10 % of the LRU -> Belady gap.
d. ``kv-memory``: bytes per cached token per dtype for the bench config, and an L1 filled past its bound through
   the model: used bytes (and the held tensors' own storage) against the capacity, and the evictions.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BENCH = Path(__file__).resolve().parent
TRACE = BENCH / "data" / "mooncake_synthetic_trace.jsonl"
SECRET = "bench-kv-secret-0123456789abcdef"
THREADS = 2
PARTS = {"a": "kv-ttft", "b": "kv-chunks", "c": "kv-routing", "d": "kv-memory"}
TARGETS = {"l1_speedup_90": 5.0, "l2_prefetch_speedup_90": 3.0, "l2_hidden_fraction": 0.8,
           "affinity_hit_ratio": 1.5, "queue_aware_gap_share": 0.1}
# The bench model: cold 2,048-token prefill well above 200 ms on two cores.
FULL_MODEL = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 1408, "vocab_size": 30522, "max_position_embeddings": 4096}
QUICK_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 1024}
DTYPES = ("float32", "float16", "bfloat16")


# -- figures -----------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def rotations(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The cases' order in each round: rotated by one each round, so a noisy spell falls on all of them."""
    names = list(names)
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


# -- the model and its cache -------------------------------------------------------------------------------


class Model:
    """The bench Llama behind the production ``HFGenerator`` (random weights from a ``LlamaConfig`` written to a
    folder, as a ``kind: hf`` model without weights loads), and how to make KV caches for it."""

    def __init__(self, work: Path, spec: dict[str, int], device: str, block_size: int) -> None:
        from transformers import LlamaConfig

        from evocache.serving import ByteTokenizer, ModelConfig
        from evocache.serving._model import HFGenerator
        from evocache.serving.kv._store import BlockGeometry

        folder = work / "model"
        LlamaConfig(**spec, torch_dtype="float32").save_pretrained(folder)
        self.spec = spec
        self.generator = HFGenerator(ModelConfig(kind="hf", id="bench-kv", path=str(folder), device=device),
                                     ByteTokenizer())
        self.device = device
        self.block_size = block_size
        self.geometry = BlockGeometry.of_model(self.generator.model, block_size)
        self.vocab = spec["vocab_size"]

    def cache(self, lower: dict[str, Any] | None = None, **config: Any) -> Any:
        from evocache.serving.kv import KvConfig, KvPrefixCache

        return KvPrefixCache(KvConfig(**config), self.geometry, extras=("bench-kv", "", "float32", ""),
                             device=self.device, lower=lower)

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(5, self.vocab) for _ in range(n)]


def plan(tiers: Sequence[str] = ("l1",), **extra: Any) -> Any:
    from evocache.controller import namespace_for
    from evocache.serving.kv import KvPlan

    return KvPlan(salt=str(namespace_for("bench")), tiers=tuple(tiers), **extra)


def params(max_tokens: int) -> Any:
    from evocache.serving import GenerationParams

    return GenerationParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=())


def first_token(generator: Any, ids: Sequence[int], kv_plan: Any = None, usage: Any = None) -> float:
    """Seconds to the first token (``max_tokens=1``: the prefill and the pick)."""
    t0 = time.perf_counter()
    out = list(generator.stream("", ids, params(1), kv_plan, usage))
    elapsed = time.perf_counter() - t0
    assert len(out) == 1
    return elapsed


def behind(generator: Any, blocker: Sequence[int], ids: Sequence[int], kv_plan: Any = None,
           usage: Any = None) -> float:
    """Seconds from the end of ``blocker``'s prefill (another request, cold, run first on a thread of its own)
    to ``ids``' first token: ``ids`` waits for the model meanwhile, as a replica's queue does."""
    ended: dict[str, float] = {}

    def first() -> None:
        list(generator.stream("", blocker, params(1), None, None))
        ended["at"] = time.perf_counter()

    thread = threading.Thread(target=first)
    thread.start()
    while not generator.engine.lock.locked():  # the blocker holds the model: the measured request will wait
        time.sleep(0.0005)
    list(generator.stream("", ids, params(1), kv_plan, usage))
    done = time.perf_counter()
    thread.join()
    return done - ended["at"]


class Redis:
    """The Redis that EVOCACHE_REDIS_URL names, else a throwaway redis-server on a free loopback port (the test
    suite's launcher, tests/_redis_server.py, as bench/overhead.py uses it)."""

    def __enter__(self) -> str:
        self.server = None
        if os.environ.get("EVOCACHE_REDIS_URL"):
            return os.environ["EVOCACHE_REDIS_URL"]
        sys.path.insert(0, str(BENCH.parent / "tests"))
        from _redis_server import RedisServer

        try:
            self.server = RedisServer().start()
        except FileNotFoundError as exc:
            sys.exit(f"bench/kv.py part a needs redis-server or EVOCACHE_REDIS_URL: {exc}")
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()


# -- a. time to first token --------------------------------------------------------------------------------


def part_ttft(model: Model, work: Path, tokens: int, rounds: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from evocache.controller import DiskConfig, RedisConfig, StoreConfig, build_runtime
    from evocache.serving.kv import KvUsage

    generator, bs = model.generator, model.block_size
    rng = random.Random(1)
    base = model.tokens(rng, tokens)  # the shared document: its blocks are in L1, L2 and L3
    hits = {0.5: tokens // 2 // bs * bs, 0.9: int(tokens * 0.9) // bs * bs}
    l1_bytes = 4 << 30
    with Redis() as url:
        runtime = build_runtime(StoreConfig(redis=RedisConfig(url=url, secret=SECRET, timeout_s=10.0),
                                            disk=DiskConfig(path=str(work / "l3"))))
        lower = {name: tier for name, tier in runtime.store.tiers.items() if name in ("l2", "l3")}
        warm = model.cache(lower, l1_bytes=l1_bytes, eviction="lru", prefetch=False)
        generator.attach_kv(warm)
        written = KvUsage()
        first_token(generator, base, plan(("l1", "l2", "l3")), written)
        cases: dict[str, dict[str, Any]] = {"cold": {"tier": None, "hit": 0.0, "prefetch": False, "queued": False},
                                            "cold-queued": {"tier": None, "hit": 0.0, "prefetch": False,
                                                            "queued": True}}
        for hit in hits:
            cases[f"l1-{hit:g}"] = {"tier": "l1", "hit": hit, "prefetch": False, "queued": False}
            for tier in ("l2", "l3"):
                cases[f"{tier}-{hit:g}"] = {"tier": tier, "hit": hit, "prefetch": False, "queued": False}
                cases[f"{tier}-{hit:g}-prefetch"] = {"tier": tier, "hit": hit, "prefetch": True, "queued": True}
        samples: dict[str, list[float]] = {name: [] for name in cases}
        usages: dict[str, list[Any]] = {name: [] for name in cases}

        def measure(name: str) -> None:
            case = cases[name]
            fresh = model.tokens(rng, tokens - hits.get(case["hit"], 0))
            ids = base[: hits.get(case["hit"], 0)] + fresh
            usage = KvUsage()
            if case["tier"] is None:
                generator.attach_kv(None)
                kv_plan, cache = None, None
            elif case["tier"] == "l1":
                cache, kv_plan = warm, plan(("l1",))
            else:  # a cold replica: empty L1, the same L2/L3
                cache = model.cache({case["tier"]: lower[case["tier"]]}, l1_bytes=l1_bytes, eviction="lru",
                                    prefetch=case["prefetch"])
                kv_plan = plan(("l1", case["tier"]))
            if cache is not None:
                generator.attach_kv(cache)
            if case["queued"]:
                seconds = behind(generator, model.tokens(rng, tokens), ids, kv_plan, usage)
            else:
                seconds = first_token(generator, ids, kv_plan, usage)
            if cache is not None and cache is not warm:
                cache.close()
            samples[name].append(seconds)
            usages[name].append(usage)

        for name in cases:  # a warm-up round, not counted: first calls pay for kernels, connections, pages
            measure(name)
        for values in (*samples.values(), *usages.values()):
            values.clear()
        for order in rotations(list(cases), rounds):
            for name in order:
                measure(name)
        generator.attach_kv(None)
        warm.close()
        runtime.close()
    cold = median(samples["cold"])
    cold_queued = median(samples["cold-queued"])
    rows = []
    for name, case in cases.items():
        ms = median(samples[name]) * 1e3
        us = usages[name]
        load = median([u.load_ms for u in us])
        prefetch = median([u.prefetch_ms for u in us])
        hidden = median([u.hidden_ms for u in us])
        moved = [u.load_ms + u.prefetch_ms for u in us]
        fraction = (sum(u.hidden_ms for u in us) / sum(moved)) if case["tier"] in ("l2", "l3") and sum(moved) else None
        rows.append({"case": name, **case, "samples": len(samples[name]),
                     "ttft_ms": ms, "ttft_ms_all": [s * 1e3 for s in samples[name]],
                     "speedup": cold * 1e3 / ms,
                     "speedup_queued": (cold_queued * 1e3 / ms) if case["queued"] else None,
                     "reused_tokens": us[-1].cached_tokens, "reused": dict(us[-1].reused),
                     "recomputed_tokens": us[-1].recomputed if case["tier"] else tokens,
                     "load_ms": load, "prefetch_ms": prefetch, "hidden_ms": hidden, "hidden_fraction": fraction})
    geometry = model.geometry
    context = {"tokens": tokens, "rounds": rounds, "block_size": bs, "model": {"family": "llama", **model.spec},
               "dtype": "float32", "weights": "random", "device": model.device, "threads": THREADS,
               "block_bytes": geometry.block_bytes(), "cold_ms": cold * 1e3, "cold_queued_ms": cold_queued * 1e3,
               "hit_tokens": {f"{h:g}": n for h, n in hits.items()}, "l1_eviction": "lru",
               "stored_blocks": written.stored_blocks, "l2": "redis-server on 127.0.0.1", "l3": "disk (tmpfs or "
               "local disk of the temporary directory)", "targets": {k: TARGETS[k] for k in
                                                                     ("l1_speedup_90", "l2_prefetch_speedup_90",
                                                                      "l2_hidden_fraction")}}
    return rows, context


# -- b. chunk reuse ----------------------------------------------------------------------------------------


def kl(p_logits: Any, q_logits: Any) -> float:
    """KL(p || q) of the next-token distributions."""
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def part_chunks(model: Model, tokens: int, rounds: int, ks: Sequence[int],
                generated: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch

    from evocache.serving.kv import KvUsage

    generator, bs = model.generator, model.block_size
    rng = random.Random(2)
    # Preamble A or B (of different lengths), the same chunk C (whole blocks), then a question.
    b_len = max(bs, tokens // 16 // bs * bs + bs // 2)
    q_len = max(bs, tokens // 16)
    c_len = (tokens - b_len - q_len) // bs * bs
    a_len = b_len + bs + bs // 2  # another length and another block alignment
    # Each prompt its own question: only the chunk is shared (a question of whole blocks would be reused too).
    a, b, c, q1, q2 = (model.tokens(rng, n) for n in (a_len, b_len, c_len, q_len, q_len))
    first, second = a + c + q1, b + c + q2
    first_chunks, second_chunks = (0, a_len, a_len + c_len), (0, b_len, b_len + c_len)

    def chunk_plan(k: int, chunks: tuple[int, ...]) -> Any:
        return plan(("l1",), mode="chunks", recompute_tokens=k, chunks=chunks)

    def prefill(ids: Sequence[int], kv_plan: Any = None, usage: Any = None) -> tuple[float, Any]:
        t0 = time.perf_counter()
        with torch.no_grad():
            _, logits = generator._prefill(list(ids), kv_plan, usage)
        return time.perf_counter() - t0, logits[0, -1]

    def reused(k: int) -> None:
        """A fresh cache holding C's blocks as the first prompt left them."""
        if generator.kv is not None:
            generator.kv.close()
        generator.attach_kv(model.cache(l1_bytes=4 << 30, eviction="lru", prefetch=False))
        prefill(first, chunk_plan(k, first_chunks), KvUsage())

    names = ["full", *(f"k={k}" for k in ks)]
    samples: dict[str, list[float]] = {name: [] for name in names}
    logits: dict[str, Any] = {}
    usages: dict[str, Any] = {}
    for n, order in enumerate([names, *rotations(names, rounds)]):
        for name in order:
            if name == "full":
                if generator.kv is not None:
                    generator.kv.close()
                generator.attach_kv(None)
                seconds, out = prefill(second)
            else:
                k = int(name.removeprefix("k="))
                reused(k)
                usage = KvUsage()
                seconds, out = prefill(second, chunk_plan(k, second_chunks), usage)
                usages[name] = usage
            if n:  # the first pass warms up, not counted
                samples[name].append(seconds)
            logits[name] = out
    generator.attach_kv(None)
    expected_tokens = list(generator.stream("", second, params(generated)))
    full_ms = median(samples["full"]) * 1e3
    rows = [{"case": "full", "recompute_tokens": None, "chunk_tokens": 0, "kl": 0.0, "max_dlogit": 0.0,
             "greedy_agreeing": len(expected_tokens), "greedy_same": len(expected_tokens),
             "prefill_ms": full_ms, "prefill_ms_all": [s * 1e3 for s in samples["full"]], "saved": 0.0,
             "chunk_fallback": ""}]
    for k in ks:
        name = f"k={k}"
        reused(k)
        got = list(generator.stream("", second, params(generated), chunk_plan(k, second_chunks), KvUsage()))
        agree = next((i for i, (x, y) in enumerate(zip(got, expected_tokens, strict=False)) if x != y), len(got))
        ms = median(samples[name]) * 1e3
        # Each round's reuse against the full recompute of the same round: a noisy spell of this shared
        # machine falls on both sides of a ratio, less so on the medians of the sides apart.
        ratios = [r / f for r, f in zip(samples[name], samples["full"], strict=True)]
        usage = usages[name]
        rows.append({"case": name, "recompute_tokens": k, "chunk_tokens": usage.reused.get("chunk", 0),
                     "kl": kl(logits["full"], logits[name]),
                     "max_dlogit": float((logits[name] - logits["full"]).abs().max()),
                     "greedy_agreeing": agree, "greedy_same": sum(x == y for x, y in zip(got, expected_tokens,
                                                                                        strict=False)),
                     "prefill_ms": ms, "prefill_ms_all": [s * 1e3 for s in samples[name]],
                     "ratio_rounds": ratios, "saved": 1 - median(ratios), "chunk_fallback": usage.chunk_fallback})
    generator.attach_kv(None)
    context = {"tokens": len(second), "rounds": rounds, "block_size": bs, "preamble_first": a_len,
               "preamble_second": b_len, "chunk": c_len, "question": q_len, "generated": generated,
               "model": {"family": "llama", **model.spec}, "weights": "random", "device": model.device,
               "threads": THREADS, "recompute_fraction": 0.0}
    return rows, context


# -- c. the Mooncake trace through two replicas ------------------------------------------------------------


def trace_requests(limit: int | None = None) -> list[tuple[float, tuple[int, ...]]]:
    """(arrival in seconds, hash ids) of the trace's requests, in order."""
    requests = []
    with TRACE.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            requests.append((record["timestamp"] / 1000.0, tuple(record["hash_ids"])))
            if limit is not None and len(requests) >= limit:
                break
    return requests


def router_hash(hash_id: int) -> bytes:
    """The 32-byte block hash a router sees for a trace hash id (each id already names its whole prefix)."""
    return hashlib.blake2b(hash_id.to_bytes(8, "little"), digest_size=32, person=b"bench.kv").digest()


class TraceEngine:
    """The engine of a replica on the virtual clock (``serving.kv.KvEngine``): it runs no model; a forward
    appends zero keys and values of the 1-layer, 1-head, 1-dim geometry, so the cache's ``prefill`` and
    ``store`` build, fill and keep real blocks as they do for a model."""

    model_config = None

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def forward(self, ids: Sequence[int], cache: Any, positions: Any = None, mask: Any = None) -> Any:
        import torch

        cache.update(torch.zeros(1, 1, len(ids), 1), torch.zeros(1, 1, len(ids), 1), 0)
        return SimpleNamespace(logits=None)

    def rope_shift(self) -> Any:
        from evocache.serving.kv import RopeShiftUnsupported

        raise RopeShiftUnsupported("a replica on the virtual clock runs no model to shift keys of")


class Replica:
    """One replica on the virtual clock: a production ``KvPrefixCache`` (L1 only, blocks of 1 token of a
    1-layer, 1-head, 1-dim float32 model: 8 bytes each) on a ``TraceEngine``, and a FIFO queue serving one
    request at a time."""

    def __init__(self, name: str, capacity_blocks: int, policy: str) -> None:
        from evocache.controller import make_eviction_policy
        from evocache.serving.kv import KvConfig, KvPrefixCache
        from evocache.serving.kv._store import BlockGeometry

        geometry = BlockGeometry(layers=1, kv_heads=1, head_dim=1, block_size=1, dtype="float32")
        eviction = "lookahead" if policy.startswith("lookahead") else policy
        self.kv = KvPrefixCache(KvConfig(l1_bytes=capacity_blocks * geometry.block_bytes(), eviction=eviction,
                                         prefetch=False), geometry, extras=("bench-kv-trace",), device="cpu")
        if policy == "lookahead:learned":
            # KvConfig names a registry policy without options; its base is LRU. The same registry call with
            # the base the brief's queue-aware row needs.
            self.kv.l1.policy = make_eviction_policy("lookahead", base="learned", capacity=self.kv.l1.capacity)
        self.engine = TraceEngine()
        self.name = name
        self.queue: list[tuple[int, float, tuple[int, ...], int]] = []  # (request, arrival, ids, ticket)
        self.busy = False
        self.served = 0
        self.accesses: list[tuple[int, tuple[int, ...]]] = []

    def in_flight(self) -> int:
        return len(self.queue) + self.busy


def replay_routing(requests: Sequence[tuple[float, tuple[int, ...]]], router: str, policy: str,
                   capacity_blocks: int, per_block_s: float, rate_scale: float, seed: int = 0,
                   threshold: int = 10, replicas: int = 2) -> dict[str, Any]:
    """One (router, eviction policy) run over ``requests`` on a virtual clock; the row of figures."""
    from evocache.controller.replay import QueueModel
    from evocache.serving._affinity import AffinityIndex, rendezvous_order
    from evocache.serving.kv import KvUsage

    model = QueueModel(per_block=per_block_s)
    names = [f"replica-{i}" for i in range(replicas)]
    replicas = {name: Replica(name, capacity_blocks, policy) for name in names}
    index = AffinityIndex()
    rng = random.Random(seed)
    kv_plan = plan(("l1",))
    events: list[tuple[float, int, str, Any]] = []
    for i, (t, ids) in enumerate(requests):
        heapq.heappush(events, (t * rate_scale, i, "arrive", ids))
    seq = len(requests)
    requested = reused = 0
    waits: list[float] = []
    waiting_at_start: list[int] = []
    by_prefix = 0

    def route(ids: tuple[int, ...]) -> str:
        blocks = tuple(router_hash(h) for h in ids)
        loads = {name: replicas[name].in_flight() for name in names}
        if router == "default" or not blocks or max(loads.values()) - min(loads.values()) > threshold:
            pair = rng.sample(names, k=min(2, len(names)))  # Ray: two at random, the shorter queue of them
            best = min(loads[n] for n in pair)
            chosen = rng.choice([n for n in pair if loads[n] == best])
        else:
            nonlocal by_prefix
            by_prefix += 1
            _, holders = index.holders(blocks, set(names))
            chosen = (holders or rendezvous_order(blocks[0], names))[0]
        if router == "affinity" and blocks:
            index.routed(chosen, blocks)
        return chosen

    def start(replica: Replica, now: float) -> None:
        nonlocal seq, requested, reused
        req, arrived, ids, ticket = replica.queue.pop(0)
        waiting_at_start.append(len(replica.queue))
        waits.append(now - arrived)
        replica.busy = True
        # The trace's hash ids are the blocks' hashes; one token more than blocks, so every block is usable.
        # The request waited in the queue since it arrived: prefill takes it out once it holds the model.
        filled = replica.kv.prefill(replace(kv_plan, hashes=ids), range(len(ids) + 1), KvUsage(), replica.engine,
                                    ticket=ticket)
        found = filled.first_block
        requested += len(ids)
        reused += found
        replica.accesses.append((req, ids))
        seq += 1
        heapq.heappush(events, (now + model.service_time(len(ids) - found), seq, "done", (replica.name, filled)))

    while events:
        now, order, kind, data = heapq.heappop(events)
        if kind == "arrive":
            ids = data
            replica = replicas[route(ids)]
            ticket = replica.kv.l1.enqueue(ids)
            replica.queue.append((order, now, ids, ticket))
            if not replica.busy:
                start(replica, now)
        else:
            name, filled = data
            replica = replicas[name]
            replica.kv.store(filled)
            replica.busy = False
            replica.served += 1
            if replica.queue:
                start(replica, now)
    for replica in replicas.values():
        replica.kv.close()
    return {"router": router, "policy": policy, "requests": len(requests), "blocks_requested": requested,
            "blocks_reused": reused, "kv_hit_ratio": reused / requested if requested else 0.0,
            "routed_by_prefix": by_prefix if router == "affinity" else None,
            "mean_waiting": sum(waiting_at_start) / len(waiting_at_start) if waiting_at_start else 0.0,
            "wait_p50_s": quantile(waits, 0.5), "wait_p99_s": quantile(waits, 0.99),
            "per_replica": [replicas[n].served for n in names],
            "evictions": [replicas[n].kv.l1.evictions for n in names],
            "l1_used_bytes": [replicas[n].kv.l1.used for n in names],
            "_accesses": {n: replicas[n].accesses for n in names}}


def belady_row(router: str, accesses: dict[str, list[tuple[int, tuple[int, ...]]]],
               capacity_blocks: int) -> dict[str, Any]:
    """Belady's optimum per replica on the block accesses it saw, in its service order, summed."""
    from evocache.controller.replay import Access, belady_unit

    hits = total = 0
    for seq in accesses.values():
        trace = [Access(float(i), str(h), 1, req=req, pos=p) for i, (req, ids) in enumerate(seq)
                 for p, h in enumerate(ids)]
        if not trace:
            continue
        result = belady_unit(trace, capacity_blocks)
        hits += result.hits
        total += result.requests
    return {"router": router, "policy": "belady", "requests": None, "blocks_requested": total, "blocks_reused": hits,
            "kv_hit_ratio": hits / total if total else 0.0, "routed_by_prefix": None, "mean_waiting": None,
            "wait_p50_s": None, "wait_p99_s": None, "per_replica": [len(s) for s in accesses.values()],
            "evictions": None, "l1_used_bytes": None}


def part_routing(limit: int | None, size: float, utilisations: Sequence[float],
                 policies: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    requests = trace_requests(limit)
    distinct = len({h for _, ids in requests for h in ids})
    blocks = sum(len(ids) for _, ids in requests)
    span = requests[-1][0] - requests[0][0]
    capacity = max(1, round(size * distinct))
    # Rate: the trace's arrivals as they are; the per-block service time gives each replica the utilisation
    # ``utilisation`` if nothing were reused (reuse then lowers it).
    replicas = 2
    rows = []
    for utilisation in utilisations:
        per_block = utilisation * replicas * span / blocks
        for router in ("affinity", "default"):
            for policy in policies:
                t0 = time.perf_counter()
                row = replay_routing(requests, router, policy, capacity, per_block, rate_scale=1.0)
                accesses = row.pop("_accesses")
                row = {"utilisation": utilisation, "per_block_ms": per_block * 1e3, **row,
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(f"   U={utilisation:g} {router} {policy}: {row['kv_hit_ratio']:.4f} ({row['seconds']:.0f} s)",
                      flush=True)
                if policy == "lru":
                    rows.append({"utilisation": utilisation, "per_block_ms": per_block * 1e3,
                                 **belady_row(router, accesses, capacity)})
    context = {"trace": "bench/data/mooncake_synthetic_trace.jsonl", "requests": len(requests),
               "distinct_blocks": distinct, "blocks": blocks, "replicas": replicas, "l1_size": size,
               "l1_capacity_blocks": capacity, "arrival_rate_rps": len(requests) / span if span else None,
               "span_s": span, "utilisations_without_reuse": list(utilisations),
               "imbalance_threshold": 10, "clock": "virtual: a replay of the production classes, not a timed run "
                                                 "of the model",
               "belady": "per replica, on the block accesses it saw under LRU, in its service order (a per-access "
                         "optimum: a bound on the policies' reuse of leading blocks)",
               "targets": {k: TARGETS[k] for k in ("affinity_hit_ratio", "queue_aware_gap_share")}}
    return rows, context


# -- d. memory ---------------------------------------------------------------------------------------------


def part_memory(model: Model, tokens: int, prompts: int, capacity_blocks: float
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from evocache.serving.kv import KvUsage
    from evocache.serving.kv._store import BlockGeometry

    g = model.geometry
    rows: list[dict[str, Any]] = []
    for dtype in DTYPES:
        geometry = BlockGeometry(g.layers, g.kv_heads, g.head_dim, g.block_size, dtype)
        rows.append({"kind": "per-token", "dtype": dtype, "bytes_per_token": geometry.block_bytes() // g.block_size,
                     "block_bytes": geometry.block_bytes(), "tokens_per_gib": (1 << 30) // (geometry.block_bytes()
                                                                                     // g.block_size)})
    capacity = int(capacity_blocks * g.block_bytes())
    cache = model.cache(l1_bytes=capacity, eviction="lru", prefetch=False)
    generator = model.generator
    generator.attach_kv(cache)
    rng = random.Random(4)
    stored = 0
    most = 0
    for _ in range(prompts):
        usage = KvUsage()
        first_token(generator, model.tokens(rng, tokens), plan(("l1",)), usage)
        stored += usage.stored_blocks
        most = max(most, cache.l1.used)
    held = [cache.l1.get(key) for key in cache.held()]
    storage = sum(t.untyped_storage().nbytes() for block in held if block is not None for pair in block
                  for t in pair)
    generator.attach_kv(None)
    cache.close()
    rows.append({"kind": "bound", "dtype": "float32", "capacity_bytes": capacity, "used_bytes": cache.l1.used,
                 "max_used_bytes": most, "held_blocks": len(held), "held_storage_bytes": storage,
                 "stored_blocks": stored, "evictions": cache.l1.evictions,
                 "within": cache.l1.used <= capacity and most <= capacity and storage <= capacity})
    context = {"model": {"family": "llama", **model.spec}, "block_size": g.block_size, "layers": g.layers,
               "kv_heads": g.kv_heads, "head_dim": g.head_dim, "prompts": prompts, "prompt_tokens": tokens,
               "capacity_blocks": capacity_blocks, "device": model.device}
    return rows, context


# -- the command -------------------------------------------------------------------------------------------


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c,d", help="which parts to run, comma-separated (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, 256-token prompts, one round, the trace's first 300 requests (a test's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the model's device (cpu)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds in parts a and b (default: 7, --quick: 1)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="write a result file per part here, for bench/report.py (make bench-kv passes "
                             "bench/results)")
    parser.add_argument("--json", type=Path, help="also write every part's rows and context here")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(PARTS)}")
    args.parts = [p for p in PARTS if p in parts]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 7
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
    return args


Done = tuple[list[dict[str, Any]], dict[str, Any]]


def run(args: argparse.Namespace, finished: Callable[[str, Done], None]) -> None:
    import torch

    torch.set_num_threads(THREADS)
    quick = args.quick
    tokens = 256 if quick else 2048
    with tempfile.TemporaryDirectory(prefix="evc-bench-kv-") as work:
        model = None
        if any(p in args.parts for p in "abd"):
            model = Model(Path(work), QUICK_MODEL if quick else FULL_MODEL, args.device, 16)
        for part in args.parts:
            t0 = time.perf_counter()
            if part == "a":
                done = part_ttft(model, Path(work), tokens, args.rounds)
            elif part == "b":
                done = part_chunks(model, tokens, args.rounds, (0, 16, 32), 8 if quick else 16)
            elif part == "c":
                done = part_routing(300 if quick else None, 0.05, (0.8,) if quick else (0.8, 1.0),
                                    ("lru", "lookahead") if quick else ("lru", "lookahead", "lookahead:learned"))
            else:
                done = part_memory(model, tokens, 3 if quick else 4, 1.5 * tokens / 16 + 0.5)
            print(f"part {part} ({PARTS[part]}) took {time.perf_counter() - t0:.0f} s", flush=True)
            finished(PARTS[part], done)


def main(argv: Sequence[str] | None = None) -> None:
    from _results import part_sink  # bench/_results.py: this script's directory is on sys.path

    args = options(argv)
    run(args, part_sink(args.results, args.json, argv))


if __name__ == "__main__":
    main()
