"""The serving application on a real local Ray: two model replicas behind the FastAPI ingress and Serve's HTTP
proxy, L2 and events on the suite's kind of redis-server, the policy in a file store, called with the official
``openai`` client.

One Ray and one application serve the whole module (starting them costs ~15 s on two cores); each test uses
prompts of its own, so entries never leak between tests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from _redis_server import RedisServer
from _helpers import eventually, free_port
from _serving_fixtures import ADMIN, ADMIN_DIGEST, KEYS, write_keys

from evocache.controller import (
    EventsConfig,
    PolicyStoreConfig,
    PolicyStoreError,
    RedisConfig,
    StoreConfig,
    open_policy_store,
    read_events,
)
from evocache.dsl import PolicyError
from evocache.serving import (
    ApiKeysConfig,
    DeploymentConfig,
    MetricsConfig,
    ModelConfig,
    ServerSpec,
    ServingConfig,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ACME, GLOBEX = list(KEYS)
TESTS = Path(__file__).resolve().parent
POLICY = """
policy: ray-test
version: {version}
fields: {{endpoint: str}}
defaults: {{ttl: 10m, tiers: [l1, l2]}}
rules:
  - name: sampled
    when: temperature > 0
    cache: bypass
  - name: {rule}
    when: true
"""


def policy(version: int, rule: str = "all") -> str:
    return POLICY.format(version=version, rule=rule)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    ray = pytest.importorskip("ray")  # a dependency: importorskip only names it if the install is broken
    from ray import serve

    from evocache.serving import start_local

    work = tmp_path_factory.mktemp("serving")
    redis_server = RedisServer().start()
    store_config = PolicyStoreConfig(directory=str(work / "policies"), poll_interval_s=0.2)
    store = open_policy_store(store_config)
    store.apply(policy(1))
    port, metrics_port = free_port(), free_port()
    config = ServingConfig(
        server=ServerSpec(
            model=ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:slow_echo_model"),
            store=StoreConfig(redis=RedisConfig(url=redis_server.url, timeout_s=0.2, retry_after_s=0.5,
                                                secret="serving-test-secret-0123456789"),
                              events=EventsConfig(sink="jsonl", path=str(work / "events.jsonl"))),
            policy_store=store_config, block_size=4,
        ),
        api_keys=ApiKeysConfig(file=str(write_keys(work / "keys.yaml"))),
        deployment=DeploymentConfig(replicas=2, num_cpus=0.25, ingress_num_cpus=0.25, max_ongoing_requests=16,
                                    imbalance_threshold=8, routing_stats_period_s=0.5),
        port=port, metrics=MetricsConfig(admin_keys=(ADMIN_DIGEST,), port=metrics_port),
    )
    # Ray's workers import the test models from this directory.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    ray_dir = Path("/tmp") / f"evc-ray-{uuid.uuid4().hex[:6]}"
    start_local(config, num_cpus=2, temp_dir=str(ray_dir), auth=False)
    base = f"http://127.0.0.1:{port}"
    eventually(lambda: httpx.get(f"{base}/healthz", timeout=5).status_code == 200, timeout=60, interval=0.2,
               message="the application to become healthy", ignoring=(httpx.HTTPError,))
    yield {"base": base, "store": store, "redis": redis_server, "work": work,
           "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "spec": config.server}
    serve.shutdown()
    ray.shutdown()
    store.close()
    redis_server.close()


def client(app, key=ACME):
    return openai.OpenAI(base_url=f"{app['base']}/v1", api_key=key, max_retries=0, timeout=30)


def ask(app, prompt, key=ACME, **kwargs):
    return client(app, key).completions.with_raw_response.create(model="echo", prompt=prompt, temperature=0,
                                                                 max_tokens=16, **kwargs)


def fresh(label: str) -> str:
    """A prompt of its own, unique from its first block on (the router homes a fresh prefix by that block)."""
    return f"{uuid.uuid4().hex} {label} alpha beta gamma"


def test_the_ray_backend_keeps_the_backend_contract(app):
    """The same contract as LocalBackend's (tests/_backend_contract.py), over the running deployment's handle."""
    import asyncio

    from _backend_contract import check_backend
    from ray import serve

    from evocache.serving._deployment import RayBackend

    backend = RayBackend(serve.get_deployment_handle("model", app_name="evocache"), "evocache")
    spec = app["spec"]
    asyncio.run(check_backend(backend, block_size=spec.block_size, extras=spec.block_extras()))


def test_an_exact_hit_through_ray_carries_the_decision_headers(app):
    prompt = fresh("exact")
    first, second = ask(app, prompt), ask(app, prompt)
    assert first.headers["x-evocache-outcome"] == "miss"
    assert second.headers["x-evocache-outcome"] == "hit"
    assert second.headers["x-evocache-tier"] in ("l1", "l2")
    assert second.headers["x-evocache-policy"].startswith("ray-test@")
    assert second.parse().choices[0].text == first.parse().choices[0].text


def _without_ids(line: str) -> object:
    """An SSE line's chunk without its per-response id and timestamp (or the line itself: ``[DONE]``)."""
    if line == "data: [DONE]":
        return line
    data = json.loads(line.removeprefix("data: "))
    return {k: v for k, v in data.items() if k not in ("id", "created")}


def test_a_streamed_hit_replays_the_first_stream(app):
    prompt = fresh("stream")

    def stream():
        with client(app).completions.with_streaming_response.create(
                model="echo", prompt=prompt, temperature=0, stream=True,
                stream_options={"include_usage": True}) as response:
            return response.headers["x-evocache-outcome"], [
                _without_ids(line) for line in response.iter_lines() if line]

    outcome1, lines1 = stream()
    outcome2, lines2 = stream()
    assert (outcome1, outcome2) == ("miss", "hit")
    assert lines1 == lines2 and lines1[-1] == "data: [DONE]"


def test_requests_sharing_a_prefix_go_to_one_replica_and_fresh_prefixes_spread(app):
    shared = f"{uuid.uuid4().hex} conversation " * 2
    replicas = {ask(app, shared + f" turn {i}").headers["x-evocache-replica"] for i in range(6)}
    assert len(replicas) == 1
    spread = {ask(app, fresh(f"spread {i}")).headers["x-evocache-replica"] for i in range(12)}
    assert len(spread) == 2


def test_tenants_never_share_even_through_the_shared_l2(app):
    prompt = fresh("tenants")
    assert ask(app, prompt, ACME).headers["x-evocache-outcome"] == "miss"
    assert ask(app, prompt, GLOBEX).headers["x-evocache-outcome"] == "miss"
    assert ask(app, prompt, GLOBEX).headers["x-evocache-outcome"] == "hit"
    with pytest.raises(openai.AuthenticationError):
        client(app, "sk-unknown-key-123456").completions.create(model="echo", prompt=prompt, temperature=0)


def _replicas_on(store, ref, timeout=2.0):
    """True once every model replica reports ``ref`` as active (within ``timeout`` seconds, else a failure
    naming the store's status)."""
    def on_ref():
        reports = [r for r in store.status().replicas if not r.replica_id.startswith("ingress:") and not r.stale]
        return len(reports) >= 2 and all(r.ref == ref for r in reports)

    return eventually(on_ref, timeout=timeout, interval=0.05, message=f"every model replica on {ref}")


def test_policy_apply_canary_promote_rollback_reach_every_replica(app):
    store = app["store"]
    active = store.state().active
    version = int(active.rsplit("@", 1)[1])
    with pytest.raises(PolicyError):
        store.apply("policy: ray-test\nversion: 99\nrules: [{name: x, when: 'nosuchfield > 1'}]\n")
    assert store.state().active == active  # the invalid document reached no replica
    with pytest.raises(PolicyStoreError):
        store.apply(policy(version))  # not above the active version

    store.apply(policy(version + 1, "v-next"))
    assert _replicas_on(store, f"ray-test@{version + 1}") is not None, store.status()
    headers = ask(app, fresh("after-apply")).headers
    assert headers["x-evocache-policy"] == f"ray-test@{version + 1}" and headers["x-evocache-rule"] == "v-next"

    store.apply(policy(version + 2, "canary"), canary=0.5)
    time.sleep(1.0)
    arms = {}
    for i in range(16):
        h = ask(app, fresh(f"canary {i}")).headers
        arms.setdefault(h["x-evocache-arm"], set()).add(h["x-evocache-policy"])
    assert arms["canary"] == {f"ray-test@{version + 2}"} and arms["active"] == {f"ray-test@{version + 1}"}
    same = fresh("one conversation")
    assert len({ask(app, same + f" {i}").headers["x-evocache-arm"] for i in range(4)}) == 1

    store.promote()
    assert _replicas_on(store, f"ray-test@{version + 2}") is not None
    store.rollback()
    assert _replicas_on(store, f"ray-test@{version + 1}") is not None
    events = list(read_events(app["work"] / "events.jsonl"))
    assert {e.policy for e in events} >= {f"ray-test@{version + 1}", f"ray-test@{version + 2}"}


def test_redis_killed_and_restarted_under_load_fails_no_request(app):
    redis_server = app["redis"]
    stop = time.monotonic() + 6

    def worker(n):
        failures, done = 0, 0
        c = client(app)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                c.completions.create(model="echo", prompt=f"load {n} {i % 5} a b c", temperature=0)
                done += 1
            except openai.APIError:
                failures += 1
        return failures, done

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(worker, n) for n in range(8)]
        time.sleep(1.5)
        redis_server.stop()
        time.sleep(2.0)
        redis_server.start()
        results = [f.result() for f in futures]
    assert sum(f for f, _ in results) == 0
    assert all(done > 0 for _, done in results)


def test_metrics_cover_every_replica(app):
    ask(app, fresh("metrics"))

    def both_replicas():
        text = httpx.get(f"{app['base']}/metrics", headers=ADMIN).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}
        models = {r for r in replicas if not r.startswith("ingress:")}
        return text if len(models) == 2 and len(replicas) == 3 else None  # and the ingress, for its hits

    text = eventually(both_replicas, timeout=10, interval=0.5, message="/metrics to cover both replicas")
    assert "evocache_http_requests_total" in text
    # A tenant's key never reads them; the operator's loopback listener needs none.
    refused = httpx.get(f"{app['base']}/metrics", headers={"Authorization": f"Bearer {next(iter(KEYS))}"})
    assert refused.status_code == 403 and "evocache_" not in refused.text
    assert "evocache_http_requests_total" in httpx.get(app["metrics"]).text


def test_the_policy_commands_drive_the_running_replicas(app, tmp_path):
    from typer.testing import CliRunner

    from evocache.cli.app import make_app

    store, runner, cli = app["store"], CliRunner(), make_app()
    directory = str(app["work"] / "policies")
    version = 1 + max(int(h["ref"].rsplit("@", 1)[1]) for h in store.state().history)  # above any stored
    doc = tmp_path / "next.yaml"
    doc.write_text(policy(version, "from-cli"))
    applied = runner.invoke(cli, ["policy", "apply", str(doc), "--store", directory, "--canary", "0.25"])
    assert applied.exit_code == 0, applied.output
    assert _replicas_on(store, store.state().active) is not None
    def canary_lines():
        status = runner.invoke(cli, ["policy", "status", "--store", directory])
        lines = [ln for ln in status.output.splitlines() if f"ray-test@{version}" in ln and "ingress" not in ln]
        # the canary line, and both model replicas running it as their canary
        return (status, lines) if len(lines) >= 3 else None

    status, model_lines = eventually(canary_lines, timeout=5, interval=0.1, message="both replicas on the canary")
    assert f"canary: ray-test@{version}" in status.output, status.output
    promoted = runner.invoke(cli, ["policy", "promote", "--store", directory])
    assert promoted.exit_code == 0 and _replicas_on(store, f"ray-test@{version}") is not None
    rolled = runner.invoke(cli, ["policy", "rollback", "--store", directory])
    assert rolled.exit_code == 0 and _replicas_on(store, store.state().active) is not None
    assert store.state().active != f"ray-test@{version}"


def test_a_model_replica_killed_under_load_fails_no_request_that_had_not_answered(app):
    """Non-streamed requests whose replica dies before answering are sent once more to a live one (the one
    left, or the one Serve starts in its place): none fails. Last in the module: one replica is restarted."""
    import ray

    stop = time.monotonic() + 6

    def worker(n):
        failures, done = [], 0
        c = client(app)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:  # a prompt of its own: a miss, so the model runs (50 ms) while the replica may die
                c.completions.create(model="echo", prompt=fresh(f"kill {n} {i}"), temperature=0, max_tokens=8)
                done += 1
            except openai.APIError as exc:
                failures.append(repr(exc))
        return failures, done

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::") and "#model#" in a["name"]]
    assert len(replicas) == 2, replicas
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(worker, n) for n in range(8)]
        time.sleep(1.5)
        victim = replicas[0]
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        results = [f.result() for f in futures]
    assert [f for failures, _ in results for f in failures] == []
    assert all(done > 0 for _, done in results)
