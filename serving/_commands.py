"""`evocache serve`: the embedded application on a local Ray, answering the OpenAI API on 127.0.0.1.

Embedded set-up, all under ``--workdir`` (default ``.evocache/serve``): L1 per replica plus an L3 disk tier
shared by the replicas, and access events to ``events.jsonl``; the policy store where ``evocache policy``
looks by default (``--store``/``--redis``, else ``$EVOCACHE_POLICY_STORE``, else ``.evocache/policies``), the policy from ``--policy`` applied when it
is newer than the store's active one, and API keys from ``--keys`` (or a key generated once into
``api-keys.yaml``, printed at start), and the admin key that reads ``/metrics`` from ``--metrics-key`` (or
one generated once into ``metrics-key``, mode 0600, the file a Prometheus ``credentials_file`` can name);
``--metrics-port`` also serves ``/metrics`` without a key on 127.0.0.1 at that port. The model is the example
tiny Llama (``examples/tiny-llama``: random weights from its config, the packaged WordPiece tokenizer) unless
``--model`` names another folder, or ``--callable`` a function. ``--config FILE`` instead reads a whole
``ServingConfig`` (YAML).

The API-key file is read before Ray starts, so a file the ingress would refuse ends the command with exit 2
naming the file and the line. Ctrl-C and SIGTERM stop it alike: Serve shut down, then Ray's processes, exit 0.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_MODEL = "examples/tiny-llama"
DEFAULT_POLICY = "examples/policies/serve.yaml"
DEFAULT_WORKDIR = ".evocache/serve"


def _abs(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


def _key_file(workdir: Path) -> tuple[Path, str | None]:
    """``workdir/api-keys.yaml``, created with one fresh key for tenant ``default`` (returned, shown once)."""
    path = workdir / "api-keys.yaml"
    if path.exists():
        return path, None
    from ._auth import key_digest  # noqa: PLC0415

    key = "sk-evc-" + secrets.token_urlsafe(24)
    digest = key_digest(key).hex()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"keys:\n  - sha256: {digest}\n    tenant: default\n    tier: default\n")
    return path, key


def _metrics_key(path: Path) -> str:
    """The SHA-256 hex digest of the admin key in ``path`` (the key itself on one line), which is created with
    a fresh key (mode 0600) when missing."""
    from ._auth import key_digest, read_key_file  # noqa: PLC0415

    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("sk-evc-admin-" + secrets.token_urlsafe(24) + "\n")
    return key_digest(read_key_file(path)).hex()


def serve(
    model: Annotated[Path, typer.Option(help="A model folder (config.json; weights optional).")] = Path(DEFAULT_MODEL),
    model_id: Annotated[str | None, typer.Option(
        help="The model name clients send (default: tiny-llama; with --upstream, the upstream's first).")] = None,
    upstream: Annotated[str | None, typer.Option(
        metavar="URL", help="Put evocache in front of this OpenAI-compatible server (http://host:port/v1) "
                            "instead of serving a model itself.")] = None,
    upstream_key_env: Annotated[str | None, typer.Option(
        metavar="VAR", help="The environment variable holding the upstream's API key.")] = None,
    upstream_fields: Annotated[str | None, typer.Option(
        metavar="A,B", help="Request fields beyond OpenAI's the upstream honours (vLLM: top_k,min_p): passed "
                            "through and keyed.")] = None,
    no_salt: Annotated[bool, typer.Option(
        "--no-salt", help="Do not send cache_salt upstream (for an upstream that refuses the field).")] = False,
    tokenizer: Annotated[str | None, typer.Option(help="'minilm', 'bytes' or a tokenizer folder.")] = None,
    callable_: Annotated[str | None, typer.Option("--callable", metavar="MODULE:FUNCTION",
                                                  help="Serve a Python function instead of a model.")] = None,
    contract: Annotated[str, typer.Option(help="The @cache_if contract every request must meet.")] = "true",
    policy: Annotated[Path | None, typer.Option(help="A policy file to apply at start.")] = None,
    store: Annotated[Path | None, typer.Option("--store", metavar="DIR", help="The policy store's directory.")]
    = None,
    redis_url: Annotated[str | None, typer.Option("--redis", metavar="URL",
                                                  help="Redis for L2, events and the policy store.")] = None,
    keys: Annotated[Path | None, typer.Option(help="The API-key file (default: one generated key).")] = None,
    replicas: Annotated[int, typer.Option(help="Model replicas.")] = 1,
    num_cpus: Annotated[float, typer.Option(help="CPUs per model replica (fractions allowed).")] = 0.5,
    max_ongoing_requests: Annotated[int | None, typer.Option(
        help="Requests a replica runs at once (default: 8 for a model it runs, 64 in front of an upstream, "
             "whose replicas only wait on it).")] = None,
    host: Annotated[str, typer.Option(help="The HTTP address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The HTTP port.")] = 8000,
    metrics_key: Annotated[Path | None, typer.Option(
        metavar="FILE", help="A file holding the admin key that reads /metrics (default: WORKDIR/metrics-key, "
                             "generated).")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Also serve /metrics without a key on 127.0.0.1 at this port.")] = None,
    workdir: Annotated[Path, typer.Option(help="Where the embedded set-up keeps its state.")] = Path(DEFAULT_WORKDIR),
    config: Annotated[Path | None, typer.Option(help="A whole ServingConfig (YAML) instead of the options.")]
    = None,
) -> None:
    """Serve a model with evocache behind an OpenAI-compatible API on a local Ray: a model folder, a Python
    function (--callable), or any OpenAI-compatible server such as vLLM (--upstream URL)."""
    from evocache.controller.cli_errors import usage  # noqa: PLC0415

    try:
        serving_config, generated, policy_file = _config(
            model=model, model_id=model_id, tokenizer=tokenizer, callable_=callable_, contract=contract,
            upstream=upstream, upstream_key_env=upstream_key_env, upstream_fields=upstream_fields, salt=not no_salt,
            policy=policy, store=store, redis_url=redis_url, keys=keys, replicas=replicas,
            num_cpus=num_cpus, max_ongoing_requests=max_ongoing_requests, host=host, port=port,
            metrics_key=metrics_key, metrics_port=metrics_port, workdir=workdir, config=config)
    except (ValueError, OSError) as exc:
        raise usage("serve", str(exc)) from None
    _check_key_file(serving_config, "--config" if config is not None else "--keys")
    ref = _apply_policy(serving_config, policy_file)
    from ray import serve as ray_serve  # noqa: PLC0415 - Ray starts here

    from ._app import init_local_ray, start_local  # noqa: PLC0415

    typer.echo("starting a local Ray and the model replicas (this takes a few seconds) ...")
    try:
        init_local_ray()
        # Ray's core worker answers SIGTERM with a fatal-signal abort that leaves its agents running, and it
        # installs that handler during ray.init: from here on a supervisor's SIGTERM stops the server the way
        # Ctrl-C does (Serve shut down, then Ray's processes at exit).
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        start_local(serving_config)
        _banner(serving_config, ref, generated, None if config else metrics_key or workdir / "metrics-key")
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()


DEFAULT_MODEL_ID = "tiny-llama"
# A replica in front of an upstream holds connections, not a model: as many at once as the upstream client's
# default bound (UpstreamConfig.max_concurrency), so the engine's own batching sees the load.
UPSTREAM_ONGOING = 64


def _config(*, model: Path, model_id: str | None, tokenizer: str | None, callable_: str | None, contract: str,
            upstream: str | None = None, upstream_key_env: str | None = None, upstream_fields: str | None = None,
            salt: bool = True,
            policy: Path | None, store: Path | None, redis_url: str | None, keys: Path | None, replicas: int,
            num_cpus: float, max_ongoing_requests: int | None, host: str, port: int, metrics_key: Path | None,
            metrics_port: int | None, workdir: Path, config: Path | None) -> tuple[Any, str | None, Path | None]:
    import yaml  # noqa: PLC0415

    from evocache.controller import (  # noqa: PLC0415
        DiskConfig,
        EventsConfig,
        PolicyStoreConfig,
        RedisConfig,
        StoreConfig,
        default_policy_store,
    )

    from ._config import ApiKeysConfig, DeploymentConfig, MetricsConfig, ServingConfig  # noqa: PLC0415
    from ._model import MINILM, ModelConfig, upstream_model  # noqa: PLC0415
    from ._upstream import UpstreamConfig  # noqa: PLC0415
    from ._server import ServerSpec  # noqa: PLC0415

    if config is not None:
        document = yaml.safe_load(config.read_text(encoding="utf-8"))
        return ServingConfig.model_validate(document), None, policy
    workdir.mkdir(parents=True, exist_ok=True)
    if upstream is not None:
        if callable_ is not None:
            raise ValueError("--upstream and --callable: give one engine")
        fields = tuple(f.strip() for f in (upstream_fields or "").split(",") if f.strip())
        model_config = upstream_model(UpstreamConfig(url=upstream, api_key_env=upstream_key_env, fields=fields,
                                                     salt=salt), model_id, tokenizer)
    elif callable_ is not None:
        model_config = ModelConfig(kind="callable", id=model_id or DEFAULT_MODEL_ID, callable=callable_,
                                   tokenizer=tokenizer)
    else:
        if not (model / "config.json").is_file():
            raise ValueError(f"--model {model}: no config.json there (run from the repository root for the "
                             f"example {DEFAULT_MODEL}, or name a model folder)")
        has_tokenizer = (model / "tokenizer.json").is_file() or (model / "vocab.txt").is_file()
        model_config = ModelConfig(kind="hf", id=model_id or DEFAULT_MODEL_ID, path=_abs(model),
                                   tokenizer=tokenizer or (None if has_tokenizer else MINILM))
    if redis_url:
        store_config = StoreConfig(redis=RedisConfig(url=redis_url), disk=DiskConfig(path=_abs(workdir / "l3")),
                                   events=EventsConfig(sink="redis"))
        policy_store = PolicyStoreConfig(redis_url=redis_url)
    else:
        store_config = StoreConfig(disk=DiskConfig(path=_abs(workdir / "l3")),
                                   events=EventsConfig(sink="jsonl", path=_abs(workdir / "events.jsonl")))
        # The policy commands' own default, so `evocache policy status` finds this store with no options.
        named = store or Path(default_policy_store())
        policy_store = PolicyStoreConfig(directory=_abs(named))
    generated = None
    if keys is None:
        keys, generated = _key_file(workdir)
    if policy is None and Path(DEFAULT_POLICY).is_file():
        policy = Path(DEFAULT_POLICY)
    serving_config = ServingConfig(
        server=ServerSpec(model=model_config, contract=contract, store=store_config, policy_store=policy_store),
        api_keys=ApiKeysConfig(file=_abs(keys)),
        deployment=DeploymentConfig(replicas=replicas, num_cpus=num_cpus,
                                    max_ongoing_requests=max_ongoing_requests or (
                                        UPSTREAM_ONGOING if upstream is not None else 8)),
        host=host, port=port,
        metrics=MetricsConfig(admin_keys=(_metrics_key(metrics_key or workdir / "metrics-key"),),
                              port=metrics_port),
    )
    return serving_config, generated, policy


def _check_key_file(config: Any, option: str) -> None:
    """Read the API-key file as the ingress will, before Ray starts: a file it would refuse ends the command
    here (exit 2, naming the file and the line), not in a replica's traceback after the deployment's wait."""
    from evocache.controller.cli_errors import usage  # noqa: PLC0415

    from ._auth import FileKeyStore  # noqa: PLC0415
    from .errors import ServingConfigError  # noqa: PLC0415

    if config.api_keys.file is None:
        return
    try:
        store = FileKeyStore.load(config.api_keys.file)
    except ServingConfigError as exc:
        raise usage(option, str(exc)) from None
    if not store.table:  # a server no key can use serves nobody
        raise usage(option, f"{config.api_keys.file}: lists no key; a server no key can use serves nobody")


def _apply_policy(config: Any, policy_file: Path | None) -> str | None:
    """Apply ``policy_file`` when the store has none active or an older version; the active ref after."""
    from evocache.controller import PolicyStoreError, open_policy_store  # noqa: PLC0415
    from evocache.controller.cli_errors import EXIT_FAILED, error  # noqa: PLC0415
    from evocache.dsl import PolicyError, load_policy  # noqa: PLC0415

    spec = config.server.policy_store
    if spec is None:
        return None
    store = open_policy_store(spec)
    try:
        state = store.state()
        if policy_file is not None:
            try:
                policy = load_policy(policy_file)
            except PolicyError as exc:
                raise error(f"error: {exc}", EXIT_FAILED) from None
            active = store.load(state.active) if state.active else None
            if active is None or policy.version > active.version:
                state = store.apply(policy)
            elif active.content_hash != policy.content_hash and policy.version <= active.version:
                typer.echo(f"note: the store runs {state.active}; {policy_file} (version {policy.version}) "
                           "is not newer, so it was not applied")
        return state.active
    except PolicyStoreError as exc:
        raise error(f"error: {exc}", EXIT_FAILED) from None
    finally:
        store.close()


def _banner(config: Any, ref: str | None, generated: str | None, metrics_key: Path | None) -> None:
    base = f"http://{config.host}:{config.port}"
    key = generated or "<your API key>"
    model = config.server.model.id
    upstream = config.server.model.upstream
    engine = f" from {upstream.url}" if upstream is not None else ""
    typer.echo(f"""
evocache is serving {model}{engine} at {base}/v1  (policy {ref or 'none: the contract alone decides'})
{"API key (generated, shown once; its digest is in " + str(config.api_keys.file) + "): " + generated
 if generated else "API keys: " + str(config.api_keys.file)}

  curl {base}/v1/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
       -d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 16, "temperature": 0}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{key}")
  for chunk in client.chat.completions.create(model="{model}", temperature=0, stream=True,
                                              messages=[{{"role": "user", "content": "Hello"}}]):
      print(chunk.choices[0].delta.content or "", end="")

  evocache policy status      (which version each replica runs; apply / promote / rollback likewise)
{_metrics_banner(config, base, metrics_key)}
Ctrl-C stops.""")


def _metrics_banner(config: Any, base: str, key_file: Path | None) -> str:
    """Where the operator reads /metrics: never with an API key."""
    metrics = config.metrics
    key = f"$(cat {_abs(key_file)})" if key_file is not None else "<admin key>"
    line = f'  curl {base}/metrics -H "Authorization: Bearer {key}"    (the admin key; API keys get 403)'
    if metrics.port is not None:
        line += f"\n  curl http://{metrics.host}:{metrics.port}/metrics    (no key; this host only)"
    return line
