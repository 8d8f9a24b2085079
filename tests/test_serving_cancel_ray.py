"""Cancellation through Ray Serve: a request's deadline passing, or its client going away mid-stream, stops the
generation on the model replica (another process), which the model reports through a file it writes.

Its own Ray and application (one model replica, a short deadline), apart from tests/test_serving_ray.py's.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from _helpers import eventually, free_port
from _serving_fixtures import KEYS, write_keys

from evocache.controller import EventsConfig, StoreConfig
from evocache.serving import (
    ApiKeysConfig,
    DeploymentConfig,
    Limits,
    ModelConfig,
    ServerSpec,
    ServingConfig,
)

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
ACME = next(iter(KEYS))
LONG = 5000  # pieces of 10 ms: a generation of about 50 s, which nobody waits for


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray import serve

    from evocache.serving import start_local

    work = tmp_path_factory.mktemp("cancel")
    port = free_port()
    config = ServingConfig(
        server=ServerSpec(model=ModelConfig(kind="callable", id="count", callable="_serving_fixtures:counting_model"),
                          store=StoreConfig(events=EventsConfig(sink="ring")), block_size=4),
        api_keys=ApiKeysConfig(file=str(write_keys(work / "keys.yaml"))),
        deployment=DeploymentConfig(replicas=1, num_cpus=0.25, ingress_num_cpus=0.25),
        limits=Limits(request_timeout_s=2.0), port=port,
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    start_local(config, num_cpus=2, temp_dir=str(Path("/tmp") / f"evc-ray-{uuid.uuid4().hex[:6]}"), auth=False)
    base = f"http://127.0.0.1:{port}"
    eventually(lambda: httpx.get(f"{base}/healthz", timeout=5).status_code == 200, timeout=90, interval=0.2,
               message="the application to become healthy", ignoring=(httpx.HTTPError,))
    yield {"base": base, "work": work}
    serve.shutdown()
    ray.shutdown()


def ended(path: Path) -> int | None:
    """The pieces the model produced, once its generator has ended; None before."""
    text = path.read_text() if path.exists() else ""
    return int(text.split()[0]) if text.endswith(" end") else None


def test_past_the_deadline_a_504_and_the_replica_stops_generating(app):
    watch = app["work"] / f"{uuid.uuid4().hex}.count"
    client = openai.OpenAI(base_url=f"{app['base']}/v1", api_key=ACME, timeout=60)  # with its retries
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="count", prompt=f"deadline {watch}", temperature=0, max_tokens=LONG)
    assert err.value.status_code == 504
    produced = eventually(lambda: ended(watch), timeout=60, message="the replica's generation to end")
    assert produced < LONG


def test_a_client_gone_mid_stream_stops_the_replica(app):
    watch = app["work"] / f"{uuid.uuid4().hex}.count"
    body = {"model": "count", "prompt": f"stream {watch}", "temperature": 0, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{app['base']}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {ACME}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first piece is in: the client goes
    produced = eventually(lambda: ended(watch), timeout=60, message="the replica's generation to end")
    assert produced < LONG
