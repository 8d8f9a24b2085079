"""The serving path on a real local Ray Serve: evocache's replicas and ingress against bare Ray Serve.

    make bench-serving    (or: .venv/bin/python bench/serving.py [--parts a,b,c,d] [--quick] [--duration S]
                                                                [--results DIR] [--json FILE])

One Ray and one Serve for every part; each part deploys its applications by name and deletes them after. This
machine is shared and noisy, so every comparison runs its two sides in the same run, interleaved in rounds
(the side that goes first alternates), and reports p50 and p99 of each and their ratio.

a. ``serving-hit``: an exact hit against bare Ray Serve returning the same payload. Over a handle: the model
   deployment's ``complete`` with a prepared ``GenerateRequest`` that hits, against an echo deployment's
   ``complete`` returning the hit's own ``Completion``. Over HTTP (Serve's proxy on 127.0.0.1): the ingress's
   ``/v1/completions`` hit against a bare FastAPI-ingress echo deployment returning the hit's JSON body, alone
   and calling an echo model deployment through a handle as evocache's ingress does. Target: p50 ratio <= 1.2.
b. ``serving-miss``: every request new (unique prompts) through the model deployment over a handle, against a
   bare deployment calling the same 50 ms model and wrapping its answer alike. Target: overhead <= 5 %.
c. ``serving-affinity``: the prefix-affinity router against Ray's default router (the same application with
   ``DeploymentConfig(router=False)``), 2 model replicas each, on the Mooncake trace's requests in order (each
   hash id a block of ``block_size`` characters, so equal leading hash ids are equal leading blocks), sent by
   8 clients over HTTP, in chunks alternating between the two applications. Per router: the replica-local L1
   hit ratio (L1 hits / requests identical to an earlier one of the trace), the affinity share (of each
   request's blocks that an earlier request carried, the share last answered by the replica this one went to,
   read from ``x-evocache-replica``), p50/p99, and the queue spread: at each request's send time, the largest
   minus the smallest number of requests in flight per replica as the client saw them (sent and not answered,
   attributed to the replica that answered them). Target: affinity share >= 1.5x the default router's, queue
   spread within the router's imbalance threshold.
d. ``serving-load``: ``--duration`` seconds (60) of 32 clients over HTTP, half repeats of 256 prompts and half
   fresh prompts, on 2 replicas of an instant model: requests, errors, throughput, p50/p99, and each model
   replica's resident set (``VmRSS`` of the process whose command line is ``ray::ServeReplica:<app>:model``)
   at the start, after the first 10 s and at the end. Target: no errors, RSS growth < 10 % after 10 s.

Nothing here needs Redis: L1 is each replica's memory, events go to the in-memory ring (the defaults), the
policy comes from a file store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _timing import compared, interleaved, latency, quantile  # bench/_timing.py, beside this script

BENCH = Path(__file__).resolve().parent
TRACE = BENCH / "data" / "mooncake_synthetic_trace.jsonl"
MODEL_ID = "bench"
TENANT, TIER = "bench", "pro"
API_KEY = "sk-bench-serving-key-0001"
BLOCK_SIZE = 16
REPLICA_CPUS = 0.25
MAX_TOKENS = 16
POLICY = """\
policy: bench-serving
version: 1
defaults: {ttl: 1h, tiers: [l1]}
rules:
  - name: sampled
    when: temperature > 0
    cache: bypass
  - name: all
    when: true
"""
TARGETS = {"hit_p50_ratio": 1.2, "miss_p50_ratio": 1.05, "affinity_share_ratio": 1.5}
PARTS = {"a": "serving-hit", "b": "serving-miss", "c": "serving-affinity", "d": "serving-load"}


# -- the applications --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Bench:
    """One local Ray and Serve, the key file, the policy store, and what the parts share."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # Ray's socket paths must stay short.
        self.ray_dir = Path("/tmp") / f"evc-bench-{uuid.uuid4().hex[:6]}"
        keys = work / "keys.yaml"
        keys.write_text(f"keys:\n  - key: {API_KEY}\n    tenant: {TENANT}\n    tier: {TIER}\n")
        keys.chmod(0o600)
        self.keys = keys
        from evocache.controller import PolicyStoreConfig, open_policy_store

        self.policy_store_config = PolicyStoreConfig(directory=str(work / "policies"), poll_interval_s=1.0)
        self.policy_store = open_policy_store(self.policy_store_config)
        self.policy_store.apply(POLICY)

    def __enter__(self) -> Bench:
        env = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
        os.environ.update(env)  # loopback only: Ray's token authentication off, as in the test suite
        # Ray's workers import the bench's models and baselines from bench/.
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
        import ray
        from ray import serve

        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(self.ray_dir),
                 runtime_env={"env_vars": env})
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        self.policy_store.close()
        shutil.rmtree(self.ray_dir, ignore_errors=True)

    def config(self, model: str, *, replicas: int = 1, router: bool = True) -> Any:
        from evocache.controller import StoreConfig
        from evocache.serving import ApiKeysConfig, DeploymentConfig, ModelConfig, ServerSpec, ServingConfig

        return ServingConfig(
            server=ServerSpec(
                model=ModelConfig(kind="callable", id=MODEL_ID, callable=f"_serving_models:{model}"),
                store=StoreConfig(redis=None), policy_store=self.policy_store_config, block_size=BLOCK_SIZE),
            api_keys=ApiKeysConfig(file=str(self.keys)),
            deployment=DeploymentConfig(replicas=replicas, num_cpus=REPLICA_CPUS,
                                        ingress_num_cpus=REPLICA_CPUS, router=router),
            host="127.0.0.1", port=self.port,
        )

    def deploy(self, name: str, config: Any) -> str:
        """Deploy evocache's application as ``name`` under ``/name``; returns its base URL."""
        from ray import serve

        from evocache.serving import build_app

        serve.run(build_app(config), name=name, route_prefix=f"/{name}")
        self.wait_healthy(name)
        return f"{self.base}/{name}"

    def wait_healthy(self, name: str, timeout: float = 90.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.base}/{name}/healthz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"application {name!r} did not become healthy within {timeout:g} s")
            time.sleep(0.2)


def generate_request(prompt: str, *, max_tokens: int = MAX_TOKENS) -> Any:
    """What evocache's ingress hands the model deployment for ``prompt`` (the bytes tokenizer's token ids)."""
    from evocache.controller import block_hashes, namespace_for
    from evocache.serving import GenerateRequest, ModelConfig, ServerSpec

    ids = tuple(prompt.encode("utf-8"))
    # What the ingress binds a block's hash to: the replicas' extras (model, revision, ...).
    extras = ServerSpec(model=ModelConfig(kind="callable", id=MODEL_ID, callable="_serving_models:instant_model"),
                        block_size=BLOCK_SIZE).block_extras()
    blocks = block_hashes(ids, BLOCK_SIZE, extras, str(namespace_for(TENANT)))
    return GenerateRequest(request_id="cmpl-" + uuid.uuid4().hex, endpoint="completions", model=MODEL_ID,
                           prompt=prompt, input_ids=ids, blocks=blocks, tenant=TENANT, tenant_tier=TIER,
                           max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=(),
                           created=int(time.time()))


def body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


HEADERS = {"authorization": f"Bearer {API_KEY}"}


# -- a: an exact hit ---------------------------------------------------------------------------------------


def part_hit(bench: Bench, rounds: int, per_round: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import httpx
    from _serving_models import EchoIngress, EchoModel
    from ray import serve

    url = bench.deploy("evocache", bench.config("model_50ms"))
    model = serve.get_deployment_handle("model", app_name="evocache")
    prompt = "Which plan suits a team of five that shares one workspace and needs single sign-on? " * 3
    request = generate_request(prompt)
    assert model.complete.remote(request).result().decision.outcome == "miss"
    hit = model.complete.remote(request).result()
    if hit.decision.outcome != "hit":
        raise RuntimeError(f"the prepared request did not hit: {hit.decision}")
    client = httpx.Client(timeout=30, headers=HEADERS)
    answered = client.post(f"{url}/v1/completions", json=body(prompt))
    answered.raise_for_status()
    if answered.headers["x-evocache-outcome"] != "hit":
        raise RuntimeError(f"the HTTP request did not hit: {dict(answered.headers)}")
    echo_headers = {k: v for k, v in answered.headers.items() if k.startswith("x-evocache-")}

    ingress = serve.deployment(EchoIngress, name="echo-ingress", ray_actor_options={"num_cpus": REPLICA_CPUS},
                               max_ongoing_requests=1000)
    echo_model = serve.deployment(EchoModel, name="echo-model", ray_actor_options={"num_cpus": REPLICA_CPUS})
    serve.run(ingress.bind(answered.json(), echo_headers), name="echo", route_prefix="/echo")
    serve.run(ingress.bind(answered.json(), echo_headers, echo_model.bind(hit)), name="echo2",
              route_prefix="/echo2")
    echo = serve.get_deployment_handle("echo-model", app_name="echo2")
    assert echo.complete.remote(request).result() == hit

    def http(base: str) -> Callable[[], object]:
        def call() -> None:
            response = client.post(f"{base}/v1/completions", json=body(prompt))
            if response.status_code != 200 or response.headers.get("x-evocache-outcome") != "hit":
                raise RuntimeError(f"{base}: {response.status_code} {response.headers}")
        return call

    def handle(h: Any) -> Callable[[], object]:
        return lambda: h.complete.remote(request).result()

    sides = {"evocache-handle": handle(model), "echo-handle": handle(echo), "evocache-http": http(url),
             "echo-http": http(f"{bench.base}/echo"), "echo2-http": http(f"{bench.base}/echo2")}
    interleaved(sides, 1, max(per_round // 5, 3))  # warm connections and replicas
    samples = interleaved(sides, rounds, per_round)
    client.close()
    target = TARGETS["hit_p50_ratio"]
    rows = [
        compared("hit_handle", "handle", samples["evocache-handle"], samples["echo-handle"],
                 "echo deployment returning the hit's Completion", target),
        compared("hit_http", "http", samples["evocache-http"], samples["echo-http"],
                 "FastAPI-ingress echo deployment returning the hit's JSON body", target),
        compared("hit_http_two_hops", "http", samples["evocache-http"], samples["echo2-http"],
                 "FastAPI-ingress echo deployment calling an echo model deployment through a handle", target),
    ]
    stats = model.complete.remote(request).result()
    assert stats.decision.tier == "l1"
    for name in ("echo", "echo2", "evocache"):
        serve.delete(name)
    context = {"rounds": rounds, "per_round": per_round, "replicas": 1, "prompt_chars": len(prompt),
               "answer_chars": len(hit.text), "body_bytes": len(answered.content), "tier": "l1"}
    return rows, context


# -- b: the miss path --------------------------------------------------------------------------------------


def part_miss(bench: Bench, rounds: int, per_round: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from _serving_models import MODEL_S, BareModel
    from ray import serve

    bench.deploy("evocache", bench.config("model_50ms"))
    model = serve.get_deployment_handle("model", app_name="evocache")
    bare_deployment = serve.deployment(BareModel, name="bare-model",
                                       ray_actor_options={"num_cpus": REPLICA_CPUS})
    serve.run(bare_deployment.bind(), name="bare", route_prefix=None)
    bare = serve.get_deployment_handle("bare-model", app_name="bare")
    outcomes: list[str] = []
    counter = iter(range(10**9))

    def fresh() -> Any:
        return generate_request(f"{uuid.uuid4().hex} question {next(counter)}: how do I rotate an API key "
                                "without downtime for the services that use it? " * 2)

    def ours() -> None:
        outcomes.append(model.complete.remote(fresh()).result().decision.outcome)

    def theirs() -> None:
        bare.complete.remote(fresh()).result()

    sides = {"evocache": ours, "bare": theirs}
    interleaved(sides, 1, 3)
    outcomes.clear()
    samples = interleaved(sides, rounds, per_round)
    if set(outcomes) != {"miss"}:
        raise RuntimeError(f"the miss path was not all misses: {sorted(set(outcomes))}")
    serve.delete("bare")
    serve.delete("evocache")
    row = compared("miss_handle", "handle", samples["evocache"], samples["bare"],
                   "bare deployment calling the same 50 ms model", TARGETS["miss_p50_ratio"])
    row["misses"] = len(outcomes)
    return [row], {"rounds": rounds, "per_round": per_round, "replicas": 1, "model_ms": MODEL_S * 1e3}


# -- c: the affinity router --------------------------------------------------------------------------------


def block_text(hash_id: int, size: int = BLOCK_SIZE) -> str:
    """One block of ``size`` characters (so ``size`` tokens of the bytes tokenizer) standing for a hash id."""
    return str(hash_id).rjust(size - 1, "0")[-(size - 1):] + " "


def trace_requests(limit: int | None = None) -> list[tuple[int, ...]]:
    rows = []
    with TRACE.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: r["timestamp"])  # stable: the file's order among equal timestamps
    return [tuple(r["hash_ids"]) for r in rows[:limit]]


class RouterRun:
    """What the client saw of one application over the whole trace."""

    def __init__(self, name: str, replicas: int) -> None:
        self.name = name
        self.replicas = replicas
        self.sent: set[tuple[int, ...]] = set()  # every request sent so far, by its blocks
        self.last_replica: dict[int, str] = {}
        self.records: list[tuple[float, float, str]] = []  # (sent, answered, replica)
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.could_hit = self.l1_hits = self.hits = 0
        self.prior_blocks = self.local_blocks = 0
        self.per_replica: dict[str, int] = {}

    def done(self, blocks: tuple[int, ...], could_hit: bool, sent: float, replica: str, outcome: str,
             tier: str) -> None:
        now = time.perf_counter()
        self.latencies.append(now - sent)
        self.records.append((sent, now, replica))
        self.per_replica[replica] = self.per_replica.get(replica, 0) + 1
        self.could_hit += could_hit
        self.hits += outcome == "hit"
        self.l1_hits += outcome == "hit" and tier == "l1"
        for block in blocks:
            last = self.last_replica.get(block)
            if last is not None:
                self.prior_blocks += 1
                self.local_blocks += last == replica
            self.last_replica[block] = replica

    def spreads(self) -> list[int]:
        """At each request's send time: max - min requests in flight per replica (answered later by it)."""
        events = [(sent, 1, replica) for sent, _, replica in self.records]
        events += [(answered, 0, replica) for _, answered, replica in self.records]
        events.sort(key=lambda e: (e[0], e[1]))  # an answer before a send at the same instant
        inflight = dict.fromkeys(self.per_replica, 0)
        idle = [0] * max(self.replicas - len(inflight), 0)  # a replica that answered nothing is always empty
        spreads = []
        for _, kind, replica in events:
            if kind == 1:
                counts = [*inflight.values(), *idle]
                spreads.append(max(counts) - min(counts))
                inflight[replica] += 1
            else:
                inflight[replica] -= 1
        return spreads

    def row(self, threshold: int) -> dict[str, Any]:
        spreads = self.spreads()
        return {
            "router": self.name, "requests": len(self.latencies) + len(self.errors),
            "errors": len(self.errors),
            "could_hit": self.could_hit, "hits": self.hits, "l1_hits": self.l1_hits,
            "l1_hit_ratio": self.l1_hits / self.could_hit if self.could_hit else None,
            "prior_blocks": self.prior_blocks, "local_blocks": self.local_blocks,
            "affinity_share": self.local_blocks / self.prior_blocks if self.prior_blocks else None,
            **latency(self.latencies),
            "spread_p50": quantile(spreads, 0.5), "spread_p99": quantile(spreads, 0.99),
            "spread_max": max(spreads),
            "over_threshold_share": sum(s > threshold for s in spreads) / len(spreads),
            "per_replica": sorted(self.per_replica.values(), reverse=True),
        }


async def send_all(session: Any, url: str, work: Sequence[tuple[tuple[int, ...], str]], clients: int,
                   run: RouterRun) -> None:
    """``work`` (blocks, prompt) in order, by ``clients`` concurrent clients each taking the next one."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)

    async def client() -> None:
        while True:
            try:
                blocks, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            could_hit = blocks in run.sent
            run.sent.add(blocks)
            sent = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", json=body(prompt),
                                        headers=HEADERS) as response:
                    await response.read()
                    if response.status != 200:
                        run.errors.append(f"HTTP {response.status}")
                        continue
                    h = response.headers
                    run.done(blocks, could_hit, sent, h["x-evocache-replica"], h["x-evocache-outcome"],
                             h["x-evocache-tier"])
            except Exception as exc:  # noqa: BLE001 - every failure is counted, the run goes on
                run.errors.append(f"{type(exc).__name__}: {exc}")

    await asyncio.gather(*(client() for _ in range(clients)))


def part_affinity(bench: Bench, limit: int | None, chunk: int, clients: int = 8
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import aiohttp
    from _serving_models import MODEL_S
    from ray import serve

    replicas = 2
    apps = {"affinity": bench.config("model_50ms", replicas=replicas, router=True),
            "default": bench.config("model_50ms", replicas=replicas, router=False)}
    urls = {name: bench.deploy(name, config) for name, config in apps.items()}
    threshold = apps["affinity"].deployment.imbalance_threshold
    everything = trace_requests()
    requests = everything[:limit]
    work = [(blocks, "".join(block_text(h) for h in blocks)) for blocks in requests]
    runs = {name: RouterRun(name, replicas) for name in apps}

    async def main() -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for k, start in enumerate(range(0, len(work), chunk)):
                order = list(apps) if k % 2 == 0 else list(apps)[::-1]
                for name in order:
                    await send_all(session, urls[name], work[start:start + chunk], clients, runs[name])

    asyncio.run(main())
    for name in apps:
        serve.delete(name)
    rows = [runs[name].row(threshold) for name in apps]
    context = {"trace": str(TRACE.relative_to(BENCH.parent)), "requests": len(requests),
               "trace_requests": len(everything), "chunk": chunk,
               "clients": clients, "replicas": replicas, "block_size": BLOCK_SIZE, "model_ms": MODEL_S * 1e3,
               "imbalance_threshold": threshold, "errors": {name: runs[name].errors[:5] for name in apps},
               "target_share_ratio": TARGETS["affinity_share_ratio"]}
    return rows, context


# -- d: sustained load -------------------------------------------------------------------------------------


def replica_pids(app: str) -> list[int]:
    """The processes whose command line names ``app``'s model replicas (Ray sets it to ``ray::ServeReplica:
    <app>:model``), found under /proc."""
    marker = f"ray::ServeReplica:{app}:model".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        # While it runs a call Ray appends the method (``...:model.handle_request``); idle, the title is bare.
        if cmdline.startswith(marker) and cmdline[len(marker):len(marker) + 1] in (b"", b" ", b"\x00", b"."):
            pids.append(int(entry.name))
    return sorted(pids)


def _title(entry: Path) -> str:
    try:
        return (entry / "cmdline").read_bytes().split(b"\x00")[0].decode("utf-8", "replace")
    except OSError:
        return ""


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def part_load(bench: Bench, duration: float, clients: int = 32, warm_up: float = 10.0, pool: int = 256,
              fresh_share: float = 0.5) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import aiohttp
    from ray import serve

    replicas = 2
    url = bench.deploy("load", bench.config("instant_model", replicas=replicas))
    pids = replica_pids("load")
    for _ in range(50):  # a replica Serve reports running may not have set its title yet
        if len(pids) == replicas:
            break
        time.sleep(0.1)
        pids = replica_pids("load")
    if len(pids) != replicas:
        titles = sorted({t for t in map(_title, Path("/proc").iterdir())
                         if t.startswith("ray::ServeReplica")})
        raise RuntimeError(f"found {len(pids)} model replica processes of app 'load' ({pids}), expected "
                           f"{replicas}; replica processes: {titles}")
    prompts = [f"{i:06d} How do I move a subscription to another billing account, keeping its history? "
               f"Variant {i}." * 4 for i in range(pool)]
    latencies: list[float] = []
    errors: list[str] = []
    outcomes: dict[str, int] = {}
    samples: list[tuple[float, dict[int, int | None]]] = []

    async def main() -> float:
        started = time.perf_counter()
        stop = started + duration

        async def sample() -> None:
            while True:
                samples.append((time.perf_counter() - started, {pid: rss_bytes(pid) for pid in pids}))
                if time.perf_counter() >= stop:
                    return
                await asyncio.sleep(min(1.0, max(stop - time.perf_counter(), 0.0)))

        async def client(n: int) -> None:
            rng = random.Random(n)
            while time.perf_counter() < stop:
                if rng.random() < fresh_share:
                    prompt = (f"{uuid.uuid4().hex} fresh question from client {n}: "
                              + prompts[rng.randrange(pool)])
                else:
                    prompt = prompts[rng.randrange(pool)]
                sent = time.perf_counter()
                try:
                    async with session.post(f"{url}/v1/completions", json=body(prompt),
                                            headers=HEADERS) as response:
                        await response.read()
                        if response.status != 200:
                            errors.append(f"HTTP {response.status}")
                            continue
                        outcome = response.headers["x-evocache-outcome"]
                        outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    latencies.append(time.perf_counter() - sent)
                except Exception as exc:  # noqa: BLE001 - every failure is counted, the load goes on
                    errors.append(f"{type(exc).__name__}: {exc}")

        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(sample(), *(client(n) for n in range(clients)))
        return time.perf_counter() - started

    elapsed = asyncio.run(main())
    serve.delete("load")
    warm = min(warm_up, duration / 3)
    at_warm = next(s for t, s in samples if t >= warm)
    first, last = samples[0][1], samples[-1][1]
    rss = []
    for pid in pids:
        if None in (first[pid], at_warm[pid], last[pid]):
            raise RuntimeError(f"model replica process {pid} went away during the load")
        rss.append({"start_mb": first[pid] / 2**20, "warm_mb": at_warm[pid] / 2**20,
                    "end_mb": last[pid] / 2**20, "growth": (last[pid] - at_warm[pid]) / at_warm[pid]})
    row = {"duration_s": elapsed, "clients": clients, "requests": len(latencies) + len(errors),
           "errors": len(errors), "ok": len(latencies), "throughput_rps": len(latencies) / elapsed,
           **latency(latencies), "outcomes": outcomes, "rss": rss,
           "rss_growth_max": max(r["growth"] for r in rss)}
    context = {"replicas": replicas, "pool": pool, "fresh_share": fresh_share, "warm_up_s": warm,
               "model": "instant", "rss_samples": len(samples), "error_examples": errors[:5],
               "target_rss_growth": 0.1}
    return [row], context


# -- the command -------------------------------------------------------------------------------------------


def options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c,d",
                        help="which parts to run, comma-separated (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="short runs (a test's): few rounds, the trace's first 160 requests, 6 s of load")
    parser.add_argument("--duration", type=float, help="seconds of load in part d (default: 60, --quick: 6)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="write a result file per part here, for bench/report.py (make bench-serving "
                             "passes bench/results)")
    parser.add_argument("--json", type=Path, help="also write every part's rows and context here")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; "
                     f"known: {', '.join(PARTS)}")
    args.parts = [p for p in PARTS if p in parts]
    if args.duration is None:
        args.duration = 6.0 if args.quick else 60.0
    if args.duration <= 0:
        parser.error("--duration must be above 0")
    return args


Done = tuple[list[dict[str, Any]], dict[str, Any]]


def run(args: argparse.Namespace, finished: Callable[[str, Done], None]) -> None:
    """Run ``args.parts`` on one Ray, handing each part's rows and context to ``finished`` as soon as it ends
    (so a part that fails later loses nothing measured before it)."""
    quick = args.quick
    with tempfile.TemporaryDirectory(prefix="evc-bench-serving-") as work, Bench(Path(work)) as bench:
        for part in args.parts:
            t0 = time.perf_counter()
            if part == "a":
                done = part_hit(bench, rounds=3 if quick else 15, per_round=10 if quick else 40)
            elif part == "b":
                done = part_miss(bench, rounds=2 if quick else 10, per_round=5 if quick else 20)
            elif part == "c":
                done = part_affinity(bench, limit=160 if quick else None, chunk=80 if quick else 500)
            else:
                done = part_load(bench, args.duration)
            print(f"part {part} ({PARTS[part]}) took {time.perf_counter() - t0:.0f} s", flush=True)
            finished(PARTS[part], done)


def main(argv: Sequence[str] | None = None) -> None:
    from _results import part_sink  # bench/_results.py: this script's directory is on sys.path

    args = options(argv)
    run(args, part_sink(args.results, args.json, argv))


if __name__ == "__main__":
    main()
