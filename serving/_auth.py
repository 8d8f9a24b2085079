"""Tenants from a verified identity: ``Authorization: Bearer <key>`` -> the key's tenant and tier.

The tenant is only ever what the key maps to; no request field can choose it. Keys are kept as their
SHA-256 digests, looked up by digest and compared with ``hmac.compare_digest``, so neither the key file
in memory nor the comparison reveals a key.

Key file (YAML or JSON, loaded with ``yaml.safe_load``)::

    keys:
      - sha256: 9f86d081884c7d65...   # hex digest of the key (preferred), or
        tenant: acme
        tier: pro
      - key: sk-plain-text            # the key itself, hashed on load
        tenant: globex

A Redis hash holds the same records: field = hex digest, value = ``{"tenant": ..., "tier": ...}`` (JSON).

What spans every tenant (``/metrics``) is the operator's: ``AdminKeys`` holds the digests of the keys that may
read it, apart from the tenants' keys; a tenant's key there is refused with 403.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pydantic
import redis
import yaml
from redis.cluster import RedisCluster

from evocache.controller import REDIS_ERRORS, NotARegularFile, Tenant, namespace_for, read_bounded
from evocache.controller import connect_redis as connect

from .errors import BadRequest, Forbidden, RateLimited, ServingConfigError, Unauthenticated, Unavailable

MAX_KEY_FILE_BYTES = 1 << 20
MAX_KEY_CHARS = 256
DEFAULT_REDIS_KEY = "evocache:api-keys"


def key_digest(key: str) -> bytes:
    """The SHA-256 digest under which an API key is stored."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def authorization_header(values: list[str]) -> str | None:
    """The request's one ``Authorization`` header (``values``: every one it sent), or None; ``BadRequest``
    when it sent several, which proxies and frameworks resolve differently (first, last, joined), so no
    single one is taken on trust."""
    if len(values) > 1:
        raise BadRequest(f"Authorization: sent {len(values)} times; send one 'Authorization: Bearer <api key>'",
                         "Authorization")
    return values[0] if values else None


def bearer_key(authorization: str | None) -> str:
    """The key in an ``Authorization: Bearer <key>`` header; ``Unauthenticated`` when absent or malformed."""
    if authorization is None:
        raise Unauthenticated("missing Authorization header: send 'Authorization: Bearer <api key>'")
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthenticated("malformed Authorization header: expected 'Bearer <api key>'")
    if len(key) > MAX_KEY_CHARS or not key.isascii() or not key.isprintable() or " " in key:
        raise Unauthenticated("malformed API key")
    return key


class KeyStore(Protocol):
    """Maps an API key to its tenant; raises ``Unauthenticated`` for a key it does not hold."""

    def tenant_for(self, key: str) -> Tenant: ...


def authenticate(store: KeyStore, authorization: str | None) -> Tenant:
    """The tenant of the request whose ``Authorization`` header is ``authorization``."""
    return store.tenant_for(bearer_key(authorization))


class _Record(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    tenant: str
    tier: str = "default"

    @pydantic.field_validator("tenant")
    @classmethod
    def _valid_tenant(cls, value: str) -> str:
        namespace_for(value)  # raises ValueError naming what is wrong
        return value

    def as_tenant(self) -> Tenant:
        return Tenant(self.tenant, self.tier)


class _FileRecord(_Record):
    sha256: str | None = pydantic.Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    key: str | None = pydantic.Field(default=None, min_length=1, max_length=MAX_KEY_CHARS)

    @pydantic.model_validator(mode="after")
    def _one_key(self) -> _FileRecord:
        if (self.sha256 is None) == (self.key is None):
            raise ValueError("give exactly one of 'sha256' and 'key'")
        return self

    def digest(self) -> bytes:
        return bytes.fromhex(self.sha256) if self.sha256 is not None else key_digest(self.key or "")


class _KeyFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    keys: list[_FileRecord]


def _yaml_document(path: Path, data: bytes) -> tuple[Any, yaml.Node | None]:
    """The document in ``data`` and its node tree (whose marks give each value's line); ``ServingConfigError``
    naming ``path`` and the line (and column) where it stops being UTF-8 or YAML."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ServingConfigError(f"{path}:{line}: not UTF-8 text") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        return (None if node is None else loader.construct_document(node)), node
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = "; ".join(filter(None, (exc.context, exc.problem)))
        raise ServingConfigError(f"{where}: not valid YAML or JSON: {problem}") from None
    except yaml.YAMLError as exc:
        raise ServingConfigError(f"{path}: not valid YAML or JSON: {exc}") from None
    finally:
        loader.dispose()


def _line(node: yaml.Node | None, loc: tuple[int | str, ...]) -> int:
    """The line (from 1) of the value at ``loc`` in the node tree, or of the nearest value around it that the
    document has (a missing field: its record's line)."""
    if node is None:
        return 1
    for step in loc:
        if isinstance(node, yaml.MappingNode):
            found = next((value for key, value in node.value if getattr(key, "value", None) == step), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and 0 <= step < len(node.value):
            found = node.value[step]
        else:
            found = None
        if found is None:
            break
        node = found
    return node.start_mark.line + 1


def _issues(path: Path, node: yaml.Node | None, exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{path}:{_line(node, e['loc'])}: {'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}"
        for e in exc.errors()
    )


def _match(table: Mapping[bytes, Tenant], key: str) -> Tenant:
    digest = key_digest(key)
    for stored, tenant in table.items() if digest in table else ():
        if hmac.compare_digest(stored, digest):
            return tenant
    raise Unauthenticated("unknown API key")


@dataclass(frozen=True)
class FileKeyStore:
    """API keys read once from a file (see the module docstring for its shape)."""

    table: Mapping[bytes, Tenant]

    @classmethod
    def load(cls, path: str | os.PathLike[str], max_bytes: int = MAX_KEY_FILE_BYTES) -> FileKeyStore:
        """Reads ``path``; ``ServingConfigError`` when it is not a regular file, is group- or world-writable,
        is larger than ``max_bytes`` or does not hold valid records. A message about the content names the
        file and the line (``keys.yaml:3: keys.0.tenant: ...``; the column too for a YAML syntax error), so
        ``evocache serve`` can refuse the file before Ray starts."""
        path = Path(path)
        try:
            data, mode = read_bounded(path, max_bytes)
        except NotARegularFile:
            raise ServingConfigError(f"{path}: not a regular file") from None
        except OSError as exc:
            raise ServingConfigError(f"{path}: cannot read the API-key file: {exc.strerror}") from exc
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ServingConfigError(
                f"{path}: group- or world-writable (mode {stat.filemode(mode)}); "
                "an API-key file must be writable by its owner only (chmod 600)"
            )
        if len(data) > max_bytes:
            raise ServingConfigError(f"{path}: larger than {max_bytes} bytes")
        document, node = _yaml_document(path, data)
        try:
            records = _KeyFile.model_validate(document).keys
        except pydantic.ValidationError as exc:
            raise ServingConfigError(_issues(path, node, exc)) from None
        table: dict[bytes, Tenant] = {}
        for i, record in enumerate(records):
            digest = record.digest()
            if digest in table:
                line = _line(node, ("keys", i))
                raise ServingConfigError(f"{path}:{line}: keys.{i}: the same key is listed twice")
            table[digest] = record.as_tenant()
        return cls(table)

    def tenant_for(self, key: str) -> Tenant:
        return _match(self.table, key)


@dataclass(frozen=True)
class RedisKeyStore:
    """API keys in a Redis hash (field: the key's hex SHA-256; value: ``{"tenant", "tier"}`` as JSON), read on
    every lookup so that a key added or revoked takes effect at once. One key, so on a Redis Cluster the hash
    lives on one primary; ``from_url`` takes either kind of URL (``redis+cluster://`` for a cluster)."""

    client: redis.Redis | RedisCluster
    hash_key: str = DEFAULT_REDIS_KEY

    @classmethod
    def from_url(
        cls, url: str, hash_key: str = DEFAULT_REDIS_KEY, *, timeout_s: float = 1.0
    ) -> RedisKeyStore:
        """The store in the Redis (or Redis Cluster) at ``url``; ``timeout_s`` bounds each lookup. A
        cluster none of whose nodes answers raises ``Unavailable``."""
        try:
            client = connect(url, socket_timeout=timeout_s, connect_timeout=timeout_s)
        except REDIS_ERRORS as exc:
            raise Unavailable(f"the API-key store cannot be reached: {exc}") from exc
        return cls(client, hash_key)

    def add(self, key: str, tenant: Tenant) -> None:
        record = _Record(tenant=tenant.id, tier=tenant.tier)
        self.client.hset(self.hash_key, key_digest(key).hex(), record.model_dump_json())

    def revoke(self, key: str) -> None:
        self.client.hdel(self.hash_key, key_digest(key).hex())

    def tenant_for(self, key: str) -> Tenant:
        digest = key_digest(key).hex()
        try:
            raw = self.client.hget(self.hash_key, digest)
        except REDIS_ERRORS as exc:
            raise Unavailable(f"the API-key store cannot be reached: {exc}") from exc
        if raw is None:
            raise Unauthenticated("unknown API key")
        try:
            record = _Record.model_validate(json.loads(raw))
        except (ValueError, pydantic.ValidationError) as exc:
            raise ServingConfigError(
                f"redis hash {self.hash_key!r}, field {digest[:12]}...: invalid record: {exc}"
            ) from exc
        return record.as_tenant()


def read_key_file(path: str | os.PathLike[str]) -> str:
    """The one key a file holds (its first line, as a Prometheus ``credentials_file`` reads it);
    ``ServingConfigError`` when it is not a regular file, others may read or write it, or it holds no valid key."""
    path = Path(path)
    try:
        data, mode = read_bounded(path, MAX_KEY_CHARS + 2)
    except NotARegularFile:
        raise ServingConfigError(f"{path}: not a regular file") from None
    except OSError as exc:
        raise ServingConfigError(f"{path}: cannot read the key file: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ServingConfigError(f"{path}: readable or writable by others (mode {stat.filemode(mode)}); a key "
                                 "file must be its owner's only (chmod 600)")
    if len(data) > MAX_KEY_CHARS + 2:
        raise ServingConfigError(f"{path}: larger than a key (at most {MAX_KEY_CHARS} characters and a newline)")
    lines = data.decode("utf-8", errors="replace").splitlines()
    try:
        return bearer_key(f"Bearer {lines[0] if lines else ''}")
    except Unauthenticated:
        raise ServingConfigError(f"{path}: no valid key on its first line (printable ASCII, no spaces, at most "
                                 f"{MAX_KEY_CHARS} characters)") from None


@dataclass(frozen=True)
class AdminKeys:
    """The keys that may read what spans every tenant (``/metrics``), as SHA-256 digests. Empty by default: then
    no key reads it."""

    digests: frozenset[bytes] = frozenset()

    @classmethod
    def from_hex(cls, digests: Iterable[str]) -> AdminKeys:
        """From hex SHA-256 digests (as ``MetricsConfig.admin_keys`` holds them, validated there)."""
        return cls(frozenset(bytes.fromhex(d) for d in digests))

    def authorize(self, authorization: str | None, tenants: KeyStore) -> None:
        """Returns when ``authorization`` carries an admin key. ``Unauthenticated`` (401) for no key, a malformed
        one or one that neither list holds; ``Forbidden`` (403) for a tenant's key. Neither says more."""
        key = bearer_key(authorization)
        digest = key_digest(key)
        if any(hmac.compare_digest(stored, digest) for stored in self.digests):
            return
        tenants.tenant_for(key)  # Unauthenticated for a key nobody holds
        raise Forbidden("this endpoint needs the operator's admin key; an API key cannot read it")


@dataclass(frozen=True)
class Rate:
    """``per_second`` requests refilled each second, up to ``burst`` at once."""

    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not self.per_second > 0 or not self.burst >= 1:
            raise ValueError(f"a rate needs per_second > 0 and burst >= 1, got {self}")


@dataclass
class _Bucket:
    tokens: float
    stamp: float


@dataclass
class RateLimiter:
    """A token bucket per tenant: ``acquire(tenant)`` takes one request's token or raises ``RateLimited``.

    ``default`` applies to every tenant not in ``per_tenant``. Tenants come from verified keys, so the
    number of buckets is bounded by the key store. ``clock`` returns seconds (monotonic in production).
    """

    default: Rate
    clock: Callable[[], float]
    per_tenant: Mapping[str, Rate] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict, init=False, repr=False)

    def acquire(self, tenant: str) -> None:
        rate = self.per_tenant.get(tenant, self.default)
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(rate.burst, now)
        elapsed = max(0.0, now - bucket.stamp)
        bucket.tokens = min(rate.burst, bucket.tokens + elapsed * rate.per_second)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            retry_after = (1.0 - bucket.tokens) / rate.per_second
            raise RateLimited(
                f"tenant {tenant!r} is over its rate of {rate.per_second:g} requests/s "
                f"(burst {rate.burst:g}); retry in {retry_after:.3g}s",
                retry_after,
            )
        bucket.tokens -= 1.0


def tenant_rates(policy: Any, default: Rate | None) -> tuple[Rate | None, dict[str, Rate]]:
    """Per-tenant rates from a policy's tenant section (``rate``, ``burst``); its ``default`` tenant replaces
    ``default`` when it sets a rate. ``policy`` is an ``evocache.dsl.Policy``."""
    rates: dict[str, Rate] = {}
    for name, spec in policy.tenants.items():
        if spec.rate is not None:
            assert spec.burst is not None  # dsl fills it in with the rate (TenantSpec)
            rates[name] = Rate(float(spec.rate), float(spec.burst))
    return rates.pop("default", default), rates
