"""The Ray Serve side: the model deployment, the FastAPI ingress deployment, and the metrics hub.

``ModelDeployment`` replicas each hold a ``ModelServer`` (their own L1; L2, events and the policy store shared
through ``StoreConfig``/``PolicyStoreConfig``) and are routed by ``PrefixAffinityRouter``, which reads the
``GenerateRequest`` the ingress passes as the first argument and the ``record_routing_stats`` each replica
reports. ``IngressDeployment`` serves the OpenAI API (``serving._ingress``) and calls the model deployment
through a handle: the HTTP proxy's raw requests carry no parsed prompt, so the router lives on the model
deployment, behind the ingress.

Every replica pushes its Prometheus exposition to one ``MetricsHub`` actor every ``METRICS_PERIOD_S`` (off the
request path), and writes out its buffered access events as often; ``GET /metrics`` reads the hub and merges
what is fresh; every ``KV_WINDOW_S`` it closes the KV cache's reuse-rate window (``evocache_kv_reuse_rate``).
Ray is imported here only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from evocache.controller import PolicyFollower, open_policy_store

from ._config import MetricsConfig
from ._auth import AdminKeys, FileKeyStore, KeyStore, Rate, RedisKeyStore
from ._ingress import Api, build_fastapi, serve_metrics
from ._metrics import merge_expositions
from ._model import load_tokenizer
from ._protocol import Limits
from ._request import Completion, Decision, Finish, GenerateRequest
from ._pump import pump
from .errors import ApiError
from ._server import ModelServer, ServerSpec, completion_of

log = logging.getLogger("evocache.serving")

METRICS_PERIOD_S = 1.0
METRICS_STALE_S = 10.0
KV_WINDOW_S = 30.0  # the KV reuse rate's window: long enough that a prefix's repeats fall in one


@ray.remote(num_cpus=0)
class MetricsHub:
    """The latest exposition of every replica that pushed one recently."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, exposition: bytes) -> None:
        self._parts[replica] = (time.monotonic(), exposition)

    def snapshot(self) -> dict[str, bytes]:
        now = time.monotonic()
        self._parts = {r: p for r, p in self._parts.items() if now - p[0] <= METRICS_STALE_S}
        return {r: p[1] for r, p in self._parts.items()}


def metrics_hub(app_name: str) -> Any:
    return MetricsHub.options(name=f"evocache-metrics-{app_name}", namespace="serve", get_if_exists=True,
                              lifetime="detached").remote()


class ModelDeployment:
    """One model replica (the class ``serving.app.build`` deploys; see the module docstring)."""

    def __init__(self, spec: ServerSpec, run: str | None = None) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.server = ModelServer(spec, self.replica_id)
        if run is not None and self.server.follower is not None:
            # What `evocache policy apply` checks a new version against while this replica runs.
            self.server.follower.register(run, spec.store)
        self._hub = metrics_hub(context.app_name)
        self._stop = threading.Event()
        threading.Thread(target=self._housekeeping, name="evocache-replica", daemon=True).start()

    def _housekeeping(self) -> None:
        """Every period: write out buffered access events, push the metrics to the hub; every ``KV_WINDOW_S``,
        close the KV reuse-rate window first."""
        window_ends = time.monotonic() + KV_WINDOW_S
        while not self._stop.wait(METRICS_PERIOD_S):
            if time.monotonic() >= window_ends:
                window_ends += KV_WINDOW_S
                self.server.kv_window()
            self.server.runtime.flush()
            try:
                self._hub.put.remote(self.replica_id, self.server.metrics())
            except Exception as exc:  # noqa: BLE001 - a hub that went away is found again next period
                log.info("metrics push failed: %s", exc)
                self._hub = metrics_hub(serve.get_replica_context().app_name)

    # The server's lazy stream, driven from the replica's event loop in a thread of its own (serving._pump):
    # the model never blocks the loop, and a request Ray Serve cancels (the ingress cancelled its call: the
    # client went away, or the deadline passed) closes the stream, so the model stops between two tokens. A
    # sync generator method would be run to its end by Serve's thread pool, whoever was still listening.
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Decision | str | Finish]:
        async for item in pump(self.server.stream(request)):
            yield item

    async def complete(self, request: GenerateRequest) -> Completion:
        return completion_of([item async for item in pump(self.server.stream(request))])

    def ready(self) -> bool:
        return True

    def describe(self) -> dict[str, str]:
        """Where this replica runs: its id and its Ray node's id (for operators and placement checks)."""
        return {"replica": self.replica_id, "node": ray.get_runtime_context().get_node_id()}

    def record_routing_stats(self) -> dict[str, Any]:
        return self.server.routing_stats()

    def policy(self) -> dict[str, Any]:
        """What this replica enforces: the active version, the follower's last error, the shadow tally."""
        follower = self.server.follower
        return {"replica": self.replica_id, "policy": self.server.policy_ref(),
                "error": follower.error if follower is not None else None,
                "shadow": self.server.rollouts.shadow_tally()}

    def __del__(self) -> None:
        self._stop.set()
        self.server.close()


class RayBackend:
    """The ingress's ``Backend`` over the model deployment's handle.

    A call whose replica died before it produced anything (``replica_died``) is sent once more
    (``REPLICA_RETRIES``): Ray's router drops a replica whose call died, so another replica takes it. A call that already produced output (a stream
    past its first item), or that failed for another reason, is not sent again: its failure is the caller's.
    """

    def __init__(self, handle: Any, app_name: str) -> None:
        self.handle = handle
        self.streaming = handle.options(stream=True)
        self.app_name = app_name
        self._hub: Any = None

    async def complete(self, request: GenerateRequest, placed: asyncio.Event | None = None) -> Completion:
        retries = REPLICA_RETRIES
        while True:
            response = self.handle.complete.remote(request)
            try:
                await _placed(response, placed)
                return await response
            except asyncio.CancelledError:  # awaiting no longer: the replica's task is cancelled too
                response.cancel()
                raise
            except Exception as exc:
                _raise_refusal(exc)
                if retries == 0 or not replica_died(exc):
                    raise
                retries -= 1
                _retrying(request, exc)

    async def stream(self, request: GenerateRequest,
                     placed: asyncio.Event | None = None) -> AsyncIterator[Decision | str | Finish]:
        retries = REPLICA_RETRIES
        while True:
            response = self.streaming.generate.remote(request)
            started = ended = False
            try:
                await _placed(response, placed)
                async for item in response:
                    started = True
                    yield item
                ended = True
                return
            except Exception as exc:
                _raise_refusal(exc)
                if started or retries == 0 or not replica_died(exc):
                    raise
                retries -= 1
                _retrying(request, exc)
            finally:
                if not ended:  # closed or cancelled before its end: so is the replica's generator
                    response.cancel()

    async def ready(self) -> bool:
        return bool(await self.handle.ready.remote())

    async def metrics(self) -> bytes:
        if self._hub is None:
            self._hub = metrics_hub(self.app_name)
        return merge_expositions(await self._hub.snapshot.remote())


REPLICA_RETRIES = 1  # a request whose replica died before answering is sent this many more times


def replica_died(exc: BaseException) -> bool:
    """Whether a handle call failed because its replica is gone (Ray's ``RayActorError`` family: the actor
    died, or cannot be reached), rather than because the replica's own code raised: a ``RayTaskError``, even
    one whose cause is another actor's death, is the request's failure, not the replica's."""
    return isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError)


def _raise_refusal(exc: BaseException) -> None:
    """Raise the ``ApiError`` a replica refused the request with (an upstream engine's 4xx, a 502, a 504), as
    it was raised there, rather than Ray's wrapper of it; return for any other failure."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, ApiError):
        raise exc.cause from None


def _retrying(request: GenerateRequest, exc: BaseException) -> None:
    log.warning("request %s: its model replica died before answering (%s); sending it to another",
                request.request_id, type(exc).__name__)


async def _placed(response: Any, placed: asyncio.Event | None) -> None:
    """Set ``placed`` once Ray's router has assigned the request to a replica, the moment the response's
    replica future resolves (Ray Serve names that moment only in this private method)."""
    if placed is not None:
        await response._fetch_future_result_async()
        placed.set()


def key_store(spec: dict[str, Any]) -> KeyStore:
    """``{"file": path}`` or ``{"redis_url": url, "hash_key": ...}``: where API keys map to tenants."""
    if spec.get("file"):
        return FileKeyStore.load(spec["file"])
    return RedisKeyStore.from_url(spec["redis_url"], **({"hash_key": spec["hash_key"]} if spec.get("hash_key") else {}))


@serve.ingress()
class IngressDeployment:
    """The OpenAI API in front of the model deployment (see ``serving._ingress``)."""

    def __init__(self, model: Any, spec: ServerSpec, keys: dict[str, Any], options: dict[str, Any],
                 metrics: MetricsConfig, run: str | None = None) -> None:
        context = serve.get_replica_context()
        tokenizer = load_tokenizer(spec.model.tokenizer_source)
        rate = options.get("rate")
        self.name = f"ingress:{context.replica_id.unique_id}"
        # Exact hits answered here, from this replica's own L1 and the shared tiers, without the hop to a model
        # replica or a wait in its queue: the same contract, keys, policy and rollout arm as the replicas.
        self.hits = ModelServer.lookups_only(spec, self.name, tokenizer)
        self.api = Api(
            model_id=spec.model.id, model_revision=spec.model.revision, tokenizer=tokenizer,
            backend=RayBackend(model, context.app_name), keys=key_store(keys), block_size=spec.block_size,
            default_max_tokens=spec.model.max_tokens, ready_timeout_s=options.get("ready_timeout_s", 30.0),
            rate=Rate(**rate) if rate else None, block_extras=spec.block_extras(),
            admin_keys=AdminKeys.from_hex(metrics.admin_keys), limits=options.get("limits") or Limits(),
            context_tokens=spec.model.context_length(),
            upstream_fields=frozenset(spec.model.upstream.fields) if spec.model.upstream is not None else None,
            hits=self.hits.lookup,
        )
        # Several ingress replicas on one host: the first to start holds the port (the others log it).
        self.metrics_listener = serve_metrics(self.api, metrics.host, metrics.port) if metrics.port else None
        self.follower = None
        if spec.policy_store is not None:
            store = open_policy_store(spec.policy_store)
            self.follower = PolicyFollower(store, self.name, self._follow,
                                           interval=spec.policy_store.poll_interval_s)
            if run is not None:
                self.follower.register(run, spec.store)  # it enforces the policy on the hits it serves
            self.follower.poll()
            self.follower.start()
        self._hub = metrics_hub(context.app_name)
        self._stop = threading.Event()
        threading.Thread(target=self._housekeeping, name="evocache-ingress", daemon=True).start()

    def _follow(self, rollout: Any) -> None:
        self.hits.rollouts.apply(rollout)  # first: a version its store cannot enforce changes nothing here
        self.api.set_policy(rollout.active)  # the active version's tenants: their rates and prompt bounds

    def _housekeeping(self) -> None:
        """Every period: write out the hits' access events and push their metrics to the hub, as a replica."""
        while not self._stop.wait(METRICS_PERIOD_S):
            self.hits.runtime.flush()
            try:
                self._hub.put.remote(self.name, self.hits.metrics())
            except Exception as exc:  # noqa: BLE001 - a hub that went away is found again next period
                log.info("metrics push failed: %s", exc)
                self._hub = metrics_hub(serve.get_replica_context().app_name)

    def __del__(self) -> None:
        self._stop.set()
        self.hits.close()

    def __serve_build_asgi_app__(self) -> Any:
        return build_fastapi(self.api)
