"""GPU signals from NVML (nvidia-ml-py, imported as ``pynvml``), one reading per GPU per ``sample()``.

Series (labels ``gpu`` = the device index, ``name`` = the device name):

    gpu_util        %        nvmlDeviceGetUtilizationRates().gpu
    gpu_mem_used    bytes    nvmlDeviceGetMemoryInfo().used
    gpu_mem_total   bytes    nvmlDeviceGetMemoryInfo().total
    gpu_power       W        nvmlDeviceGetPowerUsage() (NVML reports mW)
    gpu_pcie_tx     bytes/s  nvmlDeviceGetPcieThroughput(TX) (NVML reports KB/s over a 20 ms window)
    gpu_pcie_rx     bytes/s  nvmlDeviceGetPcieThroughput(RX)

Without a GPU or driver ``nvmlInit()`` fails (``NVMLError_LibraryNotFound`` and friends): ``sample()`` and
``collect()`` then raise ``SignalUnavailable`` with NVML's reason, every time, without trying again. A reading
a device does not support (power on some boards) is left out of that device's series and logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .._types import Series
from ..errors import SignalUnavailable
from ._base import SampleBuffer, Sampler

log = logging.getLogger("evocache.agents.signals")

_KB = 1024  # NVML's PCIe "KB/s", read as nvidia-smi dmon reads them (it divides by 1024 for MB/s)


class NvmlCollector:
    """``sample()`` reads every GPU once; ``start()``/``stop()`` do it every ``period_s`` on a thread;
    ``collect(start, end)`` returns the readings in ``[start, end)``. ``clock`` stamps the readings;
    ``capacity`` bounds the points kept per series. ``close()`` shuts NVML down."""

    name = "nvml"

    def __init__(self, period_s: float = 1.0, *, clock: Callable[[], float] = time.time,
                 capacity: int = 3600) -> None:
        self.period_s = period_s
        self.clock = clock
        self.buffer = SampleBuffer(capacity)
        self.sampler = Sampler(self.name, self.sample, period_s)
        self._nvml: Any = None
        self._devices: list[tuple[Any, str, str]] = []  # (handle, index, name)
        self._failed: str | None = None
        self._unsupported: set[tuple[str, str]] = set()

    def _init(self) -> Any:
        if self._failed is not None:
            raise SignalUnavailable(self.name, self._failed)
        if self._nvml is not None:
            return self._nvml
        try:
            import pynvml
        except ImportError as exc:
            self._failed = f"nvidia-ml-py is not installed ({exc})"
            raise SignalUnavailable(self.name, self._failed) from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._failed = f"NVML cannot start: {type(exc).__name__}: {exc}"
            raise SignalUnavailable(self.name, self._failed) from exc
        try:
            count = pynvml.nvmlDeviceGetCount()
            devices = []
            for i in range(count):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                devices.append((handle, str(i), name.decode() if isinstance(name, bytes) else str(name)))
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            self._failed = f"NVML cannot list the GPUs: {type(exc).__name__}: {exc}"
            raise SignalUnavailable(self.name, self._failed) from exc
        if not devices:
            pynvml.nvmlShutdown()
            self._failed = "NVML reports no GPU"
            raise SignalUnavailable(self.name, self._failed)
        self._nvml, self._devices = pynvml, devices
        return pynvml

    def sample(self) -> None:
        """One reading per GPU, stamped with ``clock()``."""
        nvml = self._init()
        t = self.clock()
        for handle, index, name in self._devices:
            labels = (("gpu", index), ("name", name))
            for metric, unit, read in _READINGS:
                try:
                    value = read(nvml, handle)
                except nvml.NVMLError as exc:
                    if (index, metric) not in self._unsupported:
                        self._unsupported.add((index, metric))
                        log.info("nvml: gpu %s (%s) gives no %s: %s", index, name, metric, exc)
                    continue
                self.buffer.add(metric, labels, t, float(value), unit)

    def collect(self, start: float, end: float) -> list[Series]:
        self._init()
        return self.buffer.series(start, end)

    def start(self) -> None:
        """Sample every ``period_s`` on a daemon thread; raises ``SignalUnavailable`` here if NVML cannot."""
        self._init()
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()

    def close(self) -> None:
        self.stop()
        if self._nvml is not None:
            nvml, self._nvml, self._devices = self._nvml, None, []
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.info("nvml: shutdown failed: %s", exc)


def _util(nvml: Any, h: Any) -> float:
    return nvml.nvmlDeviceGetUtilizationRates(h).gpu


def _mem_used(nvml: Any, h: Any) -> float:
    return nvml.nvmlDeviceGetMemoryInfo(h).used


def _mem_total(nvml: Any, h: Any) -> float:
    return nvml.nvmlDeviceGetMemoryInfo(h).total


def _power(nvml: Any, h: Any) -> float:
    return nvml.nvmlDeviceGetPowerUsage(h) / 1000.0


def _pcie_tx(nvml: Any, h: Any) -> float:
    return nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES) * _KB


def _pcie_rx(nvml: Any, h: Any) -> float:
    return nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES) * _KB


_READINGS: tuple[tuple[str, str, Callable[[Any, Any], float]], ...] = (
    ("gpu_util", "%", _util),
    ("gpu_mem_used", "bytes", _mem_used),
    ("gpu_mem_total", "bytes", _mem_total),
    ("gpu_power", "W", _power),
    ("gpu_pcie_tx", "bytes/s", _pcie_tx),
    ("gpu_pcie_rx", "bytes/s", _pcie_rx),
)
