"""A caller's directives for one call: HTTP's ``Cache-Control`` (``no-store``, ``no-cache``, ``max-age``) and a
gateway's per-request ``ttl``, within what the call's rule allows (``dsl.Decision.client_controls``).

    with cache_control(CacheControl(no_cache=True)):   # look nothing up; store the fresh answer
        answer = generate(prompt)

``no_store``: a hit is served, a miss's answer is not stored (its outcome: rejected ``no-store``).
``no_cache``: no lookup (exact or semantic), the answer is computed and stored, and misses of the same key
already under way do not overwrite it (``CachedFunction.refresh``'s way); the outcome's reason is ``refresh``.
``max_age_s``: an entry stored longer ago than this is not served (it stays for callers without the bound).
``ttl_s``: what the miss stores lives at most this long (never longer than its rule's ttl).
A directive the rule does not allow is ignored, as is the whole control for a call that bypasses the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

REFRESH = "refresh"  # the reason of a call whose lookup a caller's no-cache skipped
NO_STORE = "no-store"  # the rejection of a result a caller's no-store kept out of the cache


@dataclass(frozen=True, slots=True)
class CacheControl:
    no_store: bool = False
    no_cache: bool = False
    max_age_s: float | None = None
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_age_s", "ttl_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name}: a number of seconds, 0 or more; got {value!r}")

    def within(self, allowed: Sequence[str]) -> CacheControl | None:
        """This control less the directives ``allowed`` (a rule's ``client_controls``) does not name; None
        when nothing is left."""
        control = CacheControl(
            no_store=self.no_store and "no-store" in allowed,
            no_cache=self.no_cache and "no-cache" in allowed,
            max_age_s=self.max_age_s if "max-age" in allowed else None,
            ttl_s=self.ttl_s if "ttl" in allowed else None,
        )
        return None if control == _NOTHING else control


_NOTHING = CacheControl()

current_control: contextvars.ContextVar[CacheControl | None] = contextvars.ContextVar(
    "evocache_cache_control", default=None)


@contextlib.contextmanager
def cache_control(control: CacheControl | None) -> Iterator[None]:
    """Calls inside run under ``control`` (None: none)."""
    token = current_control.set(control)
    try:
        yield
    finally:
        current_control.reset(token)
