"""What every collector is, the hub that asks them all, and the sample buffer the sampling collectors share.

Collector (Protocol)   name; collect(start, end) -> list[Series]; raises SignalUnavailable when it cannot; close()
SignalHub(collectors)  collect(start, end): every available collector's series, the rest left out; close()
SampleBuffer           bounded (name, labels, unit) -> points store, read back as Series over [start, end)
Sampler                a daemon thread calling a collector's sample() every period_s
NewFiles               which files of a directory are new or changed since the last look
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from .._types import Series
from ..errors import SignalUnavailable

log = logging.getLogger("evocache.agents.signals")

Labels = tuple[tuple[str, str], ...]


@runtime_checkable
class Collector(Protocol):
    """A source of signals. ``collect(start, end)`` returns the points it has gathered with
    ``start <= t < end`` as series; it raises ``SignalUnavailable`` when it cannot run on this machine (no
    GPU,
    no driver, no directory), and the hub then leaves it out and says why once."""

    name: str

    def collect(self, start: float, end: float) -> list[Series]: ...

    def close(self) -> None:
        """Stop any sampling and release what the collector holds (a thread, a driver handle, a connection).
        Safe to call more than once."""


class SignalHub:
    """Asks each collector in turn; one that fails never stops the others or the loop.

    A ``SignalUnavailable`` leaves the collector out of the round and is logged once per reason (a collector
    that comes back is logged once more); ``unavailable`` maps its name to the reason while it lasts. Any
    other error is a collector's defect: it is logged with its traceback the first time, counted in ``errors``
    and the collector is left out of that round.
    """

    def __init__(self, collectors: Iterable[Collector]) -> None:
        self.collectors = list(collectors)
        names = [c.name for c in self.collectors]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"collector names must be unique, repeated: {dupes}")
        self.unavailable: dict[str, str] = {}
        self.errors: dict[str, int] = {}

    def close(self) -> None:
        """Close every collector; one that fails to close is logged and the others are still closed."""
        for collector in self.collectors:
            try:
                collector.close()
            except Exception:  # noqa: BLE001 - a collector's defect must not keep the others open
                log.exception("signal %s: close failed", collector.name)

    def collect(self, start: float, end: float) -> list[Series]:
        if not end >= start:
            raise ValueError(f"need end >= start, got [{start}, {end}]")
        out: list[Series] = []
        for collector in self.collectors:
            series = self._ask(collector, start, end)
            if series is not None:
                out.extend(series)
        return out

    def _ask(self, collector: Collector, start: float, end: float) -> list[Series] | None:
        name = collector.name
        try:
            series = collector.collect(start, end)
        except SignalUnavailable as exc:
            if self.unavailable.get(name) != exc.reason:
                log.info("signal %s unavailable: %s", name, exc.reason)
                self.unavailable[name] = exc.reason
            return None
        except (
            Exception
        ):  # a collector's bug must not end the loop: left out, counted, shown with its traceback
            count = self.errors[name] = self.errors.get(name, 0) + 1
            if count == 1:
                log.exception("signal %s failed; left out of this round", name)
            else:
                log.debug("signal %s failed again (%d times)", name, count, exc_info=True)
            return None
        if name in self.unavailable:
            log.info("signal %s available again", name)
            del self.unavailable[name]
        return series


class SampleBuffer:
    """Points per ``(name, labels, unit)``, each series keeping its last ``capacity`` points added (the
    oldest dropped, so memory stays bounded however long the loop runs); read back in time order."""

    def __init__(self, capacity: int = 3600) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._points: dict[tuple[str, Labels, str], deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()  # a Sampler thread adds while the loop reads

    def add(self, name: str, labels: Labels, t: float, v: float, unit: str = "") -> None:
        key = (name, tuple(sorted(labels)), unit)
        with self._lock:
            points = self._points.get(key)
            if points is None:
                points = self._points[key] = deque(maxlen=self.capacity)
            points.append((t, v))

    def series(self, start: float, end: float) -> list[Series]:
        """One ``Series`` per key that has points with ``start <= t < end``, sorted by name and labels."""
        with self._lock:
            items = [
                (key, [p for p in points if start <= p[0] < end]) for key, points in self._points.items()
            ]
        out = []
        for (name, labels, unit), points in sorted(items, key=lambda item: item[0]):
            if points:
                points.sort(key=lambda p: p[0])  # a file read late may carry an earlier time
                out.append(
                    Series(name, labels, tuple(p[0] for p in points), tuple(p[1] for p in points), unit)
                )
        return out


class Sampler:
    """Calls ``sample`` every ``period_s`` seconds on a daemon thread until ``stop()``. A
    ``SignalUnavailable`` ends the thread (nothing to sample here; ``collect`` says why); other errors are
    logged once and counted in
    ``errors``, and the thread goes on."""

    def __init__(self, name: str, sample: Callable[[], object], period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.name = name
        self._sample = sample
        self.period_s = period_s
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"evocache-signal-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except SignalUnavailable:
                return
            except Exception:  # same reason as the hub: a sampling bug must not kill the thread silently
                self.errors += 1
                if self.errors == 1:
                    log.exception("signal %s: sampling failed", self.name)
            self._stop.wait(self.period_s)


def labelled(pairs: Sequence[tuple[str, object]]) -> Labels:
    """Sorted ``(key, str(value))`` labels."""
    return tuple(sorted((k, str(v)) for k, v in pairs))


class NewFiles:
    """Which of a set of files are new or changed (by modification time and size) since they were last seen,
    so a directory of exports is read one file at a time, once per version of each file."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int]] = {}

    def changed(self, paths: Iterable[os.PathLike[str] | str]) -> list[tuple[Path, os.stat_result]]:
        out = []
        listed = sorted(Path(p) for p in paths)
        # forget files that are gone, so the map stays as large as the directory
        present = {str(p) for p in listed}
        self._seen = {k: v for k, v in self._seen.items() if k in present}
        for path in listed:
            try:
                st = path.stat()
            except FileNotFoundError:  # removed between the listing and now
                continue
            state = (st.st_mtime_ns, st.st_size)
            if self._seen.get(str(path)) != state:
                self._seen[str(path)] = state
                out.append((path, st))
        return out
