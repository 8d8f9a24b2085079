"""``LocalBackend``: the ingress's ``Backend`` over ``ModelServer``s in this process.

What the HTTP API is tested against without Ray (the Ray deployment goes through the same ``Api``), and a way to
embed evocache's OpenAI API in an existing ASGI server. Each server's blocking work runs in a thread, so the
event loop never waits on a model or a tier.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence

from ._metrics import merge_expositions
from ._request import Completion, Decision, Finish, GenerateRequest
from ._server import ModelServer

_END = object()


class LocalBackend:
    """Round-robin over ``servers`` (one is the usual case)."""

    def __init__(self, servers: Sequence[ModelServer]) -> None:
        if not servers:
            raise ValueError("LocalBackend needs at least one ModelServer")
        self.servers = list(servers)
        self._next = itertools.cycle(self.servers)

    async def complete(self, request: GenerateRequest) -> Completion:
        return await asyncio.to_thread(next(self._next).complete, request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Decision | str | Finish]:
        items = next(self._next).stream(request)
        try:
            while (item := await asyncio.to_thread(next, items, _END)) is not _END:
                yield item
        finally:
            await asyncio.to_thread(items.close)

    async def ready(self) -> bool:
        return True

    async def metrics(self) -> bytes:
        return merge_expositions({s.replica_id: s.metrics() for s in self.servers})
