"""The import path for Ray Serve's own tools: ``serve run evocache.serving.app:build`` and ``serve deploy``.

A Serve config file names it as ``import_path: evocache.serving.app:build`` with ``args`` holding a
``ServingConfig`` (see examples/serve-cluster.yaml); ``serve run`` takes the same as ``key=value`` pairs or a
config file. ``evocache serve`` starts the same application on a local Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._app import build_app, config_from_args


def build(args: Mapping[str, Any]) -> Any:
    """Ray Serve application builder: ``args`` is a ``ServingConfig`` as a mapping."""
    return build_app(config_from_args(args))
