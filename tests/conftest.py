"""Shared fixtures: a real redis-server started by the suite (never a mock, never a skip); a real vLLM server
on a tiny model (tests/_vllm.py); and the fast lane's duration budget (tests/_lanes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import FakeClock
from _lanes import pytest_configure, pytest_runtest_makereport  # noqa: F401  # the fast lane's budget
from _redis_server import RedisClusterServers, RedisServer
from _vllm import VllmEndpoint, VllmServer, build_tiny_llama

from evocache.controller import CacheRuntime, StoreConfig, build_runtime


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Key files the suite's stores create go to a directory of the session's, never the user's state dir."""
    patch = pytest.MonkeyPatch()
    patch.setenv("EVOCACHE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    patch.delenv("EVOCACHE_SECRET", raising=False)
    yield
    patch.undo()


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def clock() -> FakeClock:
    """The clock of the ``rt`` runtime: move ``clock.now`` to age its entries."""
    return FakeClock()


@pytest.fixture
def rt(clock: FakeClock) -> Iterator[CacheRuntime]:
    """A runtime of the test's own: process memory only, events in a ring, on ``clock``."""
    runtime = build_runtime(StoreConfig(), clock=clock)
    yield runtime
    runtime.close()


def _new_server() -> RedisServer:
    # A missing redis-server fails the Redis tests loudly: a skipped Redis suite would let a broken CI pass.
    try:
        return RedisServer()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session, on a free loopback port. Tests share it through ``redis_url``."""
    server = _new_server().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, flushed so the test starts from an empty Redis."""
    if not redis_server.running:  # a test may have stopped it; bring it back rather than fail the next one
        redis_server.start()
    with redis_server.client() as admin:
        admin.flushall()
    return redis_server.url


@pytest.fixture
def restartable_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, free to be killed and restarted on the same port."""
    server = _new_server().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """One 3-master Redis Cluster for the session, on free loopback ports (``redis_cluster.url`` is its
    ``redis+cluster://`` URL). Tests that kill a node start a cluster of their own."""
    try:
        cluster = RedisClusterServers(3)
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    cluster.start()
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with its tokenizer and chat template, built once per session: the folder
    vLLM serves and evocache loads (``load_tokenizer(str(folder))``, ``ModelConfig(kind="hf", path=...)``)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM OpenAI server for the session on ``tiny_llama_dir`` (30-70 s to start: tests that use it are
    marked slow). A test may ``kill()`` or ``stop()`` it; ``vllm_upstream`` starts it again for the next
    one."""
    server = VllmServer(tiny_llama_dir, tmp_path_factory.mktemp("vllm"))
    try:
        server.start()
    except RuntimeError as exc:  # the message carries the server's log
        pytest.fail(str(exc), pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def vllm_upstream(vllm_server: VllmServer) -> VllmEndpoint:
    """The session's vLLM server, running: its base URL, served model name, model folder and log."""
    if not vllm_server.running:  # a test killed it; bring it back rather than fail the next one
        try:
            vllm_server.start()
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
    return vllm_server.endpoint
