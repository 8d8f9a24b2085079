"""Host signals from psutil, one reading per ``sample()``:

    host_cpu_percent     %      psutil.cpu_percent() since the previous reading (all cores)
    host_mem_used        bytes  psutil.virtual_memory().used
    host_mem_available   bytes  psutil.virtual_memory().available
    process_rss          bytes  this process's resident set (labelled ``pid``)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .._types import Series
from ..errors import SignalUnavailable
from ._base import SampleBuffer, Sampler


class HostCollector:
    """``sample()`` reads the host once; ``start()``/``stop()`` every ``period_s`` on a thread; ``collect``
    returns the readings in ``[start, end)``. Raises ``SignalUnavailable`` where psutil is missing or cannot
    read this system."""

    name = "host"

    def __init__(self, period_s: float = 1.0, *, clock: Callable[[], float] = time.time,
                 capacity: int = 3600) -> None:
        self.clock = clock
        self.buffer = SampleBuffer(capacity)
        self.sampler = Sampler(self.name, self.sample, period_s)
        self._psutil: Any = None
        self._process: Any = None

    def _init(self) -> Any:
        if self._psutil is None:
            try:
                import psutil
            except ImportError as exc:
                raise SignalUnavailable(self.name, f"psutil is not installed ({exc})") from exc
            self._process = psutil.Process(os.getpid())
            psutil.cpu_percent(None)  # the first call only starts the interval it measures
            self._psutil = psutil
        return self._psutil

    def sample(self) -> None:
        psutil = self._init()
        try:
            cpu = psutil.cpu_percent(None)
            mem = psutil.virtual_memory()
            rss = self._process.memory_info().rss
        except (psutil.Error, OSError) as exc:
            raise SignalUnavailable(self.name, f"psutil cannot read this host: {exc}") from exc
        t = self.clock()
        self.buffer.add("host_cpu_percent", (), t, float(cpu), "%")
        self.buffer.add("host_mem_used", (), t, float(mem.used), "bytes")
        self.buffer.add("host_mem_available", (), t, float(mem.available), "bytes")
        self.buffer.add("process_rss", (("pid", str(self._process.pid)),), t, float(rss), "bytes")

    def collect(self, start: float, end: float) -> list[Series]:
        self._init()
        return self.buffer.series(start, end)

    def start(self) -> None:
        self._init()
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()

    def close(self) -> None:
        self.stop()
