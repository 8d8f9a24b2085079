"""Replay: traces, the replay simulator that runs the production eviction policies on a virtual clock, and
the Belady bound. The agent loop judges every policy change with it; `evocache bench eviction` reports it.

    from evocache.controller.replay import read_trace, replay, belady_unit

    trace = list(read_trace("mooncake_synthetic_trace.jsonl"))
    lru = replay(trace, "lru", fraction=0.05, fraction_of="objects")
"""

from ..errors import TraceError
from ._access import Access
from ._belady import belady_size, belady_unit
from ._queue import QueueModel
from ._readers import FORMATS, CsvColumns, ReadStats, read_trace
from ._sim import ReplayResult, WorkingSet, replay, working_set

__all__ = [
    "FORMATS",
    "Access",
    "QueueModel",
    "CsvColumns",
    "ReadStats",
    "ReplayResult",
    "TraceError",
    "WorkingSet",
    "belady_size",
    "belady_unit",
    "read_trace",
    "replay",
    "working_set",
]
