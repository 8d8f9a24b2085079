"""An OpenAI-compatible server as the engine behind the replicas: vLLM, SGLang, a hosted API.

``UpstreamConfig`` says where it is and how to talk to it; ``UpstreamClient`` is the one pooled async HTTP
client a replica holds for it (its own event loop in a thread of its own, a bound on requests in flight,
connect and read timeouts); ``UpstreamGenerator`` turns one request into the answer's pieces.

Every call goes upstream streamed (``stream: true`` with usage), whatever the client asked: the replica caches
the pieces a stream carries, so a streamed hit replays the first answer's chunks and a plain request and a
streamed one share an entry. A piece is either text (``str``, the content the client reads) or a JSON document
(``bytes``) for everything else the upstream said about the choice: a delta's tool calls or refusal, the
logprobs of its tokens, and last, the answer's end (``{"end": {"finish_reason", "usage"}}``, which the replica
reads and does not forward). Both kinds are what the cache's stream serializer stores, byte for byte.

Failures, as the ingress answers them: the upstream's 4xx is the client's (its status and OpenAI body passed
through: a 400 names the field the upstream named), except a refused gateway credential (401, 403), which is
the operator's (502); a 5xx, a reset connection or a malformed stream is a 502 (``BadGateway``); no byte
within ``read_timeout_s`` is a 504. A request that failed before its first byte is sent once more
(``retries``); after the first byte it fails as it is, and a failed answer is never stored. Closing the
answer's stream (a client gone, a deadline passed) closes the upstream request, which an engine such as vLLM
takes as an abort.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import ApiError, BadGateway, GatewayTimeout, ServingConfigError, UpstreamRefused

log = logging.getLogger("evocache.serving")

SHARED_SALT_VALUE = "evocache-shared"  # the salt a rule with kv.shared_prefixes sends: every tenant's alike
END = "end"  # the key of the last structured piece: the answer's finish reason and usage
_DONE = object()


class _Ended:
    """A stream's failure, handed from the client's loop to the reader."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error
# Response fields that say nothing about the answer, dropped from each piece (they differ call to call).
_QUIET_DELTA = frozenset({"role"})


class UpstreamConfig(BaseModel):
    """Where the engine is (``url``: its OpenAI base, ``http://host:port/v1``) and how it is called.

    ``model``: the name the upstream serves the model under (default: the model's ``id``). The upstream's API
    key, when it needs one, comes from ``api_key_env`` (an environment variable's name) or ``api_key_file``,
    read where the replica starts; a client's key never reaches it. ``fields``: request fields beyond
    OpenAI's that clients may send and the upstream honours (vLLM's ``top_k``, ``min_p``,
    ``repetition_penalty``, ...): passed through and keyed. ``salt``: send ``cache_salt`` so the engine's
    own prefix cache is partitioned by tenant (vLLM, SGLang); false for an upstream that refuses the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$")
    model: str | None = Field(None, min_length=1, max_length=256)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_key_file: str | None = None
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)  # the longest silence between two bytes of an answer
    max_concurrency: int = Field(64, ge=1, le=4096)  # requests in flight to the upstream per replica
    retries: int = Field(1, ge=0, le=5)  # sends more of a request that failed before its first byte
    salt: bool = True
    fields: tuple[str, ...] = ()

    @field_validator("url")
    @classmethod
    def _no_trailing_slash(cls, url: str) -> str:
        return url.rstrip("/")

    @model_validator(mode="after")
    def _one_key_source(self) -> UpstreamConfig:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both")
        for name in self.fields:
            if not name.isidentifier():
                raise ValueError(f"fields: {name!r} is not a field name")
        return self

    def api_key(self) -> str | None:
        """The upstream's key: ``ServingConfigError`` naming the variable or file when it is named but absent."""
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ServingConfigError(f"upstream.api_key_env: the environment variable {self.api_key_env} is "
                                         "not set in the replica's environment")
            return key.strip()
        if self.api_key_file is not None:
            try:
                key = Path(self.api_key_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ServingConfigError(f"upstream.api_key_file: cannot read {self.api_key_file}: {exc}") from exc
            if not key:
                raise ServingConfigError(f"upstream.api_key_file: {self.api_key_file} is empty")
            return key
        return None


def tenant_salt(secret: bytes, namespace: str) -> str:
    """The ``cache_salt`` of a tenant's requests: a keyed digest of its namespace, so the engine partitions its
    prefix cache by tenant and nobody without the store's secret can compute another tenant's salt."""
    return hmac.new(secret, b"evocache cache_salt\0" + namespace.encode(), hashlib.sha256).hexdigest()[:32]


def _error_fields(body: Any) -> tuple[str, str | None, str | None, str | None]:
    """``(message, type, param, code)`` from an upstream's error body: OpenAI's ``{"error": {...}}`` or vLLM's
    older flat ``{"object": "error", "message": ...}``."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, str):
        detail = {"message": detail}
    if not isinstance(detail, dict):
        detail = body if isinstance(body, dict) else {}
    def text(name: str) -> str | None:
        value = detail.get(name)
        return str(value) if value is not None else None
    return text("message") or "the upstream refused the request", text("type"), text("param"), text("code")


def _refusal(status: int, payload: bytes, retry_after: str | None) -> ApiError:
    try:
        body = json.loads(payload)
    except ValueError:
        body = {"message": payload[:500].decode("utf-8", errors="replace")}
    message, kind, param, code = _error_fields(body)
    if status in (401, 403, 407):
        return BadGateway(f"the upstream refused the gateway's credentials ({status}): {message}")
    if status >= 500 or status < 400:
        return BadGateway(f"the upstream failed ({status}): {message}")
    seconds = None
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:
            seconds = None
    return UpstreamRefused(status, message, param, error_type=kind, code=code, retry_after=seconds)


class UpstreamClient:
    """One pooled ``httpx.AsyncClient`` on an event loop of its own (a daemon thread), used from the replica's
    worker threads through ``events`` and ``models``. ``max_concurrency`` bounds the requests in flight and
    the pool's connections."""

    def __init__(self, config: UpstreamConfig, *, transport: Any = None) -> None:
        import httpx  # noqa: PLC0415 - the upstream's replicas only

        self.config = config
        self._httpx = httpx
        key = config.api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="evocache-upstream", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=config.max_concurrency,
                              max_keepalive_connections=min(config.max_concurrency, 32))

        async def build() -> tuple[Any, asyncio.Semaphore]:
            client = httpx.AsyncClient(base_url=config.url + "/", headers=headers, timeout=timeout, limits=limits,
                                       transport=transport)
            return client, asyncio.Semaphore(config.max_concurrency)

        self._client, self._slots = self._run(build())
        self.errors: Any = None  # a prometheus Counter by kind, when the replica gives one

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _count(self, kind: str) -> None:
        if self.errors is not None:
            self.errors.labels(kind).inc()

    def models(self) -> list[dict[str, Any]]:
        """The upstream's ``GET /models`` listing; ``BadGateway`` or ``GatewayTimeout`` when it cannot be read."""
        async def get() -> Any:
            response = await self._client.get("models")
            if response.status_code != 200:
                raise _refusal(response.status_code, response.content, response.headers.get("retry-after"))
            return response.json()

        try:
            listing = self._run(self._guard(get()))
        except ValueError as exc:
            raise BadGateway(f"the upstream's /models is not JSON: {exc}") from exc
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list):
            raise BadGateway("the upstream's /models has no data list")
        return [card for card in data if isinstance(card, dict)]

    async def _guard(self, coroutine: Any) -> Any:
        """``coroutine`` with the transport's failures as the API's: a timeout a 504, anything else a 502."""
        httpx = self._httpx
        try:
            return await coroutine
        except ApiError:
            raise
        except httpx.TimeoutException as exc:
            self._count("timeout")
            raise GatewayTimeout(f"the upstream did not answer in time ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            self._count("transport")
            raise BadGateway(f"the upstream could not be reached ({type(exc).__name__}: {exc})") from exc

    def events(self, path: str, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON events of a streamed ``POST path`` (``chat/completions`` or ``completions``). A task on the
        client's loop reads the stream into a queue this iterator takes from, so an event costs the reader one
        queue hand-off, not a round trip to the loop; closing the iterator cancels the task, which closes the
        upstream request."""
        handoff: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def read() -> None:
            try:
                async for event in self._events(path, body):
                    handoff.put(event)
                handoff.put(_DONE)
            except BaseException as exc:  # noqa: BLE001 - every end, a cancellation included, reaches the reader
                handoff.put(_Ended(self._mapped(exc)))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        task = asyncio.run_coroutine_threadsafe(read(), self._loop)
        ended = False
        try:
            while True:
                item = handoff.get()
                if item is _DONE:
                    ended = True
                    return
                if type(item) is _Ended:
                    ended = True
                    raise item.error
                yield item
        finally:
            if not ended:
                task.cancel()  # the reader stops; its stream and the upstream request close

    def _mapped(self, exc: BaseException) -> BaseException:
        """A stream's failure as the API's: a timeout a 504, a transport failure a 502, an ``ApiError`` itself."""
        httpx = self._httpx
        if isinstance(exc, httpx.TimeoutException):
            self._count("timeout")
            return GatewayTimeout(f"the upstream did not answer in time ({type(exc).__name__})")
        if isinstance(exc, httpx.HTTPError):
            self._count("transport")
            return BadGateway(f"the upstream could not be reached ({type(exc).__name__}: {exc})")
        return exc

    async def _events(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        httpx = self._httpx
        async with self._slots:
            attempts = self.config.retries + 1
            while True:
                attempts -= 1
                try:
                    request = self._client.build_request("POST", path, json=body)
                    response = await self._client.send(request, stream=True)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ConnectTimeout) as exc:
                    if attempts > 0:  # nothing was received: sending it again is safe
                        self._count("retried")
                        log.info("upstream %s: %s; sending it again", path, type(exc).__name__)
                        continue
                    raise
                try:
                    if response.status_code >= 400:
                        payload = await response.aread()
                        if response.status_code in (502, 503) and attempts > 0:
                            self._count("retried")
                            continue
                        self._count("refused" if response.status_code < 500 else "failed")
                        raise _refusal(response.status_code, payload, response.headers.get("retry-after"))
                    async for event in _sse_events(response):
                        yield event
                    return
                finally:
                    await response.aclose()

    def close(self) -> None:
        try:
            self._run(self._client.aclose(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - closing at shutdown: nothing left to answer
            log.info("closing the upstream client: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)


async def _sse_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The ``data:`` documents of a server-sent event stream, up to ``[DONE]``; an error event, a line that is
    not JSON or a stream that ends without ``[DONE]`` is a ``BadGateway`` (the answer may be cut short)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError as exc:
            raise BadGateway(f"the upstream sent an event that is not JSON: {data[:80]!r}") from exc
        if not isinstance(event, dict):
            raise BadGateway("the upstream sent an event that is not a JSON object")
        if "error" in event:
            message, *_ = _error_fields(event)
            raise BadGateway(f"the upstream's stream failed: {message}")
        yield event
    raise BadGateway("the upstream's stream ended before [DONE]")


def piece(document: Mapping[str, Any]) -> bytes:
    """A structured piece: ``document`` as compact JSON bytes."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


class UpstreamGenerator:
    """The answers of one upstream model: ``answer(endpoint, body)`` streams it (module docstring)."""

    pieces_are_tokens = False

    def __init__(self, config: UpstreamConfig, model: str, client: UpstreamClient | None = None) -> None:
        self.config = config
        self.model = config.model or model
        self.client = client or UpstreamClient(config)

    def answer(self, endpoint: Literal["completions", "chat"], body: Mapping[str, Any]) -> Iterator[str | bytes]:
        """The pieces of the upstream's answer to ``body`` (the request's fields; model and streaming are set
        here), then the end piece."""
        request = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        path = "chat/completions" if endpoint == "chat" else "completions"
        finish: str | None = None
        usage: dict[str, Any] | None = None
        for event in self.client.events(path, request):
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                extra: dict[str, Any] = {}
                if endpoint == "chat":
                    delta = dict(choice.get("delta") or {})
                    text = delta.pop("content", None)
                    rest = {k: v for k, v in delta.items() if k not in _QUIET_DELTA and v not in (None, "", [])}
                    if rest:
                        extra["delta"] = rest
                else:
                    text = choice.get("text")
                if choice.get("logprobs"):
                    extra["logprobs"] = choice["logprobs"]
                if isinstance(text, str) and text:
                    yield text
                if extra:
                    yield piece(extra)
                finish = choice.get("finish_reason") or finish
        if finish is None:
            raise BadGateway("the upstream's answer ended without a finish reason")
        yield piece({END: {"finish_reason": finish, "usage": usage or {}}})

    def close(self) -> None:
        self.client.close()


def merge_extras(choice: dict[str, Any], extras: tuple[bytes, ...], endpoint: str) -> None:
    """Fold an upstream answer's structured pieces into its whole ``choice``, as OpenAI's own non-streamed
    answer has them: tool calls assembled by index (ids, names and argument pieces), other delta fields
    concatenated, logprobs joined."""
    message = choice.get("message") if endpoint == "chat" else None
    calls: dict[int, dict[str, Any]] = {}
    logprobs: dict[str, Any] | None = None
    for raw in extras:
        document = json.loads(raw)
        for name, value in (document.get("delta") or {}).items():
            if message is None:
                continue
            if name == "tool_calls" and isinstance(value, list):
                for part in value:
                    _add_call(calls, part)
            elif isinstance(value, str):
                message[name] = (message.get(name) or "") + value
            else:
                message[name] = value
        got = document.get("logprobs")
        if isinstance(got, dict):
            logprobs = _join_logprobs(logprobs, got)
    if calls and message is not None:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
        if not message.get("content"):
            message["content"] = None
    if logprobs is not None:
        choice["logprobs"] = logprobs


def _add_call(calls: dict[int, dict[str, Any]], part: Any) -> None:
    if not isinstance(part, dict):
        return
    index = part.get("index", len(calls))
    call = calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    if part.get("id"):
        call["id"] = part["id"]
    if part.get("type"):
        call["type"] = part["type"]
    function = part.get("function") or {}
    for name in ("name", "arguments"):
        if isinstance(function.get(name), str):
            call["function"][name] += function[name]


def _join_logprobs(so_far: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Two chunks' logprobs as one: every list field (chat's ``content``, a completion's ``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``) concatenated."""
    if so_far is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in more.items()}
    for name, value in more.items():
        if isinstance(value, list) and isinstance(so_far.get(name), list):
            so_far[name].extend(value)
        elif name not in so_far or so_far[name] is None:
            so_far[name] = list(value) if isinstance(value, list) else value
    return so_far
