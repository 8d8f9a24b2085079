"""Errors of the controller room.

    ControllerError
    ├── ContractError        a @cache_if contract is invalid (raised at decoration time; wraps the dsl error)
    ├── StoreConfigError     a store configuration is invalid
    ├── TraceError           a trace line cannot be read (file and line named)
    ├── LearnedModelError    a saved eviction model cannot be used (not ours, another version, other features)
    ├── TierError            a tier could not do its job; converted into a counted miss at the tier boundary
    │   ├── TierUnavailable  the backend is down, slow past its timeout, or out of space
    │   └── CorruptEntry     a stored payload failed its checksum or could not be decoded
    └── SemanticError        semantic matching could not do its job (bad scope, index failure)
        └── EmbeddingError   the embedder failed (model missing, endpoint error or bad reply)

Tier errors never reach a caller of a cached function: ``TieredStore`` turns them into misses, logs them
and counts them (``evocache_tier_errors_total``). Semantic errors on a call's path are the same: a counted
miss (``tier="semantic"``).
"""

from __future__ import annotations

from collections.abc import Sequence


class ControllerError(Exception):
    """Base of every error the controller room raises on purpose."""


class ContractError(ControllerError, ValueError):
    """A @cache_if contract cannot be enforced: bad expression, unknown field, bad option."""


class StoreConfigError(ControllerError, ValueError):
    """A store configuration is invalid (unknown tier or eviction policy, bad size, bad Redis URL).

    ``issues`` holds one ``"place: message"`` line per invalid field (``redis.url: ...``) when validation
    found them; empty for errors about the configuration as a whole.
    """

    def __init__(self, message: str, issues: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.issues = tuple(issues)


class TraceError(ControllerError, ValueError):
    """A trace line that cannot be read (or a trace whose format cannot be told). ``line`` is 1-based.

    str() is ``"file:line: message"``, the form editors and terminals jump to.
    """

    def __init__(self, file: str, line: int, message: str) -> None:
        self.file = file
        self.line = line
        self.message = message
        super().__init__(f"{file}:{line}: {message}")


class LearnedModelError(ControllerError, ValueError):
    """A saved learned-eviction model cannot be used: not ours, another format version, or other features."""


class TierError(ControllerError):
    """A tier failed. ``tier`` names it (``l1``, ``l2``, ``l3``)."""

    def __init__(self, tier: str, message: str) -> None:
        self.tier = tier
        super().__init__(f"{tier}: {message}")


class TierUnavailable(TierError):
    """The tier's backend cannot be reached in time or refuses the write (down, timed out, full)."""


class CorruptEntry(TierError):
    """A payload failed its checksum or did not decode. It is never served."""


class SemanticError(ControllerError):
    """Semantic caching failed on purpose (``evocache.controller.semantic``).

        SemanticError
        └── EmbeddingError   an embedder could not turn texts into vectors (endpoint down, bad reply, bad dim)

    Like tier errors, these never reach a caller of a cached function: a failed semantic lookup is a miss.
    """


class EmbeddingError(SemanticError):
    """An embedder failed: the endpoint refused or could not be reached, or its reply had the wrong shape."""
