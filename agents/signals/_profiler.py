"""Profiles of a serving replica, met through the Chrome trace JSON that ``torch.profiler`` exports
(``prof.export_chrome_trace(path)``): agents never import serving, only read the standard file.

    read_trace(path, max_bytes=64 MiB) -> dict          bounded, errors name the file
    kernel_summary(trace, top=20) -> list[KernelStat]   time per kernel / operator, largest first
    ProfileCollector(directory)                         new trace files as kernel_time_us / kernel_calls
    series profile_callable(fn, steps=, activities=) -> Path   run torch.profiler over fn and export its trace

A trace is ``{"traceEvents": [{"ph": "X", "cat", "name", "ts", "dur" (us), "pid", "tid", "args"}, ...]}``.
Complete events (``ph == "X"``) of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset`` are device ``cuda``;
``cpu_op`` (ATen operators) are device ``cpu``. An operator's self time is its duration less that of the
operators nested directly inside it on the same thread; a kernel's self time is its duration.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .._types import Series
from ..errors import SignalUnavailable, WorkloadError
from ._base import NewFiles, SampleBuffer

log = logging.getLogger("evocache.agents.signals")

MAX_TRACE_BYTES = 64 << 20
_DEVICE_OF = {"kernel": "cuda", "gpu_memcpy": "cuda", "gpu_memset": "cuda", "cpu_op": "cpu"}
_names = itertools.count()


@dataclass(frozen=True, slots=True)
class KernelStat:
    """One kernel (device ``cuda``) or operator (device ``cpu``) of a trace: ``calls``, ``total_us`` (the sum
    of its durations) and ``self_us`` (without nested operators)."""

    name: str
    device: Literal["cpu", "cuda"]
    calls: int
    total_us: float
    self_us: float


def read_trace(path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES) -> dict[str, Any]:
    """The decoded trace of ``path`` (``.gz``: gzip-compressed). Raises ``WorkloadError`` naming the file when
    it is larger than ``max_bytes`` (decompressed), not JSON, or has no ``traceEvents`` list."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                data = fh.read(max_bytes + 1)
        else:
            size = path.stat().st_size
            if size > max_bytes:
                raise WorkloadError(f"{path}: trace is {size} bytes, more than the {max_bytes} allowed")
            data = path.read_bytes()
    except (OSError, EOFError) as exc:  # gzip raises BadGzipFile (an OSError) or EOFError on a cut file
        raise WorkloadError(f"{path}: cannot read the trace: {exc}") from exc
    if len(data) > max_bytes:
        raise WorkloadError(f"{path}: trace is more than the {max_bytes} bytes allowed")
    try:
        trace = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise WorkloadError(f"{path}: not a Chrome trace: invalid JSON: {exc}") from exc
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise WorkloadError(f"{path}: not a Chrome trace: no 'traceEvents' list")
    return trace


def _spans(trace: Mapping[str, Any]) -> Iterable[tuple[str, str, float, float, Any]]:
    """``(name, device, ts, dur, thread)`` of each complete event of a known category; malformed ones (no
    name, a non-numeric time) are skipped."""
    for e in trace.get("traceEvents", ()):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        device = _DEVICE_OF.get(e.get("cat"))  # type: ignore[arg-type]
        name, ts, dur = e.get("name"), e.get("ts"), e.get("dur")
        if device is None or not isinstance(name, str):
            continue
        if not all(type(x) in (int, float) and math.isfinite(x) for x in (ts, dur)) or dur < 0:
            continue
        yield name, device, float(ts), float(dur), (e.get("pid"), e.get("tid"))


def _self_times(ops: list[tuple[str, float, float, Any]]) -> list[float]:
    """Each cpu operator's duration less its direct children's, nesting found per thread by time."""
    order = sorted(range(len(ops)), key=lambda i: (str(ops[i][3]), ops[i][1], -ops[i][2]))
    own = [op[2] for op in ops]
    stack: list[int] = []
    thread: Any = object()
    for i in order:
        _name, ts, dur, tid = ops[i]
        if tid != thread:
            stack, thread = [], tid
        while stack and ops[stack[-1]][1] + ops[stack[-1]][2] <= ts:
            stack.pop()
        if stack:
            own[stack[-1]] -= dur
        stack.append(i)
    return [max(0.0, x) for x in own]


def kernel_summary(trace: Mapping[str, Any], *, top: int = 20) -> list[KernelStat]:
    """The ``top`` kernels and operators by total time, largest first (ties by device, then name)."""
    ops = [(n, ts, dur, tid) for n, dev, ts, dur, tid in _spans(trace) if dev == "cpu"]
    cells: dict[tuple[str, str], list[float]] = {}  # (name, device) -> [calls, total, self]
    for (name, _ts, dur, _tid), own in zip(ops, _self_times(ops), strict=True):
        c = cells.setdefault((name, "cpu"), [0, 0.0, 0.0])
        c[0] += 1
        c[1] += dur
        c[2] += own
    for name, device, _ts, dur, _tid in _spans(trace):
        if device == "cuda":
            c = cells.setdefault((name, device), [0, 0.0, 0.0])
            c[0] += 1
            c[1] += dur
            c[2] += dur
    stats = [KernelStat(name, device, int(c[0]), c[1], c[2])  # type: ignore[arg-type]  # device: cpu | cuda
             for (name, device), c in cells.items()]
    stats.sort(key=lambda s: (-s.total_us, s.device, s.name))
    return stats[:top]


class ProfileCollector:
    """Reads each new (or rewritten) trace file in ``directory`` matching ``patterns`` once, and keeps its
    ``kernel_summary`` as ``kernel_time_us`` (us) and ``kernel_calls`` series labelled ``kernel`` and
    ``device``, stamped with the file's modification time. A file that cannot be read (too large, not JSON)
    is logged, kept in ``rejected`` (path -> reason) and tried again only once it changes. A missing
    directory raises ``SignalUnavailable``."""

    name = "profiler"

    def __init__(self, directory: str | os.PathLike[str], *, top: int = 20, max_bytes: int = MAX_TRACE_BYTES,
                 patterns: Sequence[str] = ("*.json", "*.json.gz"), capacity: int = 1000) -> None:
        self.directory = Path(directory)
        self.top = top
        self.max_bytes = max_bytes
        self.patterns = tuple(patterns)
        self.buffer = SampleBuffer(capacity)
        self.rejected: dict[str, str] = {}
        self.read: dict[str, list[KernelStat]] = {}  # path -> its summary
        self._files = NewFiles()

    def scan(self) -> list[Path]:
        """Read the files that are new or changed since the last scan; returns those read."""
        if not self.directory.is_dir():
            raise SignalUnavailable(self.name, f"no profile directory {self.directory}")
        found = {p for pattern in self.patterns for p in self.directory.glob(pattern) if p.is_file()}
        done = []
        self.read = {k: v for k, v in self.read.items() if Path(k) in found}
        for path, st in self._files.changed(found):
            try:
                stats = kernel_summary(read_trace(path, max_bytes=self.max_bytes), top=self.top)
            except WorkloadError as exc:
                self.rejected[str(path)] = str(exc)
                log.warning("profiler: %s", exc)
                continue
            self.rejected.pop(str(path), None)
            self.read[str(path)] = stats
            t = st.st_mtime
            for s in stats:
                labels = (("kernel", s.name), ("device", s.device))
                self.buffer.add("kernel_time_us", labels, t, s.total_us, "us")
                self.buffer.add("kernel_calls", labels, t, float(s.calls), "1")
            done.append(path)
        return done

    def collect(self, start: float, end: float) -> list[Series]:
        self.scan()
        return self.buffer.series(start, end)

    def close(self) -> None:
        """Nothing to release: the directory is scanned on each ``collect``."""


def profile_callable(fn: Callable[[], object], *, steps: int, activities: Sequence[str] | None = None,
                     directory: str | os.PathLike[str] | None = None) -> Path:
    """Run ``fn()`` ``steps`` times under ``torch.profiler`` and export the Chrome trace; returns its path
    (in ``directory``, else a new temporary directory). ``activities``: ``"cpu"`` and/or ``"cuda"``; by
    default
    the CPU, and CUDA when torch sees a GPU."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    known = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
    if activities is None:
        activities = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    unknown = sorted(set(activities) - set(known))
    if unknown:
        raise ValueError(f"unknown profiler activities {unknown}; known: {sorted(known)}")
    out_dir = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="evocache-prof-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with profile(activities=[known[a] for a in activities]) as prof:
        for _ in range(steps):
            fn()
        if "cuda" in activities:
            torch.cuda.synchronize()  # kernels still queued would be missing from the trace
    path = out_dir / f"trace-{os.getpid()}-{next(_names)}.json"
    prof.export_chrome_trace(str(path))
    return path
