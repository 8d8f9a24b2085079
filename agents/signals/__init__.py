"""The loop's signals: what the cache, the GPUs, the host and the profilers report, as ``Series``.

    SignalHub(collectors).collect(start, end)   every available collector's series; unavailable ones are
                                                left out and reported once (hub.unavailable, hub.errors)
    EventsCollector   access events (JSONL files, a Redis stream) -> (Request, Outcome) pairs and series
    NvmlCollector     GPU utilisation, memory, power, PCIe (nvidia-ml-py)
    HostCollector     CPU, memory, this process's RSS (psutil)
    ProfileCollector  torch.profiler Chrome traces -> kernel times
    NcuCollector      Nsight Compute CSV exports -> kernel GPU time and cache hit rates

Importing this package loads neither torch nor pynvml: each collector imports its library when it first runs.
"""

from ._base import Collector, NewFiles, SampleBuffer, Sampler, SignalHub
from ._events import EventsCollector, EventSource, JsonlTail, RedisStreamTail
from ._host import HostCollector
from ._ncu import KernelMetrics, NcuCollector, NcuReport, read_ncu_csv
from ._nvml import NvmlCollector
from ._profiler import KernelStat, ProfileCollector, kernel_summary, profile_callable, read_trace

__all__ = [
    "Collector",
    "EventSource",
    "EventsCollector",
    "HostCollector",
    "JsonlTail",
    "KernelMetrics",
    "KernelStat",
    "NcuCollector",
    "NcuReport",
    "NewFiles",
    "NvmlCollector",
    "ProfileCollector",
    "RedisStreamTail",
    "SampleBuffer",
    "Sampler",
    "SignalHub",
    "kernel_summary",
    "profile_callable",
    "read_ncu_csv",
    "read_trace",
]
