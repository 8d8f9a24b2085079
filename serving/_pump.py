"""A replica's blocking answer stream, driven from asyncio so that whoever stops listening stops the work.

``ModelServer.stream`` is a plain generator: lazy, it computes the next piece (a token, for a model) only when
asked. ``pump`` keeps that property across the thread boundary: the generator is advanced one item per request
of the consumer, always in the same worker thread of its own, and when the consumer stops (a client that
disconnected, a deadline that passed, a cancelled Ray Serve request) the generator is closed in that thread
right after the item it is computing, if any. Closing it runs its ``finally`` blocks down the chain (the cache
records the call as incomplete and stores nothing; the model's loop ends between two tokens).

Nothing here waits for the close: a cancelled caller is answered at once, and a stream blocked on a piece
(a model step, or a coalesced call waiting for the call computing its key) closes when that piece is done.
Why not ``asyncio.to_thread`` per item: its pool may run the close in another thread while an item is still
being computed, which a generator refuses ("generator already executing").
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_END: Any = object()


async def pump(items: Generator[T, None, None]) -> AsyncIterator[T]:
    """``items`` as an async iterator, each item computed in one worker thread when asked for; closed there
    when this iterator is closed or cancelled before ``items`` ended. The thread runs in a copy of the caller's
    context (its tenant scope and runtime, when set)."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evocache-answer")
    context = contextvars.copy_context()
    ended = False
    try:
        while True:
            item = await asyncio.wrap_future(worker.submit(context.run, next, items, _END))
            if item is _END:
                ended = True
                return
            yield item
    finally:
        if not ended:  # queued behind the item being computed: the stream stops between two items
            worker.submit(context.run, items.close)
        worker.shutdown(wait=False)
