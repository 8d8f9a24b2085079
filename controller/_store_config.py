"""The store configuration, nested by part and validated once, here, at the edge.

    StoreConfig(
        l1=L1Config(bytes=64 * MiB, eviction="lru"),
        redis=RedisConfig(url="redis://10.0.0.5:6379/0", l2_bytes=8 << 30),   # default: $EVOCACHE_REDIS_URL
        disk=DiskConfig(path="/var/cache/evocache"),
        events=EventsConfig(sink="jsonl", path="events.jsonl"),
        semantic=SemanticConfig(embedder=EmbedderConfig(kind="minilm", threads=1)),
    )

A part that is ``None`` (``redis``, ``disk``) is a tier the store does not have. ``StoreConfig.parse`` takes the
same shape as a mapping (a YAML or JSON document). Every invalid value raises ``StoreConfigError`` naming its
place (``redis.url: ...``); an old flat keyword (``redis_url=``) raises ``TypeError`` naming its new place.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from ._codec import MIN_SECRET_BYTES
from .errors import StoreConfigError
from .semantic._config import EmbedderConfig, SemanticConfig

__all__ = [
    "DiskConfig",
    "EmbedderConfig",
    "EventsConfig",
    "L1Config",
    "RedisConfig",
    "SemanticConfig",
    "StoreConfig",
]

MiB = 1 << 20
REDIS_URL_ENV = "EVOCACHE_REDIS_URL"


def _config_error(issues: list[str]) -> StoreConfigError:
    return StoreConfigError("invalid store configuration: " + "; ".join(issues), issues)


def _invalid(exc: ValidationError, where: str) -> StoreConfigError:
    """``exc`` as ``StoreConfigError`` whose lines name each field from the store configuration's root."""
    issues: list[str] = []
    for error in exc.errors():
        nested = error.get("ctx", {}).get("error")
        if isinstance(nested, StoreConfigError):  # a part built inside this one named its fields already
            issues.extend(nested.issues)
            continue
        place = ".".join(filter(None, (where, *map(str, error["loc"]))))
        message = error["msg"].removeprefix("Value error, ")
        issues.append(f"{place}: {message}" if place else message)
    return _config_error(issues)


class _Part(BaseModel):
    """A frozen part of the store configuration; invalid values raise ``StoreConfigError`` naming
    ``<part>.<field>``, whether the part is built alone or inside ``StoreConfig``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    _part: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _invalid(exc, self._part) from exc


class L1Config(_Part):
    """Process memory: ``bytes`` of entries (payload and key; see ``MemoryTier``), evicted by the registered
    policy ``eviction`` names (a policy document's ``eviction.l1`` overrides it). ``models``: the directory
    of trained eviction models a policy's ``eviction.model`` names (JSON files, as the loop's retraining
    writes them); without it a policy that names a model is refused."""

    _part: ClassVar[str] = "l1"

    bytes: int = Field(64 * MiB, gt=0)
    eviction: str = "lru"
    models: str | None = Field(None, min_length=1)


class RedisConfig(_Part):
    """L2, and where the Redis event stream and the shared semantic index live.

    ``url`` names one Redis (``redis://host:6379/0``, ``rediss://``, ``unix://``) or a Redis Cluster
    (``redis+cluster://host:6379``, several nodes comma-separated, ``rediss+cluster://`` over TLS; database 0
    only): ``controller._redis_client``. On a cluster each tenant's L2 entries and quota bookkeeping share one
    hash slot, and so does the whole shared semantic index and the event stream.

    ``l2_bytes`` is evocache's share of Redis memory: tenant quotas in L2 are the policy's ``l2_share`` of it
    (without it L2 has no per-tenant quota and Redis's own maxmemory policy governs). ``timeout_s`` bounds each
    call; after a failure Redis is left alone for ``retry_after_s`` (``controller._breaker``).

    ``secret`` (or the file ``secret_file`` holding it) signs every entry; every replica sharing this Redis must
    have the same one. Without either, ``$EVOCACHE_SECRET``, and without that a key file on this host
    (``controller._secret``): replicas on other hosts then miss each other's entries.
    """

    _part: ClassVar[str] = "redis"

    url: str
    prefix: str = Field("evc", pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    l2_bytes: int | None = Field(None, gt=0)
    timeout_s: float = Field(0.05, gt=0)
    retry_after_s: float = Field(1.0, ge=0)
    secret: SecretStr | None = None
    secret_file: str | None = None

    @field_validator("url")
    @classmethod
    def _a_redis_url(cls, url: str) -> str:
        from redis.connection import parse_url

        from ._redis_client import cluster_url, is_cluster

        if is_cluster(url):
            try:
                cluster_url(url)
                parse_url(cluster_url(url)[1])
            except ValueError as exc:
                raise ValueError(str(exc)) from None
            return url
        try:
            parse_url(url)
        except ValueError as exc:
            raise ValueError(f"{url!r} is not a Redis URL: {exc}") from None
        path = url.split("?", 1)[0].split("://", 1)[1].partition("/")[2]
        if not url.startswith("unix://") and path and not re.fullmatch(r"\d+", path):
            raise ValueError(f"{url!r} is not a Redis URL: the database after the host must be a number")
        return url

    @field_validator("secret")
    @classmethod
    def _long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value().encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"a secret needs at least {MIN_SECRET_BYTES} bytes")
        return secret

    @model_validator(mode="after")
    def _one_secret(self) -> RedisConfig:
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("give secret or secret_file, not both")
        return self


class DiskConfig(_Part):
    """L3: a diskcache directory at ``path``, bounded to about ``bytes``."""

    _part: ClassVar[str] = "disk"

    path: str = Field(min_length=1)
    bytes: int = Field(1024 * MiB, gt=0)


class EventsConfig(_Part):
    """Where access events go: ``ring`` (the last ``ring_capacity`` in memory), ``jsonl`` (appended to
    ``path``), ``redis`` (a capped stream in the store's Redis) or ``none``."""

    _part: ClassVar[str] = "events"

    sink: Literal["ring", "jsonl", "redis", "none"] = "ring"
    path: str | None = None
    ring_capacity: int = Field(100_000, gt=0)

    @model_validator(mode="after")
    def _jsonl_has_a_path(self) -> EventsConfig:
        if self.sink == "jsonl" and not self.path:
            raise ValueError("sink jsonl needs a path")
        return self


def _redis_from_env() -> RedisConfig | None:
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        return None
    try:
        return RedisConfig(url=url)
    except StoreConfigError as exc:
        raise StoreConfigError(f"{exc} (from ${REDIS_URL_ENV})") from exc


# Where each field of the flat configuration went: an old keyword is refused with its new place.
_MOVED = {
    "l1_bytes": "l1.bytes",
    "l1_eviction": "l1.eviction",
    "redis_url": "redis.url",
    "l2_bytes": "redis.l2_bytes",
    "l2_prefix": "redis.prefix",
    "l2_timeout_s": "redis.timeout_s",
    "l2_retry_after_s": "redis.retry_after_s",
    "disk_path": "disk.path",
    "l3_bytes": "disk.bytes",
    "events_path": "events.path",
    "ring_capacity": "events.ring_capacity",
    "embedder": "semantic.embedder.kind",
    "embedder_url": "semantic.embedder.url",
    "embedder_model": "semantic.embedder.model",
    "embedder_api_key_env": "semantic.embedder.api_key_env",
    "embedder_threads": "semantic.embedder.threads",
    "semantic_shared": "semantic.shared",
}
_PART_CLASSES = {
    "l1": "L1Config",
    "redis": "RedisConfig",
    "disk": "DiskConfig",
    "events": "EventsConfig",
    "semantic": "SemanticConfig",
    "embedder": "EmbedderConfig",
}


def _spelled(path: str, value: str = "...") -> str:
    """``redis.url`` as the keywords that set it: ``redis=RedisConfig(url=...)``."""
    head, _, rest = path.partition(".")
    if not rest:
        return f"{head}={value}"
    return f"{head}={_PART_CLASSES[head]}({_spelled(rest, value)})"


def _moved(data: Mapping[str, object]) -> list[tuple[str, str, str]]:
    """(old keyword, new dotted place, how to write it) for each flat keyword in ``data``."""
    found = [(key, _MOVED[key], _spelled(_MOVED[key])) for key in data if key in _MOVED]
    events = data.get("events")
    if isinstance(events, str):
        found.append(("events", "events.sink", _spelled("events.sink", repr(events))))
    return found


class StoreConfig(BaseModel):
    """Where entries and events go: one part per tier and per service (module docstring).

    ``redis`` defaults to ``RedisConfig(url=$EVOCACHE_REDIS_URL)`` when that is set (cluster mode); without
    it there is no L2, no Redis event stream and no shared semantic index. ``disk`` enables L3.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    l1: L1Config = Field(default_factory=L1Config)
    redis: RedisConfig | None = Field(default_factory=_redis_from_env)
    disk: DiskConfig | None = None
    events: EventsConfig = Field(default_factory=EventsConfig)
    semantic: SemanticConfig = Field(default_factory=SemanticConfig)

    def __init__(self, **data: Any) -> None:
        moved = _moved(data)
        if moved:
            old, _, new = moved[0]
            shown = f"{old}={data[old]!r}" if old == "events" else f"{old}=..."
            raise TypeError(f"StoreConfig({shown}) is now StoreConfig({new})")
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _invalid(exc, "") from exc

    @model_validator(mode="after")
    def _sinks_have_their_targets(self) -> StoreConfig:
        if self.events.sink == "redis" and self.redis is None:
            raise ValueError("events.sink redis needs a redis part (RedisConfig)")
        return self

    @classmethod
    def parse(cls, data: Mapping[str, object]) -> StoreConfig:
        """Validate a mapping of the same shape (``{"redis": {"url": ...}, ...}``); errors become
        ``StoreConfigError`` naming each field."""
        if not isinstance(data, Mapping) or not all(isinstance(key, str) for key in data):
            raise _config_error(["the store configuration must be a mapping with string keys"])
        moved = _moved(data)
        if moved:
            raise _config_error([f"{old}: is now {new}" for old, new, _ in moved])
        return cls(**data)
