"""Errors of the KV prefix cache.

    ServingError                 (evocache.serving.errors)
    └── KvReuseError             cached keys and values cannot be reused as asked
        └── RopeShiftUnsupported a model's rotary embedding cannot be shifted exactly (also a ValueError)
"""

from __future__ import annotations

from ..errors import ServingError


class KvReuseError(ServingError):
    """Base of every error the KV prefix cache raises on purpose."""


class RopeShiftUnsupported(KvReuseError, ValueError):
    """A model's rotary position embedding cannot be moved by a position shift exactly: the message names
    the model type or rope type, why, and what is accepted."""
