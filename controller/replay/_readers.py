"""Streaming trace readers: every trace format the replay simulator accepts, turned into ``Access`` tuples.

    read_trace(source, format="auto", ...) -> Iterator[Access]

Formats (``FORMATS``; each reads one line at a time, so memory does not grow with the trace):

- ``events``: evocache access events (``controller._events``), read as one event per call
  (``read_events``, either version). Only calls that looked up the cache are accesses: ``hit`` and ``miss``,
  a miss with its result's size.
- ``canonical``: ``{"t", "key", "size", "ns"?}`` JSONL.
- ``mooncake``: Mooncake KV traces, one access per block hash, in prefix order.
- ``csv``: libCacheSim-style CSV with a header and a ``CsvColumns`` mapping.
- ``auto``: ``.csv`` by the file name, else by the keys of the first non-empty line.

A malformed line raises ``TraceError`` naming file and line, or with ``skip_bad=True`` is skipped and counted in
``ReadStats.skipped``. Blank lines are ignored everywhere.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, TextIO

from .._events import AccessEvent
from ..errors import TraceError
from ._access import Access
from .._calls import CallEvents

# A NamedTuple's generated __new__ costs a Python call per access; tuple.__new__ builds the same object in C.
_new = tuple.__new__
_loads = json.loads
_isfinite = math.isfinite


@dataclass
class ReadStats:
    """Filled while a trace is read: ``lines`` read so far (blank lines and a CSV header included),
    ``accesses`` yielded, malformed lines ``skipped`` (only with ``skip_bad=True``)."""

    lines: int = 0
    accesses: int = 0
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class CsvColumns:
    """Which CSV header columns hold the access time, the object id, its size and (optionally) its namespace.

    ``size=None``: the trace has no sizes, every object counts 1. A named column missing from the header is
    an error (a misspelt mapping must not silently turn sizes into 1).
    """

    time: str = "time"
    id: str = "id"
    size: str | None = "size"
    ns: str | None = None


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """Options of every reader, validated once here. Each applies to one format and is ignored by the others.

    ``block_tokens`` and ``bytes_per_token`` (mooncake): a block's size is their product. The defaults make a
    block's size its token count (512, Mooncake's block), so cache capacities are in tokens; give the model's
    KV bytes per token to get bytes. ``csv_columns`` and ``time_scale`` (csv): the column mapping, and the
    factor that turns the time column into seconds (1e-6 for microseconds). ``output_lengths`` (mooncake): pass
    each request's ``output_length`` on as ``Access.req_out``. It is the length the request generated, which a
    server knows when the request completes, not at arrival: a policy may use it only from then on (the
    learned policy classifies a request's blocks at its completion). Off by default.
    """

    skip_bad: bool = False
    block_tokens: int = 512
    bytes_per_token: int = 1
    csv_columns: CsvColumns = CsvColumns()
    time_scale: float = 1.0
    output_lengths: bool = False

    def __post_init__(self) -> None:
        for name in ("block_tokens", "bytes_per_token"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not isinstance(self.csv_columns, CsvColumns):
            raise TypeError(f"csv_columns must be a CsvColumns, got {type(self.csv_columns).__name__}")
        if isinstance(self.time_scale, bool) or not isinstance(self.time_scale, (int, float)):
            raise TypeError(f"time_scale must be a number, got {type(self.time_scale).__name__}")
        if not (_isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be finite and > 0, got {self.time_scale}")


Reader = Callable[[Iterable[str], str, ReadOptions, ReadStats], Iterator[Access]]
"""``reader(lines, name, options, stats)``: the accesses of ``lines`` (text lines, numbered from 1 in errors
as lines of the file ``name``)."""


class _Bad(Exception):
    """A line is malformed; the reader loop adds file and line and raises or skips."""


def _fail(name: str, lineno: int, message: str, options: ReadOptions, stats: ReadStats) -> TraceError | None:
    """The error to raise for a bad line, or None once the line is counted as skipped."""
    if options.skip_bad:
        stats.skipped += 1
        return None
    return TraceError(name, lineno, message)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- field checks (json gives any type; bool is an int subclass and never a valid number here) -------------

def _field(rec: dict[str, Any], field: str) -> Any:
    try:
        return rec[field]
    except KeyError:
        raise _Bad(f"missing field {field!r}") from None


def _number(rec: dict[str, Any], field: str) -> float:
    value = _field(rec, field)
    kind = type(value)
    if (kind is float or kind is int) and _isfinite(value):
        return float(value)
    raise _Bad(f"field {field!r} must be a finite number, got {_show(value)}")


def _size(rec: dict[str, Any], field: str, minimum: int) -> int:
    value = _field(rec, field)
    if type(value) is int and value >= minimum:
        return value
    raise _Bad(f"field {field!r} must be an int >= {minimum}, got {_show(value)}")


def _key(value: Any, field: str) -> str:
    kind = type(value)
    if kind is str:
        return value
    if kind is int:
        return str(value)
    raise _Bad(f"field {field!r} must be a string or an int, got {_show(value)}")


def _count(rec: dict[str, Any], field: str) -> int:
    """An optional int >= 0; -1 when the field is absent."""
    if field not in rec:
        return -1
    return _size(rec, field, 0)


def _text(rec: dict[str, Any], field: str) -> str:
    value = rec.get(field, "")
    if type(value) is str:
        return value
    raise _Bad(f"field {field!r} must be a string, got {_show(value)}")


def _json_records(lines: Iterable[str], name: str, options: ReadOptions,
                  stats: ReadStats) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line; a line that is not a JSON object fails here."""
    for lineno, line in enumerate(lines, 1):
        stats.lines = lineno
        if not line or line.isspace():
            continue
        try:
            rec = _loads(line)
        except ValueError as exc:  # a JSONDecodeError, or an int literal past Python's digit limit
            if not isinstance(exc, json.JSONDecodeError):
                where = str(exc)
            elif exc.pos < len(line.rstrip()):
                where = f"{exc.msg} at column {exc.pos + 1}"
            else:
                where = f"{exc.msg} at the end of the line"
            error = _fail(name, lineno, f"invalid JSON: {where}", options, stats)
            if error is not None:
                raise error from exc
            continue
        except RecursionError as exc:
            error = _fail(name, lineno, "invalid JSON: nested too deeply", options, stats)
            if error is not None:
                raise error from exc
            continue
        if type(rec) is not dict:
            error = _fail(name, lineno, f"expected a JSON object, got {_show(rec)}", options, stats)
            if error is not None:
                raise error
            continue
        yield lineno, rec


# -- the readers --------------------------------------------------------------------------------------------

def read_canonical(lines: Iterable[str], name: str, options: ReadOptions, stats: ReadStats) -> Iterator[Access]:
    """``{"t": seconds, "key": str | int, "size": int > 0, "ns": str?}`` per line; other fields are ignored."""
    for lineno, rec in _json_records(lines, name, options, stats):
        try:
            access = _new(Access, (_number(rec, "t"), _key(_field(rec, "key"), "key"), _size(rec, "size", 1),
                                   _text(rec, "ns"), "", -1, -1, -1))
        except _Bad as exc:
            error = _fail(name, lineno, str(exc), options, stats)
            if error is not None:
                raise error from None
            continue
        stats.accesses += 1
        yield access


def read_event_trace(lines: Iterable[str], name: str, options: ReadOptions,
                     stats: ReadStats) -> Iterator[Access]:
    """Access events (``read_events``: one per call, either version): each ``hit`` and ``miss`` is one
    ``Access(t, key, size, ns, rule)``, a miss sized by its result. Bypasses and the SLO breaker's transitions
    are not accesses. Memory stays bounded (``controller.replay._calls``)."""
    calls = CallEvents()

    def accesses(events: list[AccessEvent]) -> Iterator[Access]:
        for e in events:
            if e.outcome == "hit" or e.outcome == "miss":
                stats.accesses += 1
                yield _new(Access, (e.t, e.key, e.size, e.ns, e.rule, -1, -1, -1))

    for lineno, rec in _json_records(lines, name, options, stats):
        try:
            event = AccessEvent.from_dict(rec)
        except ValueError as exc:
            error = _fail(name, lineno, str(exc), options, stats)
            if error is not None:
                raise error from None
            continue
        yield from accesses(calls.feed(event))
    yield from accesses(calls.flush())


def read_mooncake(lines: Iterable[str], name: str, options: ReadOptions, stats: ReadStats) -> Iterator[Access]:
    """``{"timestamp": ms, "hash_ids": [...], ...}`` per request: one access per hash id, in order.

    ``t`` is the timestamp in seconds, ``key`` the hash id as a string (ids are chained: an equal id is an
    equal prefix), ``size`` is ``block_tokens * bytes_per_token`` for every block (the KV cache allocates
    whole blocks, the last one too), ``req`` the request's index among the valid lines (from 0), ``pos`` the
    block's index in ``hash_ids``, ``req_out`` the optional ``output_length`` with ``output_lengths`` (else, or
    without one, -1; a present one is checked either way). A request is checked whole before its first block comes out, so a bad
    line yields nothing.
    """
    size = options.block_tokens * options.bytes_per_token
    req = 0
    for lineno, rec in _json_records(lines, name, options, stats):
        try:
            t = _number(rec, "timestamp") / 1000.0
            ids = _field(rec, "hash_ids")
            if type(ids) is not list:
                raise _Bad(f"field 'hash_ids' must be a list, got {_show(ids)}")
            keys = [_key(h, "hash_ids") for h in ids]
            out = _count(rec, "output_length")
            if not options.output_lengths:
                out = -1
        except _Bad as exc:
            error = _fail(name, lineno, str(exc), options, stats)
            if error is not None:
                raise error from None
            continue
        for pos, key in enumerate(keys):
            stats.accesses += 1
            yield _new(Access, (t, key, size, "", "", req, pos, out))
        req += 1


NO_SIZES_HINT = " (CsvColumns(size=None) for a trace without sizes)"
"""Ends the error of a CSV header without a mapped column; a command replaces it with its own spelling."""


def read_csv(lines: Iterable[str], name: str, options: ReadOptions, stats: ReadStats) -> Iterator[Access]:
    """libCacheSim-style CSV: a header line, then one access per row, columns chosen by ``csv_columns``.

    ``t`` is the time column times ``time_scale``; ``key`` the id column as written; ``size`` an int > 0
    (1 when ``size`` is None); ``ns`` the namespace column or "". A header lacking a mapped column raises
    ``TraceError`` even with ``skip_bad`` (no row could be read).
    """
    columns = options.csv_columns
    scale = options.time_scale
    rows = csv.reader(lines)
    header: list[str] | None = None
    while header is None:
        try:
            row = next(rows)
        except StopIteration:
            stats.lines = rows.line_num
            return
        except csv.Error as exc:
            raise TraceError(name, rows.line_num, f"unreadable CSV header: {exc}") from exc
        if row and not (len(row) == 1 and row[0].isspace()):
            header = [column.strip() for column in row]
    stats.lines = rows.line_num
    wanted = {"time": columns.time, "id": columns.id, "size": columns.size, "ns": columns.ns}
    missing = [f"{role}={column!r}" for role, column in wanted.items() if column is not None and column not in header]
    if missing:
        raise TraceError(name, rows.line_num, f"header {header} lacks the mapped column(s) {', '.join(missing)}"
                                              + NO_SIZES_HINT)
    width = len(header)
    ti = header.index(columns.time)
    ii = header.index(columns.id)
    si = None if columns.size is None else header.index(columns.size)
    ni = None if columns.ns is None else header.index(columns.ns)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as exc:
            stats.lines = rows.line_num
            error = _fail(name, rows.line_num, f"unreadable CSV row: {exc}", options, stats)
            if error is not None:
                raise error from exc
            continue
        stats.lines = lineno = rows.line_num
        if not row or (len(row) == 1 and (not row[0] or row[0].isspace())):
            continue
        try:
            if len(row) != width:
                raise _Bad(f"expected {width} fields, got {len(row)}")
            try:
                t = float(row[ti]) * scale
            except ValueError:
                raise _Bad(f"time column {columns.time!r} must be a number, got {_show(row[ti])}") from None
            if not _isfinite(t):
                raise _Bad(f"time column {columns.time!r} must be finite, got {_show(row[ti])}")
            key = row[ii]
            if not key:
                raise _Bad(f"id column {columns.id!r} is empty")
            if si is None:
                size = 1
            else:
                try:
                    size = int(row[si])
                except ValueError:
                    raise _Bad(f"size column {columns.size!r} must be an int, got {_show(row[si])}") from None
                if size <= 0:
                    raise _Bad(f"size column {columns.size!r} must be > 0, got {size}")
            ns = "" if ni is None else row[ni]
        except _Bad as exc:
            error = _fail(name, lineno, str(exc), options, stats)
            if error is not None:
                raise error from None
            continue
        stats.accesses += 1
        yield _new(Access, (t, key, size, ns, "", -1, -1, -1))


def _detect(line: str, name: str, lineno: int) -> str:
    """The JSON format a trace's first non-empty line belongs to, by its keys."""
    try:
        rec = _loads(line)
    except (ValueError, RecursionError):
        rec = None
    if type(rec) is dict:
        if "hash_ids" in rec:
            return "mooncake"
        if "outcome" in rec:
            return "events"
        if "t" in rec and "key" in rec:
            return "canonical"
    raise TraceError(name, lineno, f"cannot detect the trace format from {_show(line.strip())}: name a .csv file "
                                   f"or pass format= one of {sorted(set(FORMATS) - {'auto'})}")


def read_auto(lines: Iterable[str], name: str, options: ReadOptions, stats: ReadStats) -> Iterator[Access]:
    """``csv`` when ``name`` ends in ``.csv``; else by the first non-empty line's keys: ``hash_ids`` →
    mooncake, ``outcome`` → events, ``t`` and ``key`` → canonical. Anything else raises ``TraceError`` at
    that line. An empty trace has no accesses."""
    if name.lower().endswith(".csv"):
        yield from read_csv(lines, name, options, stats)
        return
    it = iter(lines)
    head: list[str] = []
    for line in it:
        head.append(line)
        if line and not line.isspace():
            break
    else:
        stats.lines = len(head)
        return
    fmt = _detect(head[-1], name, len(head))
    yield from FORMATS[fmt](chain(head, it), name, options, stats)


FORMATS: dict[str, Reader] = {
    "auto": read_auto,
    "events": read_event_trace,
    "canonical": read_canonical,
    "mooncake": read_mooncake,
    "csv": read_csv,
}


def read_trace(source: str | os.PathLike[str] | TextIO, format: str = "auto", *, skip_bad: bool = False,
               stats: ReadStats | None = None, block_tokens: int = 512, bytes_per_token: int = 1,
               csv_columns: CsvColumns | None = None, time_scale: float = 1.0,
               output_lengths: bool = False) -> Iterator[Access]:
    """Stream the accesses of a trace file (a path, opened and closed here) or an open text stream (read
    from where it stands, never closed here). Nothing is read until the first access is asked for.

    Raises at once ``ValueError`` for an unknown ``format`` (listing the known ones) or a bad option
    (``TypeError`` for an ill-typed one); while reading, ``OSError`` for a file that cannot be opened and
    ``TraceError`` for a malformed line unless ``skip_bad`` (then it is skipped and counted in ``stats``).
    """
    try:
        reader = FORMATS[format]
    except KeyError:
        raise ValueError(f"unknown trace format {format!r}; known: {', '.join(sorted(FORMATS))}") from None
    options = ReadOptions(skip_bad=skip_bad, block_tokens=block_tokens, bytes_per_token=bytes_per_token,
                          csv_columns=CsvColumns() if csv_columns is None else csv_columns,
                          time_scale=time_scale, output_lengths=output_lengths)
    if isinstance(source, (str, os.PathLike)):
        return _read_path(os.fspath(source), reader, options, stats if stats is not None else ReadStats())
    if isinstance(source, io.IOBase) or hasattr(source, "readline"):
        name = getattr(source, "name", None)
        return reader(source, name if isinstance(name, str) else "<stream>", options,
                      stats if stats is not None else ReadStats())
    raise TypeError(f"source must be a path or a text stream, got {type(source).__name__}")


def _read_path(path: str, reader: Reader, options: ReadOptions, stats: ReadStats) -> Iterator[Access]:
    # newline="": the csv module needs raw line ends to read quoted fields; JSON ignores a trailing "\r".
    with open(path, encoding="utf-8", newline="") as fh:
        yield from reader(fh, path, options, stats)
