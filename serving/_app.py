"""The serving application as configuration: ``ServingConfig`` -> a Ray Serve application.

    config = ServingConfig.model_validate(yaml.safe_load(text))   # or from `evocache serve` options
    app = build_app(config)                                       # ingress bound to the model deployment
    serve.run(app, name="evocache", route_prefix="/")

``serving.app:build`` is the same as an import path for ``serve run`` / ``serve deploy`` config files (its
``args`` are a ``ServingConfig``). ``start_local`` starts the embedded set-up: a local Ray with the dashboard
and usage stats off, Serve's HTTP proxy on the configured host and port.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ._server import ServerSpec

APP_NAME = "evocache"


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

    @model_validator(mode="after")
    def _metrics_port_apart(self) -> ServingConfig:
        if self.metrics.port is not None and self.metrics.port == self.port:
            raise ValueError(f"metrics.port: {self.metrics.port} is the API's port; the keyless metrics "
                             "listener needs a port of its own")
        return self


def build_app(config: ServingConfig) -> Any:
    """The Ray Serve application: ``IngressDeployment`` bound to ``ModelDeployment``."""
    from ray import serve  # noqa: PLC0415

    from ._deployment import IngressDeployment, ModelDeployment  # noqa: PLC0415

    d = config.deployment
    options: dict[str, Any] = {
        "name": "model",
        "num_replicas": d.replicas,
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        "ray_actor_options": {"num_cpus": d.num_cpus, "num_gpus": d.num_gpus},
        "health_check_period_s": 2.0,
    }
    if d.router:
        from ._router import prefix_router_config  # noqa: PLC0415

        options["request_router_config"] = prefix_router_config(
            imbalance_threshold=d.imbalance_threshold, stats_period_s=d.routing_stats_period_s
        )
    model = serve.deployment(ModelDeployment, **options).bind(config.server)
    ingress = serve.deployment(
        IngressDeployment, name="ingress", num_replicas=d.ingress_replicas,
        ray_actor_options={"num_cpus": d.ingress_num_cpus}, max_ongoing_requests=1000,
    )
    return ingress.bind(
        model, config.server, config.api_keys.model_dump(),
        {"rate": config.rate.model_dump() if config.rate else None, "ready_timeout_s": config.ready_timeout_s},
        config.metrics,
    )


def ray_environment() -> dict[str, str]:
    """What every process of the embedded set-up runs with: no usage stats, offline Hugging Face."""
    return {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}


def start_local(config: ServingConfig, *, num_cpus: int | None = None, temp_dir: str | None = None,
                auth: bool = True) -> Any:
    """Start a local Ray (dashboard off), Serve on ``config.host:port``, and the application; returns the
    ingress handle. ``auth=False`` turns Ray's token authentication off (loopback tests only)."""
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    env = ray_environment()
    os.environ.update(env)
    if not auth:
        os.environ["RAY_AUTH_MODE"] = "disabled"
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
                 runtime_env={"env_vars": env | ({"RAY_AUTH_MODE": "disabled"} if not auth else {})})
    serve.start(http_options={"host": config.host, "port": config.port})
    return serve.run(build_app(config), name=APP_NAME, route_prefix="/")


def config_from_args(args: Mapping[str, Any]) -> ServingConfig:
    return ServingConfig.model_validate(dict(args))
