"""What the KV cache needs of the model that runs a prompt: the engine side of the seam.

The model runner hands the cache its engine with each request (``KvPrefixCache.prefill``); the cache waits its
turn on the engine's ``lock``, builds the model's cache for ``model_config``, runs the rest of the prompt with
``forward`` and, for chunk reuse, moves cached keys with ``rope_shift()``. Nothing else of the runner is
reached, so another engine plugs in by providing these four members.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported where a model runs, not where the protocol is named
    from ._rope import RopeShift


class KvEngine(Protocol):
    """A causal LM as the KV cache drives it, batch 1.

    ``model_config``: the model's transformers config (a ``DynamicCache`` is built for it; chunk reuse reads
    its ``model_type`` and attention implementation). ``lock``: held around every forward of the model (the
    runner holds it for its decoding steps; the cache from ``prefill`` until ``store``), so the requests
    waiting on it are the replica's queue. ``forward``: the model on ``ids`` after what ``cache`` holds (at
    ``positions``, a 1D tensor, and under a 4D additive ``mask`` when given), appending to ``cache``; returns
    the output, whose ``logits`` are ``[1, len(ids), vocab]``. ``rope_shift``: the model's rotary embedding as
    a ``RopeShift``; raises ``RopeShiftUnsupported`` when it cannot be moved exactly."""

    model_config: Any
    lock: threading.Lock

    def forward(self, ids: Sequence[int], cache: Any, positions: Any = None, mask: Any = None) -> Any: ...

    def rope_shift(self) -> RopeShift: ...
