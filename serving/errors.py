"""Errors of the serving room.

    ServingError
    ├── ServingConfigError   a serving configuration (an API-key file, a stored key record) is invalid
    └── ApiError             a request is refused; carries the HTTP status and OpenAI's error fields
        ├── BadRequest       400: the body is malformed or a field is invalid (``param`` names it)
        │   └── BodyTooLarge 400: the body is larger than the server reads (the connection is closed)
        ├── BodyTimeout      408: the body did not arrive in time (the connection is closed)
        ├── Unauthenticated  401: no, malformed or unknown API key
        ├── Forbidden        403: a valid key that may not use this endpoint (a tenant's key on /metrics)
        ├── UnsupportedMediaType  415: the body is not declared ``application/json``
        ├── RateLimited      429: the tenant is over its request rate (``retry_after`` seconds)
        ├── Unavailable      503: no replica (or key store) can serve the request now (``retry_after``)
        ├── BadGateway       502: the upstream engine failed (a 5xx, a reset, a malformed stream)
        ├── UpstreamRefused  the upstream engine's own 4xx, passed through with its status and fields
        ├── GatewayTimeout   504: a replica took the request but its answer outlasted the request's deadline
        │                    (or the upstream engine said nothing for its read timeout)
        └── ClientGone       499: the client closed the connection before its answer (never sent: counted)

A 503 says "try again": the official client retries it. A 504 says the work itself took too long, so an
identical retry would too: it carries ``x-should-retry: false``, which the official client obeys, and the
replica's generation is cancelled when it is sent.

``serving._protocol.error_response`` turns an ``ApiError`` into the OpenAI error body.
"""

from __future__ import annotations

from typing import Any


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
    should_retry: bool | None = None  # the x-should-retry header when set: the official client obeys it
    retry_after: float | None = None  # the Retry-After header's seconds when set (429, 503)
    close: bool = False  # answer with Connection: close (the rest of the request body is not read)

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(ApiError):
    status = 400
    error_type = "invalid_request_error"


class BodyTooLarge(BadRequest):
    """Refused before the rest of the body is read: the answer closes the connection, so a client sending
    megabytes more is not read on."""

    close = True


class BodyTimeout(ApiError):
    """A body that trickles in slower than ``Limits.body_timeout_s``: refused, and the connection closed."""

    status = 408
    error_type = "invalid_request_error"
    close = True


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

    def __init__(self, message: str, param: str | None = None, *, retry_after: float | None = None) -> None:
        super().__init__(message, param)
        self.retry_after = retry_after


class BadGateway(ApiError):
    """The upstream engine failed: nothing partial was stored, and a retry may find it well again."""

    status = 502
    error_type = "server_error"
    code = "bad_gateway"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param))


class UpstreamRefused(ApiError):
    """The upstream engine's own refusal of the request (a 4xx), passed to the client as it came."""

    def __init__(self, status: int, message: str, param: str | None = None, *, error_type: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, param)
        self.status = status
        self.error_type = error_type or "invalid_request_error"
        self.code = code
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:  # across Ray: every field, not only the message
        return (_refused, (self.status, self.message, self.param, self.error_type, self.code, self.retry_after))


def _refused(status: int, message: str, param: str | None, error_type: str | None, code: str | None,
             retry_after: float | None) -> UpstreamRefused:
    return UpstreamRefused(status, message, param, error_type=error_type, code=code, retry_after=retry_after)


class GatewayTimeout(ApiError):
    status = 504
    error_type = "server_error"
    code = "timeout"
    should_retry = False


class ClientGone(ApiError):
    """Nobody reads this answer: the status (nginx's "client closed request") is what ``/metrics`` counts."""

    status = 499
    error_type = "server_error"
    code = "client_closed_request"
