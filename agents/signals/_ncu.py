"""Nsight Compute CSV imports: per-kernel GPU time and cache hit rates.

    read_ncu_csv(path) -> NcuReport            one file, either layout below
    NcuCollector(paths=..., directory=...)     new CSV files as kernel_gpu_time_ns / l2_hit_pct / l1_hit_pct

Layouts (what ``ncu --csv`` prints, possibly with ``==PROF==`` lines and the program's own output mixed in):

- details (``--page details``, the default): one row per metric of each launch, with the columns "ID",
  "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value" among others. Metric names are
  the display names ("Duration", "L2 Hit Rate", "L1/TEX Hit Rate") or, with ``--print-metric-name name`` or
  ``--metrics``, the raw ones.
- raw (``--page raw``): one row per launch, the raw metric names as columns, the row after the header holding
  each column's unit.

Read: ``gpu__time_duration.sum`` ("Duration"), in nsecond/usecond/msecond/second, as ns;
``lts__t_sector_hit_rate.pct`` ("L2 Hit Rate") and ``l1tex__t_sector_hit_rate.pct`` ("L1/TEX Hit Rate") in %.
Numbers may carry thousands separators ("1,234.5"). Columns are found by their header names. A value that is
not a number, a time in an unknown unit, or a hit rate outside 0-100 is left out of the kernel and said in its
``issues``. A line that is not CSV of the header's width is skipped and counted in ``skipped_lines`` (as are
``==PROF==`` lines and the program's output). A file larger than ``max_bytes``, with no header, or whose
header lacks a required column raises ``WorkloadError`` naming the file (and the column).
"""

from __future__ import annotations

import csv
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._types import Series
from ..errors import SignalUnavailable, WorkloadError
from ._base import NewFiles, SampleBuffer

log = logging.getLogger("evocache.agents.signals")

MAX_CSV_BYTES = 64 << 20
_TOOL_LINE = re.compile(r"^==[A-Z]+==")  # ==PROF==, ==WARNING==, ==ERROR==
_TIME = ("gpu__time_duration.sum", "Duration")
_L2 = ("lts__t_sector_hit_rate.pct", "L2 Hit Rate")
_L1 = ("l1tex__t_sector_hit_rate.pct", "L1/TEX Hit Rate")
_FIELD_OF = {
    **dict.fromkeys(_TIME, "gpu_time_ns"),
    **dict.fromkeys(_L2, "l2_hit_pct"),
    **dict.fromkeys(_L1, "l1_hit_pct"),
}
_NS_PER = {
    "nsecond": 1.0,
    "ns": 1.0,
    "usecond": 1e3,
    "us": 1e3,
    "msecond": 1e6,
    "ms": 1e6,
    "second": 1e9,
    "s": 1e9,
}
_LONG_COLUMNS = ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")


@dataclass(frozen=True, slots=True)
class KernelMetrics:
    """One profiled launch: its kernel name, its "ID" (None when the file has none), its GPU time in ns and
    its L2 and L1/TEX sector hit rates in % (None when absent or unusable: ``issues`` says why)."""

    kernel: str
    id: str | None
    gpu_time_ns: float | None
    l2_hit_pct: float | None
    l1_hit_pct: float | None
    issues: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NcuReport:
    """The launches of one CSV file in file order, and how many of its lines were not part of the table."""

    path: str
    kernels: tuple[KernelMetrics, ...]
    skipped_lines: int


class _Launch:
    """A launch while its rows are read."""

    __slots__ = ("id", "issues", "kernel", "values")

    def __init__(self, kernel: str, id_: str | None) -> None:
        self.kernel = kernel
        self.id = id_
        self.values: dict[str, float] = {}
        self.issues: list[str] = []

    def metric(self, name: str, unit: str, text: str, where: str) -> None:
        field = _FIELD_OF.get(name)
        if field is None:
            return
        value = _number(text)
        if value is None:
            self.issues.append(f"{where}: {name} is not a number: {text!r}")
            return
        if field == "gpu_time_ns":
            scale = _NS_PER.get(unit.strip())
            if scale is None:
                self.issues.append(f"{where}: {name} in an unknown unit {unit!r}")
                return
            value *= scale
        elif not 0.0 <= value <= 100.0:
            self.issues.append(f"{where}: {name} = {value} outside 0-100")
            return
        self.values[field] = value

    def done(self) -> KernelMetrics:
        v = self.values
        return KernelMetrics(
            self.kernel,
            self.id,
            v.get("gpu_time_ns"),
            v.get("l2_hit_pct"),
            v.get("l1_hit_pct"),
            tuple(self.issues),
        )


def _number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _rows(text: str) -> tuple[list[tuple[int, list[str]]], int]:
    """``(line number, fields)`` of the CSV lines, and the count of lines skipped before or among them."""
    rows: list[tuple[int, list[str]]] = []
    skipped = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if _TOOL_LINE.match(line) or not line.lstrip().startswith('"') and not rows:
            skipped += 1  # the profiler's own messages, or the program's output before the table
            continue
        try:
            fields = next(csv.reader([line]))
        except csv.Error:
            skipped += 1
            continue
        rows.append((lineno, [f.strip() for f in fields]))
    return rows, skipped


def read_ncu_csv(path: str | os.PathLike[str], *, max_bytes: int = MAX_CSV_BYTES) -> NcuReport:
    """Read one ``ncu --csv`` export (module docstring)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise WorkloadError(f"{path}: {size} bytes, more than the {max_bytes} allowed for an ncu CSV")
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text: {exc}") from exc
    rows, skipped = _rows(text)
    header_at = next((i for i, (_n, fields) in enumerate(rows) if "Kernel Name" in fields), None)
    if header_at is None:
        raise WorkloadError(f"{path}: no ncu CSV header (a line with a 'Kernel Name' column)")
    skipped += header_at
    header_line, header = rows[header_at]
    body = rows[header_at + 1 :]
    long = "Metric Name" in header or "Metric Value" in header
    if long:
        missing = [c for c in _LONG_COLUMNS if c not in header]
        if missing:
            raise WorkloadError(
                f"{path}:{header_line}: the header has no column {missing[0]!r} "
                f"(an ncu --page details CSV needs {list(_LONG_COLUMNS)})"
            )
        kernels, bad = _read_long(path, header, body)
    else:
        kernels, bad = _read_wide(path, header, body)
    return NcuReport(str(path), tuple(kernels), skipped + bad)


def _read_long(
    path: Path, header: list[str], body: list[tuple[int, list[str]]]
) -> tuple[list[KernelMetrics], int]:
    col = {name: header.index(name) for name in (*_LONG_COLUMNS, "ID") if name in header}
    launches: dict[str | tuple[str, int], _Launch] = {}
    bad = 0
    for lineno, fields in body:
        if len(fields) != len(header):
            bad += 1
            log.warning(
                "%s:%d: %d fields, the header has %d; skipped", path, lineno, len(fields), len(header)
            )
            continue
        kernel = fields[col["Kernel Name"]]
        id_ = fields[col["ID"]] if "ID" in col else None
        # Without an ID column, consecutive rows of one kernel name are one launch.
        key: str | tuple[str, int] = id_ if id_ is not None else (kernel, len(launches))
        if id_ is None and launches:
            last_key = next(reversed(launches))
            if isinstance(last_key, tuple) and last_key[0] == kernel:
                key = last_key
        launch = launches.get(key)
        if launch is None:
            launch = launches[key] = _Launch(kernel, id_)
        name = fields[col["Metric Name"]]
        if name:  # a rule's row has no metric
            launch.metric(name, fields[col["Metric Unit"]], fields[col["Metric Value"]], f"{path}:{lineno}")
    return [launch.done() for launch in launches.values()], bad


def _read_wide(
    path: Path, header: list[str], body: list[tuple[int, list[str]]]
) -> tuple[list[KernelMetrics], int]:
    ki = header.index("Kernel Name")
    ii = header.index("ID") if "ID" in header else None
    units = [""] * len(header)
    if body and len(body[0][1]) == len(header) and not body[0][1][ki]:
        units = body[0][1]  # the raw page's second row: each metric column's unit, the others empty
        body = body[1:]
    metric_cols = [(i, name) for i, name in enumerate(header) if name in _FIELD_OF]
    kernels = []
    bad = 0
    for lineno, fields in body:
        if len(fields) != len(header):
            bad += 1
            log.warning(
                "%s:%d: %d fields, the header has %d; skipped", path, lineno, len(fields), len(header)
            )
            continue
        launch = _Launch(fields[ki], fields[ii] if ii is not None else None)
        for i, name in metric_cols:
            if fields[i]:
                launch.metric(name, units[i], fields[i], f"{path}:{lineno}")
        kernels.append(launch.done())
    return kernels, bad


class NcuCollector:
    """Series from ncu CSV exports: ``paths`` (files) and/or every ``*.csv`` in ``directory``, each read once
    per version (new or changed). Per file and kernel name (labels ``kernel``), stamped with the file's
    modification time: ``kernel_gpu_time_ns`` (ns, summed over its launches), ``l2_hit_pct`` and
    ``l1_hit_pct`` (%, the mean over the launches that have one). Launch issues are logged; a file that cannot
    be read is logged and kept in ``rejected``. A ``directory`` that does not exist raises
    ``SignalUnavailable``."""

    name = "ncu"

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]] = (),
        *,
        directory: str | os.PathLike[str] | None = None,
        max_bytes: int = MAX_CSV_BYTES,
        capacity: int = 1000,
    ) -> None:
        if not paths and directory is None:
            raise ValueError("NcuCollector needs paths or a directory")
        self.paths = [Path(p) for p in paths]
        self.directory = Path(directory) if directory is not None else None
        self.max_bytes = max_bytes
        self.buffer = SampleBuffer(capacity)
        self.rejected: dict[str, str] = {}
        self.reports: dict[str, NcuReport] = {}
        self._files = NewFiles()

    def _listed(self) -> Iterable[Path]:
        found = [p for p in self.paths if p.is_file()]
        if self.directory is not None:
            if not self.directory.is_dir():
                raise SignalUnavailable(self.name, f"no ncu directory {self.directory}")
            found += [p for p in self.directory.glob("*.csv") if p.is_file()]
        return found

    def scan(self) -> list[NcuReport]:
        """Read the files that are new or changed since the last scan."""
        done = []
        for path, st in self._files.changed(self._listed()):
            try:
                report = read_ncu_csv(path, max_bytes=self.max_bytes)
            except WorkloadError as exc:
                self.rejected[str(path)] = str(exc)
                log.warning("ncu: %s", exc)
                continue
            self.rejected.pop(str(path), None)
            self.reports[str(path)] = report
            for k in report.kernels:
                for issue in k.issues:
                    log.warning("ncu: kernel %s: %s", k.kernel, issue)
            self._add(report, st.st_mtime)
            done.append(report)
        return done

    def _add(self, report: NcuReport, t: float) -> None:
        per: dict[str, list[list[float]]] = {}  # kernel -> [times, l2s, l1s]
        for k in report.kernels:
            cell = per.setdefault(k.kernel, [[], [], []])
            for values, v in zip(cell, (k.gpu_time_ns, k.l2_hit_pct, k.l1_hit_pct), strict=True):
                if v is not None:
                    values.append(v)
        for kernel, (times, l2, l1) in per.items():
            labels = (("kernel", kernel),)
            if times:
                self.buffer.add("kernel_gpu_time_ns", labels, t, sum(times), "ns")
            if l2:
                self.buffer.add("l2_hit_pct", labels, t, sum(l2) / len(l2), "%")
            if l1:
                self.buffer.add("l1_hit_pct", labels, t, sum(l1) / len(l1), "%")

    def collect(self, start: float, end: float) -> list[Series]:
        self.scan()
        return self.buffer.series(start, end)

    def close(self) -> None:
        """Nothing to release: the directory is scanned on each ``collect``."""
