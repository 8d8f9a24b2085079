"""The cluster set-up of examples/serve-cluster.yaml on a two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``) over the suite's real 3-master Redis Cluster: replicas placed on both nodes,
L2, events, the policy store and the API keys shared through the Redis Cluster.

The example's addresses and paths are swapped for the local ones; everything else is the example as shipped,
built through ``evocache.serving.app:build``, the import path ``serve deploy`` uses.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from _helpers import eventually, free_port

from evocache.controller import Tenant, open_policy_store
from evocache.controller import PolicyStoreConfig
from evocache.serving import RedisKeyStore

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-cluster-test-key-0001"
POLICY = """
policy: cluster-test
version: {version}
defaults: {{ttl: 10m, tiers: [l1, l2]}}
rules:
  - name: greedy
    when: temperature == 0
  - name: sampled
    when: true
    cache: bypass
"""


@pytest.fixture(scope="module")
def cluster_app(redis_cluster, tmp_path_factory):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from evocache.serving.app import build

    os.environ["RAY_AUTH_MODE"] = "disabled"  # loopback only
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    url = redis_cluster.url
    prefix = f"evc-policy-{uuid.uuid4().hex[:6]}"
    store = open_policy_store(PolicyStoreConfig(redis_url=url, prefix=prefix, poll_interval_s=0.2))
    store.apply(POLICY.format(version=1))
    keys_hash = f"evc-keys-{uuid.uuid4().hex[:6]}"
    RedisKeyStore.from_url(url, keys_hash).add(KEY, Tenant("acme", "pro"))

    document = yaml.safe_load((ROOT / "examples" / "serve-cluster.yaml").read_text())
    args = document["applications"][0]["args"]
    args["server"]["model"] = {"kind": "callable", "id": "echo", "callable": "_serving_fixtures:echo_model"}
    args["server"]["store"]["redis"] = {"url": url, "secret": "cluster-test-secret-0123456789",
                                        "prefix": f"evc-{uuid.uuid4().hex[:6]}", "timeout_s": 0.5}
    args["server"]["store"]["events"] = {"sink": "jsonl",
                                         "path": str(tmp_path_factory.mktemp("events") / "events.jsonl")}
    args["server"]["policy_store"] = {"redis_url": url, "prefix": prefix, "poll_interval_s": 0.2}
    args["api_keys"] = {"redis_url": url, "hash_key": keys_hash}
    # Each node has one CPU and a replica takes 0.6: the two replicas cannot share a node.
    args["deployment"].update(replicas=2, num_cpus=0.6, ingress_replicas=1, ingress_num_cpus=0.2)

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": f"/tmp/evc-rc-{uuid.uuid4().hex[:6]}"})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(args), name="evocache", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    eventually(lambda: httpx.get(f"{base}/healthz", timeout=5).status_code == 200, timeout=90, interval=0.3,
               message="the application to become healthy", ignoring=(httpx.HTTPError,))
    yield {"base": base, "store": store}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    store.close()


def test_replicas_run_on_both_nodes_and_share_l2_through_the_redis_cluster(cluster_app):
    from ray import serve

    handle = serve.get_deployment_handle("model", app_name="evocache")
    where = {}
    for _ in range(40):  # calls without a prompt are routed by load: both replicas answer soon
        described = handle.describe.remote().result(timeout_s=30)
        where[described["replica"]] = described["node"]
        if len(where) == 2:
            break
    assert len(where) == 2 and len(set(where.values())) == 2, where

    client = openai.OpenAI(base_url=f"{cluster_app['base']}/v1", api_key=KEY, max_retries=0, timeout=30)
    seen: dict[str, set[str]] = {}
    for i in range(16):
        prompt = f"{uuid.uuid4().hex} question {i}"
        first = client.completions.with_raw_response.create(model="echo", prompt=prompt, temperature=0)
        assert first.headers["x-evocache-outcome"] == "miss"
        seen.setdefault(first.headers["x-evocache-replica"], set()).add(prompt)
    assert len(seen) == 2  # fresh prefixes spread over both replicas, so both nodes serve
    again = client.completions.with_raw_response.create(model="echo", prompt=next(iter(seen.popitem()[1])),
                                                        temperature=0)
    assert again.headers["x-evocache-outcome"] == "hit"


def test_a_policy_applied_to_the_redis_cluster_store_reaches_both_replicas(cluster_app):
    store = cluster_app["store"]
    version = int(store.state().active.rsplit("@", 1)[1]) + 1
    store.apply(POLICY.format(version=version))
    ref = f"cluster-test@{version}"
    def on_ref():
        reports = [r for r in store.status().replicas if not r.replica_id.startswith("ingress:") and not r.stale]
        return len(reports) == 2 and all(r.ref == ref for r in reports)

    eventually(on_ref, timeout=2.0, interval=0.05, message=f"both model replicas on {ref}")
