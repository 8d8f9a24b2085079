"""The OpenAI-compatible HTTP API: a FastAPI app in front of the model replicas.

    POST /v1/completions        POST /v1/chat/completions     (stream: true for SSE)
    GET  /v1/models             GET  /healthz                 GET /metrics

Per request the ingress, in this order: authenticates the bearer key (the tenant is the key's, never a body
field; 401 otherwise, 400 for a repeated ``Authorization`` header), checks that the body is declared
``application/json`` (415 otherwise), takes the tenant's rate token (429 with ``Retry-After``), parses and bounds
the body (400 naming the field), renders the prompt (a chat through the tokenizer's template), tokenises it,
bounds it in tokens (token ids within the vocabulary, ``Limits.max_prompt_tokens`` and the tenant's
``max_prompt_tokens`` in the policy, the tighter of the two, and prompt plus ``max_tokens`` within the model's
context: 400 naming the field), hashes its full blocks with the tenant
namespace as salt (what the prefix-affinity router and, later, the KV cache key on), then calls a model replica
through the ``Backend``. Every response carries the ``x-evocache-*`` headers of the replica's ``Decision``; a
stream sends them before its first chunk. A fault of the ingress itself is a 500, in OpenAI's error shape like
every refusal.

A request's lifetime (``_answer``): it waits at most ``ready_timeout_s`` for a replica to take it (503 with
``Retry-After`` otherwise: nothing was computed, and a retry may find one), then for its answer (a stream: its
first piece) until its deadline, ``Limits.request_timeout_s`` after it arrived or sooner when the client asks
with ``x-evocache-timeout: <seconds>`` (504 otherwise). When the
deadline passes, or the client goes away (mid-stream too), the backend call is cancelled, and with it the
generation on the replica, between two tokens.

``GET /metrics`` shows every tenant's traffic, so it is the operator's: it answers only a request with an admin
key (``AdminKeys``; a tenant's key gets 403, no key 401). ``serve_metrics`` serves it without a key on a separate
listener instead, bound to loopback by default, for a scraper on the same host.

``Backend`` is the seam to the replicas: over a Ray Serve handle in a deployment (``serving._deployment``), or a
``ModelServer`` in this process (``LocalBackend``, for tests and embedding).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from evocache.controller import CacheControl, block_hashes, namespace_for

from ._auth import AdminKeys, KeyStore, Rate, RateLimiter, authenticate, authorization_header, tenant_rates
from ._model import Tokenizer
from ._protocol import (
    AssistantMessage,
    CacheDirectives,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    Limits,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    error_response,
    parse_request,
    parse_upstream_request,
)
from ._request import Completion, Decision, Finish, GenerateRequest, completion_of
from ._upstream import merge_extras
from .errors import (
    ApiError,
    BadRequest,
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    GatewayTimeout,
    Unavailable,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from evocache.dsl import Policy

log = logging.getLogger("evocache.serving")

T = TypeVar("T")

OPENAI_DEFAULT_TEMPERATURE = 1.0  # what OpenAI samples at when a request gives none


class Backend(Protocol):
    """The way to the replicas. ``placed``, when given, is set once a replica has taken the request (Ray's
    router assigned it); cancelling a call, or closing a stream before its end, cancels the replica's work."""

    async def complete(self, request: GenerateRequest, placed: asyncio.Event | None = None) -> Completion: ...

    def stream(self, request: GenerateRequest,
               placed: asyncio.Event | None = None) -> AsyncIterator[Decision | str | Finish]: ...

    async def ready(self) -> bool: ...

    async def metrics(self) -> bytes: ...


class Api:
    """The ingress's state: the model it names, its tokenizer, context (``context_tokens``: prompt plus answer,
    ``ModelConfig.context_length``; None for no bound) and block hashing, keys (the tenants', and the admin keys
    that read ``/metrics``), request limits, rate limits, the policy whose tenants' settings it enforces
    (``set_policy``), backend."""

    def __init__(self, *, model_id: str, model_revision: str, tokenizer: Tokenizer, backend: Backend,
                 keys: KeyStore, block_size: int = 16, default_max_tokens: int = 64, limits: Limits = Limits(),
                 rate: Rate | None = None, clock: Callable[[], float] = time.monotonic,
                 ready_timeout_s: float = 30.0, block_extras: tuple[str, ...] | None = None,
                 admin_keys: AdminKeys = AdminKeys(), context_tokens: int | None = None,
                 upstream_fields: frozenset[str] | None = None,
                 hits: Callable[[GenerateRequest], list[Any] | None] | None = None) -> None:
        self.model_id = model_id
        # Exact hits served here, without a model replica (``Api.hit``); None: every request goes to one.
        self.hits = hits
        # With an upstream engine: the deployment's own fields it passes through (UpstreamConfig.fields), beside
        # OpenAI's; None with the built-in engine, which refuses what it cannot honour.
        self.upstream_fields = upstream_fields
        self.model_revision = model_revision
        self.tokenizer = tokenizer
        self.backend = backend
        self.keys = keys
        self.admin_keys = admin_keys
        self.block_size = block_size
        # What a block hash binds besides tokens and tenant: the replicas' (ServerSpec.block_extras), so the
        # router's hashes are the KV cache's.
        self.block_extras = block_extras if block_extras is not None else (model_id, model_revision)
        self.default_max_tokens = default_max_tokens
        self.context_tokens = context_tokens
        self.limits = limits
        self.default_rate = rate
        self.limiter = RateLimiter(rate, clock) if rate is not None else None
        self.policy: Policy | None = None
        self.clock = clock
        self.ready_timeout_s = ready_timeout_s
        self.created = int(time.time())
        self.registry = CollectorRegistry()
        self.requests = Counter("evocache_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("evocache_http_request_seconds", "Time to the response (to the first chunk "
                                 "of a stream)", ["endpoint"], registry=self.registry)
        self.cancelled = Counter("evocache_http_cancelled", "Answers cancelled on their replica before their "
                                 "end: the client gone, or the request's deadline passed",
                                 ["endpoint", "why"], registry=self.registry)

    async def hit(self, work: GenerateRequest) -> list[Any] | None:
        """An exact hit of ``work`` the ingress serves itself (``hits``: ``ModelServer.lookup`` of a server
        that only looks up), off the event loop; None to go to a model replica, also when the lookup failed
        (the replica then looks up and computes, and its failures are counted there)."""
        assert self.hits is not None
        try:
            return await asyncio.to_thread(self.hits, work)
        except Exception as exc:  # noqa: BLE001 - the replica path answers whatever the lookup could not
            log.warning("ingress lookup failed: %s: %s", type(exc).__name__, exc)
            return None

    async def exposition(self) -> bytes:
        """The ingress's own metrics and every fresh replica's, merged (what ``/metrics`` serves)."""
        try:
            replicas = await asyncio.wait_for(self.backend.metrics(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - the ingress's own metrics are still worth serving
            log.info("metrics: replicas unreachable: %s", exc)
            replicas = b""
        return generate_latest(self.registry) + replicas

    def set_policy(self, policy: Policy) -> None:
        """Follow ``policy``'s tenants: their rates (over the deployment's ``rate``) and prompt bounds."""
        self.set_tenant_rates(*tenant_rates(policy, self.default_rate))
        self.policy = policy

    def max_prompt_tokens(self, tenant_id: str) -> int | None:
        """The tightest bound on ``tenant_id``'s prompts in tokens: ``Limits.max_prompt_tokens`` and the
        tenant's ``max_prompt_tokens`` in the policy: its own entry's, else the ``default`` entry's (field by
        field, as a rate is)."""
        own = None
        if self.policy is not None:
            for spec in (self.policy.tenants.get(tenant_id), self.policy.tenant(None)):
                if spec is not None and spec.max_prompt_tokens is not None:
                    own = spec.max_prompt_tokens
                    break
        bounds = [b for b in (self.limits.max_prompt_tokens, own) if b is not None]
        return min(bounds) if bounds else None

    def set_tenant_rates(self, default: Rate | None, per_tenant: Mapping[str, Rate]) -> None:
        """Rate limits from the policy's tenant section: ``default`` for tenants it does not name."""
        if default is None and not per_tenant:
            self.limiter = None
            return
        limiter = RateLimiter(default or Rate(1e9, 1e9), self.clock, dict(per_tenant))
        if self.limiter is not None:
            limiter._buckets = self.limiter._buckets  # keep what tenants have spent across a policy change
        self.limiter = limiter

    # -- request -> GenerateRequest ----------------------------------------------------------------------

    def to_generate(self, parsed: CompletionRequest | ChatCompletionRequest, tenant_id: str, tier: str,
                    endpoint: Literal["completions", "chat"], fields: Mapping[str, Any] | None = None,
                    control: CacheControl | None = None, partition: str = "") -> GenerateRequest:
        if parsed.model != self.model_id:
            raise BadRequest(f"model: {parsed.model!r} is not served here; GET /v1/models lists {self.model_id!r}",
                             "model")
        if isinstance(parsed, ChatCompletionRequest):
            messages = [(m.role, m.text()) for m in parsed.messages]
            prompt = self.tokenizer.render_chat(messages)
            input_ids = self.tokenizer.encode(prompt)
            chunks = chat_chunks(self.tokenizer, messages, prompt, input_ids)
            asked = ("max_completion_tokens", parsed.max_completion_tokens) if parsed.max_completion_tokens \
                else ("max_tokens", parsed.max_tokens)
            prompt_param = "messages"
        else:
            prompt, input_ids = self._prompt(parsed.prompt)
            chunks = ()
            asked = ("max_tokens", parsed.max_tokens)
            prompt_param = "prompt"
        max_tokens = self._token_bound(len(input_ids), asked, prompt_param, self.max_prompt_tokens(tenant_id))
        stop = parsed.stop if isinstance(parsed.stop, list) else [parsed.stop] if parsed.stop else []
        if len(stop) > 4 or any(not s or len(s) > 256 for s in stop):
            raise BadRequest("stop: up to 4 sequences of 1 to 256 characters", "stop")
        try:
            blocks = block_hashes(input_ids, self.block_size, self.block_extras,
                                  str(namespace_for(tenant_id)))
        except ValueError as exc:
            raise BadRequest(f"prompt: {exc}", "prompt") from exc
        temperature = parsed.temperature if parsed.temperature is not None else OPENAI_DEFAULT_TEMPERATURE
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return GenerateRequest(
            request_id=("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex,
            endpoint=endpoint, model=self.model_id, prompt=prompt, input_ids=tuple(input_ids), blocks=blocks,
            tenant=tenant_id, tenant_tier=tier, max_tokens=max_tokens,
            temperature=float(temperature), top_p=float(parsed.top_p if parsed.top_p is not None else 1.0),
            seed=parsed.seed, stop=tuple(stop), stream=bool(parsed.stream), include_usage=include_usage,
            created=int(time.time()), chunks=chunks, fields=fields, control=control, cache_namespace=partition,
        )

    def _prompt(self, prompt: Any) -> tuple[str, list[int]]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            vocab = self.tokenizer.vocab_size
            for i, token in enumerate(prompt):
                if not 0 <= token < vocab:
                    raise BadRequest(f"prompt: token id {token} at {i} is outside the vocabulary (0 to {vocab - 1})",
                                     "prompt")
            return self.tokenizer.decode(prompt), list(prompt)
        raise BadRequest("prompt: one prompt per request (a string or a list of token ids)", "prompt")

    def _token_bound(self, prompt_tokens: int, asked: tuple[str, int | None], prompt_param: str,
                     limit: int | None) -> int:
        """The request's ``max_tokens`` once its prompt is tokenised: what it asked, else the default cut to the
        room the context leaves. ``BadRequest`` naming the prompt's field when the prompt alone is over
        ``limit`` (``max_prompt_tokens``) or fills the context, naming ``asked`` when prompt plus it is over."""
        if limit is not None and prompt_tokens > limit:
            raise BadRequest(f"{prompt_param}: {prompt_tokens} tokens, more than the {limit} allowed", prompt_param)
        name, value = asked
        context = self.context_tokens
        if context is None:
            return value if value is not None else self.default_max_tokens
        room = context - prompt_tokens
        if room < 1:
            raise BadRequest(f"{prompt_param}: {prompt_tokens} tokens leave no room for an answer in the model's "
                             f"context of {context} tokens", prompt_param)
        if value is None:
            return min(self.default_max_tokens, room)
        if value > room:
            raise BadRequest(f"{name}: {prompt_tokens} prompt tokens and {value} more exceed the model's context "
                             f"of {context} tokens (at most {room} here)", name)
        return value

    # -- responses ---------------------------------------------------------------------------------------

    @staticmethod
    def usage(finish: Finish) -> Usage:
        return Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens,
                     total_tokens=finish.prompt_tokens + finish.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=finish.cached_tokens))

    def body(self, request: GenerateRequest, done: Completion) -> dict[str, Any]:
        usage = self.usage(done.finish)
        if request.endpoint == "chat":
            body = ChatCompletionResponse(
                id=request.request_id, created=request.created, model=request.model, usage=usage,
                choices=[ChatChoice(index=0, message=AssistantMessage(content=done.text),
                                    finish_reason=done.finish.finish_reason)],
            ).model_dump(mode="json", exclude_none=True)
        else:
            body = CompletionResponse(
                id=request.request_id, created=request.created, model=request.model, usage=usage,
                choices=[CompletionChoice(index=0, text=done.text, finish_reason=done.finish.finish_reason)],
            ).model_dump(mode="json", exclude_none=True)
        if done.extras:
            merge_extras(body["choices"][0], done.extras, request.endpoint)
        return body

    def extra_chunk(self, request: GenerateRequest, piece: bytes, first: bool = False) -> bytes:
        """The chunk of an upstream engine's structured piece (a delta's tool calls, logprobs)."""
        document = json.loads(piece)
        choice: dict[str, Any] = {"index": 0}
        if request.endpoint == "chat":
            delta = dict(document.get("delta") or {})
            if first:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
            kind = "chat.completion.chunk"
        else:
            choice["text"] = ""
            kind = "text_completion"
        if "logprobs" in document:
            choice["logprobs"] = document["logprobs"]
        choice["finish_reason"] = None
        return _sse({"id": request.request_id, "object": kind, "created": request.created, "model": request.model,
                     "choices": [choice]})

    def chunk(self, request: GenerateRequest, text: str | None, finish: Finish | None = None,
              first: bool = False) -> bytes:
        reason = finish.finish_reason if finish is not None else None
        if request.endpoint == "chat":
            delta = Delta(role="assistant" if first else None, content=text)
            data = ChatCompletionChunk(id=request.request_id, created=request.created, model=request.model,
                                       choices=[ChunkChoice(index=0, delta=delta, finish_reason=reason)])
        else:
            data = CompletionResponse(id=request.request_id, created=request.created, model=request.model,
                                      choices=[CompletionChoice(index=0, text=text or "", finish_reason=reason)])
        return _sse(data.model_dump(mode="json", exclude_none=True))

    def usage_chunk(self, request: GenerateRequest, finish: Finish) -> bytes:
        model = ChatCompletionChunk if request.endpoint == "chat" else CompletionResponse
        data = model(id=request.request_id, created=request.created, model=request.model, choices=[],
                     usage=self.usage(finish))
        return _sse(data.model_dump(mode="json", exclude_none=True))


MAX_CHUNK_MESSAGES = 64  # a longer chat is sent without chunk offsets: finding them renders it once per message
_PROBES = (("user", "0"), ("assistant", "1"))  # two next messages that differ in role and content


def chat_chunks(tokenizer: Tokenizer, messages: list[tuple[str, str]], prompt: str,
                input_ids: list[int]) -> tuple[int, ...]:
    """The token offsets in ``input_ids`` where each rendered message starts (0 first), for KV chunk reuse;
    ``()`` when they cannot be found exactly. A message starts where the render of the messages before it,
    followed by either probe, stops agreeing with ``prompt``; the offsets count only if tokenising each span
    alone gives exactly the prompt's tokens (a span boundary inside a token fails that)."""
    if not 1 < len(messages) <= MAX_CHUNK_MESSAGES:
        return ()
    cuts = [0]
    for i in range(1, len(messages)):
        cut = min(len(os.path.commonprefix([prompt, tokenizer.render_chat([*messages[:i], probe])]))
                  for probe in _PROBES)
        if cut <= cuts[-1]:
            return ()
        cuts.append(cut)
    offsets: list[int] = []
    tokens: list[int] = []
    for a, b in zip(cuts, [*cuts[1:], len(prompt)], strict=True):
        offsets.append(len(tokens))
        tokens += tokenizer.encode(prompt[a:b])
    return tuple(offsets) if tokens == list(input_ids) else ()


def _sse(document: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _error(exc: ApiError, endpoint: str, api: Api) -> JSONResponse:
    api.requests.labels(endpoint, str(exc.status)).inc()
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(exc.retry_after + 0.999)))
    if exc.close:
        headers["Connection"] = "close"
    if exc.should_retry is not None:
        headers["x-should-retry"] = "true" if exc.should_retry else "false"
    return JSONResponse(error_response(exc).model_dump(mode="json"), status_code=exc.status, headers=headers)


def build_fastapi(api: Api) -> FastAPI:
    """The FastAPI app serving ``api``: the routes above, OpenAI error bodies for every refusal."""
    app = FastAPI(title="evocache", docs_url=None, redoc_url=None, openapi_url=None)

    async def generate(request: Request, endpoint: Literal["completions", "chat"]) -> Response:
        started = time.perf_counter()
        arrived = time.monotonic()
        try:
            tenant = authenticate(api.keys, authorization_header(request.headers.getlist("authorization")))
            _json_body(request.headers.getlist("content-type"), request.headers.getlist("content-encoding"))
            if api.limiter is not None:
                api.limiter.acquire(tenant.id)
            body = await _read_body(request, api.limits)
            kind: Literal["chat", "completion"] = "chat" if endpoint == "chat" else "completion"
            fields = None
            if api.upstream_fields is None:
                parsed = parse_request(body, kind, api.limits)
            else:
                parsed, fields = parse_upstream_request(body, kind, api.limits, api.upstream_fields)
            control, partition = client_cache(request.headers.getlist("cache-control"), parsed.cache)
            work = api.to_generate(parsed, tenant.id, tenant.tier, endpoint, fields, control, partition)
            deadline = arrived + request_timeout(request.headers.getlist(TIMEOUT_HEADER), api.limits)
            # Until the response starts, nobody else reads the connection: a closed one cancels the call.
            # (A stream's response listens itself from its first chunk on.)
            gone = asyncio.ensure_future(_gone(request))
            try:
                hit = await api.hit(work) if api.hits is not None else None
                if hit is not None and work.stream:
                    response = await _stream(api, work, deadline, gone, endpoint, hit)
                elif hit is not None:
                    done = completion_of(hit)
                    response = JSONResponse(api.body(work, done), headers=done.decision.headers())
                elif work.stream:
                    response = await _stream(api, work, deadline, gone, endpoint)
                else:
                    call = functools.partial(api.backend.complete, work)
                    done = await _answer(api, call, deadline, gone, endpoint)
                    response = JSONResponse(api.body(work, done), headers=done.decision.headers())
            finally:
                gone.cancel()
        except ApiError as exc:
            return _error(exc, endpoint, api)
        except Exception:  # a fault of the ingress itself: logged, and answered in OpenAI's shape
            log.exception("%s: unexpected failure", endpoint)
            return _error(ApiError("the server failed to handle the request"), endpoint, api)
        api.requests.labels(endpoint, "200").inc()
        api.latency.labels(endpoint).observe(time.perf_counter() - started)
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authenticate(api.keys, authorization_header(request.headers.getlist("authorization")))
        except ApiError as exc:
            return _error(exc, "models", api)
        listing = ModelList(data=[ModelCard(id=api.model_id, created=api.created)])
        return JSONResponse(listing.model_dump(mode="json"))

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        try:
            authorization_header(request.headers.getlist("authorization"))  # no key needed; never two
        except ApiError as exc:
            return _error(exc, "healthz", api)
        try:
            ok = await asyncio.wait_for(api.backend.ready(), timeout=min(api.ready_timeout_s, 5.0))
        except Exception as exc:  # noqa: BLE001 - any failure to reach a replica is "not ready"
            log.info("health check: no model replica ready: %s", exc)
            ok = False
        if not ok:
            return _error(Unavailable("no model replica is ready"), "healthz", api)
        return JSONResponse({"status": "ok", "model": api.model_id})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            api.admin_keys.authorize(authorization_header(request.headers.getlist("authorization")), api.keys)
        except ApiError as exc:
            return _error(exc, "metrics", api)
        return _exposition(await api.exposition())

    return app


def _exposition(text: bytes) -> Response:
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def build_metrics_app(api: Api) -> FastAPI:
    """An app serving only ``GET /metrics``, with no key: for a listener only the operator reaches."""
    app = FastAPI(title="evocache metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return _exposition(await api.exposition())

    return app


def serve_metrics(api: Api, host: str, port: int) -> Any:
    """Serve ``build_metrics_app(api)`` on ``host:port`` (0: a free port) from a daemon thread, once it listens
    or has failed to; returns the uvicorn server (``started`` says which; ``should_exit = True`` stops it). A
    port already taken is logged, by uvicorn and here, and serves nothing."""
    import uvicorn  # noqa: PLC0415 - only a deployment with a metrics port needs it here

    server = uvicorn.Server(uvicorn.Config(build_metrics_app(api), host=host, port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="evocache-metrics", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():  # uvicorn's start-up either listens or ends the thread
        time.sleep(0.01)
    if not server.started:
        log.warning("metrics: no listener on %s:%d (see uvicorn's error above)", host, port)
    return server


_MAX_AGE_DIGITS = 12


def client_cache(values: list[str], body: CacheDirectives | None) -> tuple[CacheControl | None, str]:
    """The client's cache directives and partition: ``Cache-Control`` headers (``no-store``, ``no-cache``,
    ``max-age=N``; other directives are ignored, as HTTP asks) and the body's ``cache`` object, together (the
    stricter of two bounds). ``BadRequest`` naming ``Cache-Control`` for a bound that is not a number."""
    no_store = no_cache = False
    max_age: float | None = None
    ttl: float | None = None
    for value in values:
        for directive in value.split(","):
            name, _, argument = directive.strip().partition("=")
            name = name.strip().lower()
            if name == "no-store":
                no_store = True
            elif name == "no-cache":
                no_cache = True
            elif name in ("max-age", "s-maxage"):
                seconds = argument.strip().strip('"')
                if not seconds.isdigit() or not seconds.isascii() or len(seconds) > _MAX_AGE_DIGITS:
                    raise BadRequest(f"Cache-Control: {name}={argument[:20]!r} is not a number of seconds",
                                     "Cache-Control")
                max_age = min(float(seconds), max_age if max_age is not None else float("inf"))
    partition = ""
    if body is not None:
        no_store |= body.no_store
        no_cache |= body.no_cache
        ttl = body.ttl
        if body.s_maxage is not None:
            max_age = min(body.s_maxage, max_age if max_age is not None else float("inf"))
        partition = body.namespace or ""
    if not (no_store or no_cache or max_age is not None or ttl is not None):
        return None, partition
    return CacheControl(no_store=no_store, no_cache=no_cache, max_age_s=max_age, ttl_s=ttl), partition


TIMEOUT_HEADER = "x-evocache-timeout"


def request_timeout(values: list[str], limits: Limits) -> float:
    """The seconds a request may take: ``limits.request_timeout_s``, or less when the client sent one
    ``x-evocache-timeout: <seconds>`` (a positive number; more than the limit is the limit). ``BadRequest``
    naming the header otherwise."""
    if not values:
        return limits.request_timeout_s
    where = f"{TIMEOUT_HEADER}: "
    if len(values) > 1:
        raise BadRequest(f"{where}sent {len(values)} times; send one", TIMEOUT_HEADER)
    try:
        seconds = float(values[0])
    except ValueError:
        raise BadRequest(f"{where}{values[0][:40]!r} is not a number of seconds", TIMEOUT_HEADER) from None
    if not 0 < seconds < float("inf"):
        raise BadRequest(f"{where}must be a positive number of seconds", TIMEOUT_HEADER)
    return min(seconds, limits.request_timeout_s)


def _json_body(content_types: list[str], encodings: Sequence[str] = ()) -> None:
    """Returns when the body is declared JSON: one ``Content-Type`` of ``application/json``, with no parameter
    but ``charset=utf-8`` (the only encoding read), and no ``Content-Encoding`` but ``identity`` (a compressed
    body is not decoded); ``UnsupportedMediaType`` otherwise."""
    if any(part.strip().lower() not in ("identity", "") for value in encodings for part in value.split(",")):
        raise UnsupportedMediaType("Content-Encoding: send the body uncompressed", "Content-Encoding")
    if len(content_types) != 1:
        raise UnsupportedMediaType("Content-Type: send one, application/json", "Content-Type")
    media, *parameters = (part.strip().lower() for part in content_types[0].split(";"))
    if media != "application/json" or any(p.replace(" ", "") not in ("charset=utf-8", 'charset="utf-8"', "")
                                          for p in parameters):
        raise UnsupportedMediaType("Content-Type: the body must be application/json (charset utf-8)",
                                   "Content-Type")


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, read until its end or one byte past ``limits.max_body_bytes`` (what ``parse_request``
    refuses as too large), within ``limits.body_timeout_s``; past it a 408. A declared length above the limit is
    refused before anything is read. Either refusal closes the connection, so the rest is never read."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes, more than the {limit} allowed")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                break
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout=limits.body_timeout_s)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {limits.body_timeout_s:g}s") from None


async def _gone(request: Request) -> None:
    """Returns once the client has closed its connection (the request's body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer(api: Api, call: Callable[[asyncio.Event], Awaitable[T]], deadline: float,
                  gone: asyncio.Future[None], endpoint: str) -> T:
    """``call(placed)``, a backend call, waited for in two parts: a replica must take it within
    ``ready_timeout_s`` (else ``Unavailable``, a 503 with ``Retry-After``: no replica ready, none computed
    anything), then it must answer by ``deadline`` (``time.monotonic()``; else ``GatewayTimeout``, a 504: the
    replica was working, and an identical retry would work as long). Whatever ends the wait early (either
    refusal, the client gone: ``ClientGone``) cancels the call, which cancels the replica's generation."""
    placed = asyncio.Event()
    task = asyncio.ensure_future(call(placed))
    waiter = asyncio.ensure_future(placed.wait())
    try:
        remaining = max(0.0, deadline - time.monotonic())
        ready_s = min(api.ready_timeout_s, remaining)
        await asyncio.wait((task, waiter, gone), timeout=ready_s, return_when=asyncio.FIRST_COMPLETED)
        if not (placed.is_set() or task.done() or gone.done()):
            if remaining <= api.ready_timeout_s:  # the request's own deadline passed first: a retry would too
                api.cancelled.labels(endpoint, "deadline").inc()
                raise GatewayTimeout("no model replica took the request before its deadline (limits.request_"
                                     f"timeout_s, or its {TIMEOUT_HEADER} header)")
            raise Unavailable(f"no model replica took the request within {ready_s:g}s", retry_after=1.0)
        await asyncio.wait((task, gone), timeout=max(0.0, deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        why = "client-gone" if gone.done() else "deadline"
        task.cancel()
        api.cancelled.labels(endpoint, why).inc()
        if gone.done():
            raise ClientGone("the client closed the connection before its answer")
        raise GatewayTimeout("the answer was not ready by the request's deadline (limits.request_timeout_s, or "
                             f"its {TIMEOUT_HEADER} header); its generation was cancelled")
    except ApiError:
        raise
    except Exception as exc:  # a replica that died or refused (Ray's backpressure) is "unavailable"
        log.warning("model replica call failed: %s: %s", type(exc).__name__, exc)
        raise Unavailable(f"no model replica could take the request ({type(exc).__name__})",
                          retry_after=1.0) from exc
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()


async def _replayed(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def _stream(api: Api, work: GenerateRequest, deadline: float, gone: asyncio.Future[None],
                  endpoint: str, hit: list[Any] | None = None) -> StreamingResponse:
    """The stream's headers once its ``Decision`` is in (within ``_answer``'s waits), then its chunks; for a
    ``hit`` the ingress found itself, its items."""
    items: Any = None  # the backend's stream: an async generator, closed here when the client goes

    def opening(placed: asyncio.Event) -> Awaitable[Decision | str | Finish]:
        nonlocal items
        items = api.backend.stream(work, placed)
        return anext(items)

    if hit is not None:
        items = _replayed(hit[1:])
        decision = hit[0]
    else:
        decision = await _answer(api, opening, deadline, gone, endpoint)
    if not isinstance(decision, Decision):
        await items.aclose()
        raise Unavailable("the model replica answered out of order")

    async def body() -> AsyncIterator[bytes]:
        first = True
        ended = False
        try:
            async for item in items:
                if isinstance(item, str):
                    if not item:
                        continue
                    yield api.chunk(work, item, first=first)
                    first = False
                elif isinstance(item, bytes):
                    yield api.extra_chunk(work, item, first=first)
                    first = False
                elif isinstance(item, Finish):
                    if first and work.endpoint == "chat":
                        yield api.chunk(work, "", first=True)
                    yield api.chunk(work, None, finish=item)
                    if work.include_usage:
                        yield api.usage_chunk(work, item)
            ended = True
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
            log.warning("stream %s failed: %s: %s", work.request_id, type(exc).__name__, exc)
            error = error_response(Unavailable(f"the answer stream failed ({type(exc).__name__})"))
            yield _sse(error.model_dump(mode="json"))
            ended = True
        finally:
            await items.aclose()  # the client gone mid-stream: the replica stops generating
            if not ended:
                api.cancelled.labels(endpoint, "client-gone").inc()
        yield DONE

    headers = decision.headers() | {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
