"""Replay: traces, the replay simulator that runs the production eviction policies on a virtual clock, the
Belady bound, and the policy simulator (``PolicySimulator``: a replica's L1 under a whole policy document,
its rules, tenant quotas and semantic settings). The agent loop judges every policy change with the latter;
`evocache bench eviction` reports the former.

    from evocache.controller.replay import read_trace, replay, belady_unit

    trace = list(read_trace("mooncake_synthetic_trace.jsonl"))
    lru = replay(trace, "lru", fraction=0.05, fraction_of="objects")
"""

from ..errors import TraceError
from ._access import Access
from ._belady import belady_size, belady_unit
from .._calls import CallEvents, read_events
from ._queue import QueueModel
from ._readers import FORMATS, CsvColumns, ReadStats, read_trace
from ._sim import ReplayResult, WorkingSet, replay, working_set
from ._whatif import PolicySimulator, ReplayOutcome, ReplayRequest, eviction_name

__all__ = [
    "FORMATS",
    "Access",
    "CallEvents",
    "PolicySimulator",
    "QueueModel",
    "CsvColumns",
    "ReadStats",
    "ReplayOutcome",
    "ReplayRequest",
    "ReplayResult",
    "TraceError",
    "WorkingSet",
    "belady_size",
    "belady_unit",
    "eviction_name",
    "read_events",
    "read_trace",
    "replay",
    "working_set",
]
