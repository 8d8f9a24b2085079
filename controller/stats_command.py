"""`evocache stats`: hits, misses, tokens and money saved per rule and tenant, from access events.

    evocache stats --events .evocache/serve/events.jsonl --since 1h
    evocache stats --redis redis://localhost:6379/0 --since 2026-12-01T00:00 --until 2026-12-02T00:00 --json

Events come from JSONL files (``--events``, repeatable: one per replica) or a Redis stream (``--redis``,
``--stream``), read through ``controller.read_events``. ``--since`` and ``--until`` take an ISO time (UTC when
it names no zone) or a duration before now (``90m``, ``1d``). Money is in the currency of the deployment's price
table (``ServerSpec.prices``); without one only tokens are saved. Exit codes: 0 done; 2 a usage error or events
that cannot be read (the file and line named).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer

from .cli_errors import usage

_PAGE = 1000


def _instant(option: str, text: str | None, now: float) -> float | None:
    """Seconds since the epoch for an ISO time or a duration before ``now``; ``Failed`` naming the option."""
    if text is None:
        return None
    from evocache.dsl import parse_duration  # noqa: PLC0415

    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise usage(option, f"{text!r} is neither an ISO time (2026-12-01T08:00) nor a duration (90m)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _stream_events(url: str, stream: str) -> Iterator[object]:
    from ._events import AccessEvent  # noqa: PLC0415
    from ._redis_client import connect  # noqa: PLC0415

    client = connect(url)
    try:
        start = "-"
        while True:
            rows = client.xrange(stream, min=start, count=_PAGE)
            for _, fields in rows:
                yield AccessEvent.from_dict(json.loads(fields[b"e"]))
            if len(rows) < _PAGE:
                return
            start = "(" + rows[-1][0].decode()
    finally:
        client.close()


def stats(
    events: Annotated[list[Path] | None, typer.Option("--events", help="A JSONL access-event file (repeat for "
                                                     "several).")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis", metavar="URL", help="Read the events' Redis stream "
                                                  "instead.")] = None,
    stream: Annotated[str, typer.Option(help="The Redis stream's key.")] = "evocache:events",
    since: Annotated[str | None, typer.Option(help="From this ISO time, or this long ago (90m, 1d).")] = None,
    until: Annotated[str | None, typer.Option(help="Until this ISO time, or this long ago.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
) -> None:
    """Hits, misses, tokens and money saved per rule and tenant, from access events."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    from ._calls import read_events  # noqa: PLC0415
    from ._stats import call_stats, total  # noqa: PLC0415
    from .replay import TraceError  # noqa: PLC0415

    if (events is None) == (redis_url is None):
        raise usage("--events", "give --events FILE (one or more) or --redis URL")
    now = time.time()
    start, end = _instant("--since", since, now), _instant("--until", until, now)
    try:
        if redis_url is not None:
            rows = call_stats(_stream_events(redis_url, stream), start, end)
        else:
            rows = call_stats((e for path in events or () for e in read_events(path)), start, end)
    except TraceError as exc:
        raise usage("--events", str(exc)) from None
    except OSError as exc:
        raise usage("--events", f"{exc.filename or ''}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - a Redis that cannot be reached, a stream that is not events
        raise usage("--redis", f"cannot read {stream!r}: {type(exc).__name__}: {exc}") from None
    whole = total(rows)
    if as_json:
        typer.echo(json.dumps({"rows": [r.as_dict() for r in rows], "total": whole.as_dict()}, indent=2))
        return
    table = Table(title="evocache: what the cache did" + (f" since {since}" if since else ""))
    for name in ("rule", "tenant", "calls", "hits", "semantic", "misses", "bypasses", "hit ratio",
                 "tokens saved", "money saved"):
        table.add_column(name, justify="left" if name in ("rule", "tenant") else "right")
    for row in [*rows, whole]:
        table.add_row(row.rule, row.ns, str(row.calls), str(row.hits), str(row.semantic_hits), str(row.misses),
                      str(row.bypasses), f"{row.hit_ratio:.1%}", f"{row.tokens_saved:,}", f"{row.cost_saved:.4f}")
    Console().print(table)
