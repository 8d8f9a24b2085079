"""WHERE the policy is enforced: Ray Serve deployments, the request router, the KV prefix cache.

The modules here so far need no Ray: tenants from verified API keys and a per-tenant rate limiter.
See docs/architecture.md.
"""

from ._auth import (
    FileKeyStore,
    KeyStore,
    Rate,
    RateLimiter,
    RedisKeyStore,
    authenticate,
    bearer_key,
    key_digest,
)
from .errors import (
    ApiError,
    BadRequest,
    RateLimited,
    ServingConfigError,
    ServingError,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "ApiError",
    "BadRequest",
    "FileKeyStore",
    "KeyStore",
    "Rate",
    "RateLimited",
    "RateLimiter",
    "RedisKeyStore",
    "ServingConfigError",
    "ServingError",
    "Unauthenticated",
    "Unavailable",
    "authenticate",
    "bearer_key",
    "key_digest",
]
