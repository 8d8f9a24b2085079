"""The serving application as configuration: ``ServingConfig`` -> a Ray Serve application.

    config = ServingConfig.model_validate(yaml.safe_load(text))   # or from `evocache serve` options
    app = build_app(config)                                       # ingress bound to the model deployment
    serve.run(app, name="evocache", route_prefix="/")

``serving.app:build`` is the same as an import path for ``serve run`` / ``serve deploy`` config files (its
``args`` are a ``ServingConfig``). ``start_local`` starts the embedded set-up: a local Ray with the dashboard
and usage stats off (``init_local_ray``, which can be called first on its own), Serve's HTTP proxy on the
configured host and port.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from ._config import ServingConfig

APP_NAME = "evocache"


def build_app(config: ServingConfig) -> Any:
    """The Ray Serve application: ``IngressDeployment`` bound to ``ModelDeployment``. Each build is a run of
    its own (a fresh id every replica registers in the policy store with what it runs with), so `evocache
    policy status` tells this start's replicas from those of an earlier one."""
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
    run = uuid.uuid4().hex[:12]
    model = serve.deployment(ModelDeployment, **options).bind(config.server, run)
    ingress = serve.deployment(
        IngressDeployment, name="ingress", num_replicas=d.ingress_replicas,
        ray_actor_options={"num_cpus": d.ingress_num_cpus}, max_ongoing_requests=1000,
    )
    return ingress.bind(
        model, config.server, config.api_keys.model_dump(),
        {"rate": config.rate.model_dump() if config.rate else None, "ready_timeout_s": config.ready_timeout_s,
         "limits": config.limits},
        config.metrics, run,
    )


def ray_environment() -> dict[str, str]:
    """What every process of the embedded set-up runs with: no usage stats, offline Hugging Face."""
    return {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}


def init_local_ray(*, num_cpus: int | None = None, temp_dir: str | None = None, auth: bool = True) -> None:
    """Start a local Ray (dashboard off, ``ray_environment`` in every process) unless one is running.
    ``auth=False`` turns Ray's token authentication off (loopback tests only)."""
    import ray  # noqa: PLC0415

    env = ray_environment()
    os.environ.update(env)
    if not auth:
        os.environ["RAY_AUTH_MODE"] = "disabled"
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
                 runtime_env={"env_vars": env | ({"RAY_AUTH_MODE": "disabled"} if not auth else {})})


def start_local(config: ServingConfig, *, num_cpus: int | None = None, temp_dir: str | None = None,
                auth: bool = True) -> Any:
    """Start a local Ray (``init_local_ray``, unless one is running), Serve on ``config.host:port``, and the
    application; returns the ingress handle."""
    from ray import serve  # noqa: PLC0415

    init_local_ray(num_cpus=num_cpus, temp_dir=temp_dir, auth=auth)
    serve.start(http_options={"host": config.host, "port": config.port})
    return serve.run(build_app(config), name=APP_NAME, route_prefix="/")


def config_from_args(args: Mapping[str, Any]) -> ServingConfig:
    return ServingConfig.model_validate(dict(args))
