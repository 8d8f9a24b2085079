"""``LocalBackend``: the ingress's ``Backend`` over ``ModelServer``s in this process.

What the HTTP API is tested against without Ray (the Ray deployment goes through the same ``Api``), and a way to
embed evocache's OpenAI API in an existing ASGI server. Each request's blocking work runs in a thread of its
own (``serving._pump``), so the event loop never waits on a model or a tier, and a caller that stops waiting (a
client gone, a deadline passed) stops the generation between two tokens.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence

from ._metrics import merge_expositions
from ._pump import pump
from ._request import Completion, Decision, Finish, GenerateRequest
from ._server import ModelServer, completion_of


class LocalBackend:
    """Round-robin over ``servers`` (one is the usual case). A request is placed on a server at once: there is
    no queue in front of them."""

    def __init__(self, servers: Sequence[ModelServer]) -> None:
        if not servers:
            raise ValueError("LocalBackend needs at least one ModelServer")
        self.servers = list(servers)
        self._next = itertools.cycle(self.servers)

    async def complete(self, request: GenerateRequest, placed: asyncio.Event | None = None) -> Completion:
        if placed is not None:
            placed.set()
        return completion_of([item async for item in pump(next(self._next).stream(request))])

    async def stream(self, request: GenerateRequest,
                     placed: asyncio.Event | None = None) -> AsyncIterator[Decision | str | Finish]:
        if placed is not None:
            placed.set()
        items = pump(next(self._next).stream(request))
        try:
            async for item in items:
                yield item
        finally:
            await items.aclose()

    async def ready(self) -> bool:
        return True

    async def metrics(self) -> bytes:
        return merge_expositions({s.replica_id: s.metrics() for s in self.servers})
