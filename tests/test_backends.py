"""The Backend contract (tests/_backend_contract.py) on ``LocalBackend``: the ingress's way to model replicas in
this process, over two replicas sharing one store (``RayBackend`` runs the same contract in
tests/test_serving_ray.py)."""

from __future__ import annotations

import asyncio

import pytest
from _backend_contract import check_backend

from evocache.controller import StoreConfig, build_runtime
from evocache.dsl import parse_policy
from evocache.serving import LocalBackend, ModelConfig, ModelServer, ServerSpec

POLICY = """
policy: backends
version: 1
defaults: {ttl: 10m, tiers: [l1]}
rules:
  - name: echo
    when: true
"""


@pytest.fixture
def servers():
    spec = ServerSpec(model=ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model"),
                      block_size=4)
    runtime = build_runtime(StoreConfig(), policy=parse_policy(POLICY))
    made = [ModelServer(spec, f"replica-{i}", runtime=runtime) for i in range(2)]
    yield made
    for server in made:
        server.close()


def test_the_local_backend_keeps_the_backend_contract(servers):
    asyncio.run(check_backend(LocalBackend(servers), extras=servers[0].spec.block_extras()))


def test_the_local_backend_needs_a_replica():
    with pytest.raises(ValueError, match="at least one ModelServer"):
        LocalBackend([])
