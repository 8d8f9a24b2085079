"""The serving application's configuration: ``ServingConfig`` and its parts (what ``evocache serve``, ``serve
deploy`` config files and ``serving.app:build``'s ``args`` give)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ._protocol import Limits
from ._server import ServerSpec


class RateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    per_second: float = Field(gt=0)
    burst: float = Field(ge=1)


class ApiKeysConfig(BaseModel):
    """Where API keys map to tenants: a key ``file`` (YAML/JSON, see ``serving._auth``) or a Redis hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str | None = None
    redis_url: str | None = None
    hash_key: str | None = None

    @model_validator(mode="after")
    def _one(self) -> ApiKeysConfig:
        if (self.file is None) == (self.redis_url is None):
            raise ValueError("give file or redis_url, exactly one")
        return self


class MetricsConfig(BaseModel):
    """Who reads ``/metrics``, whose counters span every tenant. On the API's port only a request with one of
    ``admin_keys`` (``Authorization: Bearer <admin key>``, each given as the key's SHA-256 hex digest, as key
    files keep them): a tenant's key gets 403, no key 401, and with no admin key nobody reads it there. With
    ``port`` set, each ingress replica also serves ``GET /metrics`` without a key on ``host:port``, loopback
    unless ``host`` says otherwise, for a scraper on the same host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admin_keys: tuple[Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")], ...] = ()
    port: int | None = Field(None, ge=1, le=65535)
    host: str = "127.0.0.1"


class DeploymentConfig(BaseModel):
    """How the model deployment runs: replicas and their resources, the request bound per replica, the router
    and the ingress."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(1, ge=1, le=1024)
    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(8, ge=1)
    max_queued_requests: int = Field(256, ge=-1)
    router: bool = True  # the prefix-affinity router; false: Ray's default power-of-two router
    imbalance_threshold: int = Field(4, ge=0)
    routing_stats_period_s: float = Field(1.0, gt=0)
    ingress_replicas: int = Field(1, ge=1, le=1024)
    ingress_num_cpus: float = Field(0.25, ge=0)


class ServingConfig(BaseModel):
    """Everything ``evocache serve`` and ``serving.app:build`` deploy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerSpec
    api_keys: ApiKeysConfig
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    rate: RateConfig | None = None  # the default per-tenant rate; the policy's tenant section refines it
    ready_timeout_s: float = Field(30.0, gt=0)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    limits: Limits = Field(default_factory=Limits)  # request bounds at the ingress (serving._protocol.Limits)

    @model_validator(mode="after")
    def _metrics_port_apart(self) -> ServingConfig:
        if self.metrics.port is not None and self.metrics.port == self.port:
            raise ValueError(f"metrics.port: {self.metrics.port} is the API's port; the keyless metrics "
                             "listener needs a port of its own")
        return self
