"""Traces as the loop reads them: a file of any format replay reads, turned into ``Request``s and windows.

    requests = read_requests("mooncake_synthetic_trace.jsonl")
    for window in windows(requests, size=300): ...

Formats: everything ``controller.replay.read_trace`` reads (access events, canonical, Mooncake, CSV), plus
semantic streams (``{"prompt", "group"}`` per line). Mooncake and stream lines may carry ``tenant``, ``rule``
and ``phase`` (a drifting benchmark's label; it travels with the request for the report and is never read by
the loop's decisions). A Mooncake line is one request whose keys are its block hashes; any other access is a
request with one key. Stream rows without a ``t`` are one second apart, in file order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from evocache.controller.replay import read_trace

from ._types import Request
from .errors import WorkloadError

MAX_PROMPT_CHARS = 32_768
"""A stream row's prompt is refused beyond this (the embedder truncates far earlier; a bigger one is bad
input)."""
MAX_LINE_CHARS = 1 << 20
BLOCK_TOKENS = 512  # Mooncake's block: a request's prompt tokens are its blocks times this when not given


def trace_format(path: Path) -> str:
    """``stream`` for a semantic stream, ``mooncake`` for a Mooncake trace (by the first line's keys), else
    ``auto`` (``read_trace`` tells the other formats apart)."""
    if path.suffix.lower() != ".csv":
        first = _first_record(path)
        if first is not None and "prompt" in first and "group" in first:
            return "stream"
        if first is not None and "hash_ids" in first:
            return "mooncake"
    return "auto"


def read_requests(path: str | Path, format: str = "auto") -> list[Request]:
    """All requests of the trace at ``path``, in file order. Raises ``WorkloadError`` naming the file (and
    line) for a file that cannot be read or a malformed line."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    try:
        fmt = trace_format(path) if format == "auto" else format
        if fmt == "stream":
            return list(_stream(path))
        if fmt == "mooncake":
            return _mooncake(path)
        return [Request(t=a.t, kind="response", keys=(a.key,), size=a.size, ns=a.ns, rule=a.rule)
                for a in read_trace(path, fmt)]
    except WorkloadError:
        raise
    except (OSError, ValueError) as exc:  # TraceError is a ValueError and names file and line
        raise WorkloadError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None


def windows(requests: Sequence[Request], size: int) -> Iterator[Sequence[Request]]:
    """Consecutive windows of ``size`` requests (the last one may be shorter; one shorter than half a window
    is
    folded into the one before, so a tail never makes a window too small to judge)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"window size must be an int >= 1, got {size!r}")
    n = len(requests)
    bounds = list(range(0, n, size))
    if len(bounds) > 1 and n - bounds[-1] < size / 2:
        bounds.pop()
    for i, start in enumerate(bounds):
        end = bounds[i + 1] if i + 1 < len(bounds) else n
        yield requests[start:end]


def _first_record(path: Path) -> dict[str, Any] | None:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():
                try:
                    record = json.loads(line[:MAX_LINE_CHARS])
                except ValueError:
                    return None
                return record if isinstance(record, dict) else None
    return None


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE_CHARS:
                raise WorkloadError(f"{path}:{lineno}: line longer than {MAX_LINE_CHARS} characters")
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise WorkloadError(f"{path}:{lineno}: not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise WorkloadError(f"{path}:{lineno}: a line must be a JSON object")
            yield lineno, record


def _label(record: dict[str, Any], field: str, where: str) -> str | None:
    value = record.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 128:
        raise WorkloadError(f"{where}: field {field!r} must be a string of at most 128 characters")
    return value


def _mooncake(path: Path) -> list[Request]:
    # read_trace validates every line and yields its blocks; the labels come from a second, light pass
    blocks: dict[int, list[str]] = {}
    meta: dict[int, tuple[float, int, int]] = {}
    for a in read_trace(path, "mooncake", output_lengths=True):
        blocks.setdefault(a.req, []).append(a.key)
        meta[a.req] = (a.t, a.size, a.req_out)
    out: list[Request] = []
    for index, (lineno, record) in enumerate(_records(path)):
        where = f"{path}:{lineno}"
        t, size, out_len = meta.get(index, (float(record.get("timestamp", 0)) / 1000.0, BLOCK_TOKENS, -1))
        keys = tuple(blocks.get(index, ()))
        prompt_tokens = record.get("input_length")
        if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool) or prompt_tokens < 0:
            prompt_tokens = len(keys) * BLOCK_TOKENS
        out.append(Request(t=t, kind="kv", keys=keys, size=size, ns=_label(record, "tenant", where) or "",
                           rule=_label(record, "rule", where) or "", prompt_tokens=prompt_tokens,
                           output_tokens=out_len, phase=_label(record, "phase", where)))
    return out


def _stream(path: Path) -> Iterator[Request]:
    for index, (lineno, record) in enumerate(_records(path)):
        where = f"{path}:{lineno}"
        prompt, group = record.get("prompt"), record.get("group")
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: field 'prompt' must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise WorkloadError(f"{where}: field 'prompt' is longer than {MAX_PROMPT_CHARS} characters")
        if not isinstance(group, str):
            raise WorkloadError(f"{where}: field 'group' must be a string")
        t = record.get("t", float(index))
        if isinstance(t, bool) or not isinstance(t, int | float) or t != t:
            raise WorkloadError(f"{where}: field 't' must be a number of seconds")
        yield Request(t=float(t), kind="semantic", keys=(prompt,), size=len(prompt.encode()) + len(group),
                      ns=_label(record, "tenant", where) or "", rule=_label(record, "rule", where) or "",
                      prompt_tokens=len(prompt.split()), prompt=prompt, group=group,
                      phase=_label(record, "phase", where))
