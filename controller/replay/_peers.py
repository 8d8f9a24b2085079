"""libCacheSim's online algorithms on exactly the accesses our replay sees: the comparison rows of
`evocache bench eviction --peers`.

libcachesim is GPL-3.0: an optional benchmark extra (``pip install 'evocache[peers]'``), imported only by
``load_libcachesim``, never when this module is imported and never by anything evocache runs in production.

What libCacheSim is fed (``encode``), access by access, in trace order:

- ``obj_id``: one integer per object, numbered from 1 in order of first access, over the identity ``replay``
  uses (``(ns, key)``, or ``key`` when ``ns`` is ""), so two tenants' equal keys stay two objects;
- ``obj_size``: 1 when the capacity is in objects (every object weighs 1, as ``replay`` charges it), else
  the access's bytes (libCacheSim, like ``replay``, keeps the size an object was admitted with);
- ``clock_time``: the access's time in whole seconds (libCacheSim's clock unit: its TTLs and GLCache's
  retraining interval are in seconds); our replay reads the same time unrounded;
- the capacity in the same unit and amount as our policies get.

Every access is a ``get`` (cache-on-miss, as ``replay`` does), and the hits are counted by ``_sim._tally``,
the counter of our own replay and of Belady, so every ratio means the same thing in every row. With that,
``lcs:LRU`` hits exactly what our ``lru`` hits (tests/test_peers.py checks it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, NamedTuple

from ._access import Access
from ._sim import ReplayResult, Unit, _tally

class Peer(NamedTuple):
    """A libcachesim class, run with its default parameters, and the least capacity it can be built with.

    libCacheSim aborts the whole process (a C ``abort()``, no Python exception) when a cache is too small to
    split into its parts: S3-FIFO's small queue is a tenth of the capacity, W-TinyLFU's main SLRU has four
    segments. The minimums were found by building each at capacities 1, 2, 3, ... (libcachesim 0.3.5).
    """

    cls: str
    min_capacity: int = 1


PEERS: dict[str, Peer] = {
    "LRU": Peer("LRU"),
    "ARC": Peer("ARC"),
    "S3-FIFO": Peer("S3FIFO", min_capacity=10),
    "SIEVE": Peer("Sieve"),
    "LeCaR": Peer("LeCaR"),
    "Cacheus": Peer("Cacheus"),
    "WTinyLFU": Peer("WTinyLFU", min_capacity=5),
    "GLCache": Peer("GLCache"),
    "LRB": Peer("LRB"),
}
"""Row name (after ``lcs:``) -> its libcachesim class."""

PREFIX = "lcs:"

RANDOMISED = ("LeCaR", "Cacheus")
"""Peers that draw from libCacheSim's own random generator, which its Python binding cannot seed: their
rows vary from run to run (about +-0.005 hit ratio seen on the Mooncake trace at 10 %)."""

LRB_MIN_SAMPLES = 131_072
"""libCacheSim's LRB trains only after this many labelled samples; until then it evicts like LRU."""

INSTALL_HINT = "pip install 'evocache[peers]' (in a source checkout: .venv/bin/pip install -e '.[peers]')"


class PeerTrace(NamedTuple):
    """A trace as libCacheSim is fed it (see the module docstring), encoded once for every peer and size."""

    accesses: Sequence[Access]
    obj_ids: list[int]
    sizes: list[int]
    times: list[int]
    unit: Unit


def load_libcachesim() -> ModuleType:
    """The ``libcachesim`` module. Raises ``ImportError`` whose message says how to install it."""
    try:
        import libcachesim
    except ImportError as exc:
        raise ImportError(
            f"--peers needs libCacheSim's Python package (GPL-3.0, a benchmark extra): {INSTALL_HINT}"
        ) from exc
    return libcachesim


def encode(trace: Sequence[Access], unit: Unit) -> PeerTrace:
    """``trace`` as libCacheSim's requests see it, for capacities in ``unit``. One pass; one dict entry per
    distinct object."""
    ids: dict[Hashable, int] = {}
    obj_ids: list[int] = []
    sizes: list[int] = []
    times: list[int] = []
    by_objects = unit == "objects"
    for t, key, size, ns, *_ in trace:
        k = (ns, key) if ns else key
        obj_id = ids.get(k)
        if obj_id is None:
            obj_id = ids[k] = len(ids) + 1
        obj_ids.append(obj_id)
        sizes.append(1 if by_objects else size)
        times.append(int(t))
    return PeerTrace(trace, obj_ids, sizes, times, unit)


def unavailable(lcs: ModuleType, smallest_capacity: int) -> dict[str, str]:
    """Peers that cannot run here, name -> why: those this libcachesim build lacks (GLCache and LRB are
    optional when it is built), and those that cannot be built at ``smallest_capacity`` (see ``Peer``)."""
    missing = {}
    for name, peer in PEERS.items():
        if smallest_capacity < peer.min_capacity:
            missing[name] = (f"libCacheSim aborts below a capacity of {peer.min_capacity}, and the smallest "
                             f"here is {smallest_capacity}")
            continue
        try:
            _make(lcs, peer, peer.min_capacity)
        except (ImportError, AttributeError) as exc:
            missing[name] = str(exc)
    return missing


def replay_peer(lcs: ModuleType, name: str, trace: PeerTrace, capacity: int) -> ReplayResult:
    """Run libCacheSim's ``name`` (a key of ``PEERS``) over ``trace`` with ``capacity`` in ``trace.unit``.

    The result is named ``lcs:<name>`` and holds the same measures as ``replay``'s. Raises ``KeyError`` for a
    name not in ``PEERS``, ``ValueError`` for a capacity below its ``min_capacity`` (where libCacheSim would
    abort the process), ``ImportError`` when this libcachesim build lacks it.
    """
    peer = PEERS[name]
    if capacity < peer.min_capacity:
        raise ValueError(f"{PREFIX}{name} needs a capacity of at least {peer.min_capacity}, got {capacity}")
    cache = _make(lcs, peer, capacity)

    def outcomes() -> Iterator[tuple[Access, bool]]:
        # One Request reused: libCacheSim copies what it keeps, and building one per access doubles the time.
        req = lcs.Request()
        get = cache.get
        for a, obj_id, size, t in zip(trace.accesses, trace.obj_ids, trace.sizes, trace.times, strict=True):
            req.obj_id = obj_id
            req.obj_size = size
            req.clock_time = t
            yield a, get(req)

    return _tally(outcomes(), policy=PREFIX + name, capacity=capacity, unit=trace.unit, window_s=None)


def _make(lcs: ModuleType, peer: Peer, capacity: int) -> Any:
    # GLCache logs an INFO line to the C stderr when built; with progress bars on screen that line lands in the
    # middle of them, and says nothing the table does not.
    with _quiet_c_stderr():
        return getattr(lcs, peer.cls)(capacity)


@contextmanager
def _quiet_c_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the block (C code writes there, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
