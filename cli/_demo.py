"""The serving side of `evocache demo`: the example model behind evocache's OpenAI API on a local Ray.

The demo itself (its workload, the loop, the report) is the agents room's (``evocache.agents.demo``), and agents
never import serving: the face composes the two by handing ``LocalDeployment`` to the `demo` command. Serving
and Ray load when the demo starts, not when `evocache` does.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evocache.agents.demo import DemoSite
    from evocache.serving import ServingConfig, Tokenizer

TOKENIZER = "minilm"  # the packaged WordPiece vocabulary (``ModelConfig.tokenizer``), for the replica and the words


class LocalDeployment:
    """``evocache.agents.demo.DemoDeployment`` on a local Ray: one replica of the model ``DemoSite`` names, L1
    only, its access events to a JSONL file, following a file policy store."""

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        from evocache.serving import load_tokenizer

        return load_tokenizer(TOKENIZER)

    def token_count(self, text: str) -> int:
        return len(self._tokenizer.encode(text))

    @contextmanager
    def serve(self, site: DemoSite) -> Iterator[dict[str, str]]:
        from ray import serve as ray_serve

        from evocache.serving import start_local

        keys = write_keys(site)
        start_local(serving_config(site), temp_dir=None)
        try:
            yield keys
        finally:
            ray_serve.shutdown()


def write_keys(site: DemoSite) -> dict[str, str]:
    """One fresh API key per tenant of ``site``; the file holds their digests only. Tenant -> key."""
    from evocache.serving import key_digest

    keys = {tenant: "sk-evc-demo-" + secrets.token_urlsafe(18) for tenant, _ in site.tenants}
    lines = ["keys:"]
    for tenant, tier in site.tenants:
        lines += [
            f"  - sha256: {key_digest(keys[tenant]).hex()}",
            f"    tenant: {tenant}",
            f"    tier: {tier}",
        ]
    fd = os.open(site.keys_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return keys


def serving_config(site: DemoSite) -> ServingConfig:
    from evocache.controller import EventsConfig, L1Config, PolicyStoreConfig, StoreConfig
    from evocache.serving import ApiKeysConfig, DeploymentConfig, ModelConfig, ServerSpec, ServingConfig

    model = ModelConfig(kind="hf", id=site.model_id, path=str(site.model), tokenizer=TOKENIZER,
                        max_tokens=site.max_tokens)
    store = StoreConfig(
        l1=L1Config(bytes=site.l1_bytes, models=str(site.models)),
        redis=None,
        events=EventsConfig(sink="jsonl", path=str(site.events)),
    )
    spec = ServerSpec(
        model=model,
        store=store,
        policy_store=PolicyStoreConfig(directory=str(site.policies), poll_interval_s=site.poll_interval_s),
    )
    return ServingConfig(
        server=spec,
        api_keys=ApiKeysConfig(file=str(site.keys_file)),
        deployment=DeploymentConfig(replicas=1, num_cpus=0.5, max_ongoing_requests=16),
        host="127.0.0.1",
        port=site.port,
    )
