"""Pieces the serving tests share: test models, an API-key file, a policy store, and a uvicorn server thread.

The models here are plain functions a ``ModelConfig(kind="callable")`` can import (the Ray tests put this
directory on the workers' PYTHONPATH): deterministic, instant, and counting their calls in-process.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from _helpers import eventually, free_port

from evocache.controller import EventsConfig, StoreConfig
from evocache.serving import Api, FileKeyStore, LocalBackend, ModelConfig, ModelServer, ServerSpec
from evocache.serving._model import ByteTokenizer, CallableGenerator

CALLS: list[str] = []

KEYS = {"sk-acme-test-key-0001": ("acme", "pro"), "sk-globex-test-key-02": ("globex", "free")}
# The operator's key for /metrics, which a server is given as its SHA-256 digest (MetricsConfig.admin_keys).
ADMIN_KEY = "sk-operator-metrics-03"
ADMIN_DIGEST = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def echo_model(prompt: str, max_tokens: int) -> Iterator[str]:
    """Answers with the prompt's words, reversed, one piece per word (at most ``max_tokens``)."""
    CALLS.append(prompt)
    words = prompt.split()[::-1][:max_tokens]
    for i, word in enumerate(words):
        yield word if i == 0 else " " + word


def slow_echo_model(prompt: str, max_tokens: int) -> Iterator[str]:
    time.sleep(0.05)
    yield from echo_model(prompt, max_tokens)


def counting_model(prompt: str, max_tokens: int) -> Iterator[str]:
    """A long generation another process can watch: a piece ("z") every 10 ms, the count so far written to the
    file the prompt's last word names, and `` end`` after it once the generator ends, closed or not."""
    path = Path(prompt.split()[-1])
    produced = 0
    try:
        for _ in range(max_tokens):
            time.sleep(0.01)
            produced += 1
            path.write_text(str(produced))
            yield "z"
    finally:
        path.write_text(f"{produced} end")


def write_keys(path: Path) -> Path:
    lines = ["keys:"]
    for key, (tenant, tier) in KEYS.items():
        lines += [f"  - key: {key}", f"    tenant: {tenant}", f"    tier: {tier}"]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


class UvicornThread:
    """An ASGI app served by uvicorn on a loopback port, in a daemon thread."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> UvicornThread:
        self.thread.start()
        eventually(lambda: self.server.started, message=f"uvicorn to start on port {self.port}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(tmp_path, model, **api_options):
    """The HTTP API in this process over one replica serving ``model`` (a callable): ``(api, server)``; the
    caller serves ``build_fastapi(api)`` and closes the server."""
    spec = ServerSpec(model=ModelConfig(kind="callable", id="echo", callable="_serving_fixtures:echo_model"),
                      store=StoreConfig(events=EventsConfig(sink="ring")), block_size=4)
    server = ModelServer(spec, "replica-a", generator=CallableGenerator(model, "model"), tokenizer=ByteTokenizer())
    api = Api(model_id="echo", model_revision="", tokenizer=ByteTokenizer(), backend=LocalBackend([server]),
              keys=FileKeyStore.load(write_keys(tmp_path / "keys.yaml")), block_size=4, **api_options)
    return api, server
