"""Errors of the serving room.

    ServingError
    ├── ServingConfigError   a serving configuration (an API-key file, a stored key record) is invalid
    └── ApiError             a request is refused; carries the HTTP status and OpenAI's error fields
        ├── BadRequest       400: the body is malformed or a field is invalid (``param`` names it)
        ├── Unauthenticated  401: no, malformed or unknown API key
        ├── Forbidden        403: a valid key that may not use this endpoint (a tenant's key on /metrics)
        ├── UnsupportedMediaType  415: the body is not declared ``application/json``
        ├── RateLimited      429: the tenant is over its request rate (``retry_after`` seconds)
        └── Unavailable      503: no replica (or key store) can serve the request now

``serving._protocol.error_response`` turns an ``ApiError`` into the OpenAI error body.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of every error the serving room raises on purpose."""


class ServingConfigError(ServingError, ValueError):
    """A serving configuration is invalid; the message names the file or record and the place in it."""


class ApiError(ServingError):
    """A refused request: ``status`` is the HTTP status; ``error_type``, ``param`` and ``code`` fill OpenAI's
    ``{"error": {...}}`` body."""

    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(ApiError):
    status = 400
    error_type = "invalid_request_error"


class Unauthenticated(ApiError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(ApiError):
    status = 403
    error_type = "invalid_request_error"
    code = "insufficient_permissions"


class UnsupportedMediaType(ApiError):
    """The official client raises its ``APIStatusError`` for a 415 (status, message and this body) and does
    not retry it; it always sends ``application/json``, so only a hand-made request meets this."""

    status = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(ApiError):
    status = 429
    error_type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(ApiError):
    status = 503
    error_type = "server_error"
    code = "service_unavailable"
