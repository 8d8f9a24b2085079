"""`evocache bench eviction`: replay one trace against eviction policies at several cache sizes, with Belady.

Exit codes: 0 success; 1 a malformed trace (``file:line: message``), an empty one, ``--plot`` without
matplotlib, or ``--peers`` without libcachesim; 2 a bad option (an unknown policy lists the known ones), an
option the trace cannot take (``--utilisation`` or ``--output-lengths`` on a trace that is not Mooncake) or a
file that cannot be read or written (outputs are checked before the replays).
Errors go to stderr; stdout holds only the table.
Nothing heavy is imported at module level: `evocache` starts fast whatever command it runs.
"""

from __future__ import annotations

import enum
import inspect
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..cli_errors import EXIT_FAILED
from ..cli_errors import error as _error
from ..cli_errors import usage as _usage
from ..cli_errors import writable as _writable

if TYPE_CHECKING:
    import random
    from types import ModuleType

    from ._access import Access
    from ..eviction import Clock, EvictionPolicy
    from ._queue import QueueModel
    from ._readers import CsvColumns
    from ._sim import PolicyFactory, ReplayResult

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Replay traces against the cache's policies."
)
"""The replay room's commands alone (`eviction`); the `evocache` command mounts ``eviction`` in a group of its
own beside the other rooms' bench commands."""

EXIT_UNREADABLE = 2


class TraceFormat(enum.StrEnum):
    """``--format``: the trace formats ``read_trace`` reads (``_readers.FORMATS``)."""

    auto = "auto"
    events = "events"
    canonical = "canonical"
    mooncake = "mooncake"
    csv = "csv"


class Unit(enum.StrEnum):
    """``--unit``: what a cache size counts."""

    objects = "objects"
    bytes = "bytes"


@app.callback()
def _bench_group() -> None:
    """Replay traces against the cache's policies."""
    # A callback keeps `eviction` a subcommand: a one-command typer app would otherwise take its options itself.


# -- option parsing: each turns one option's text into a value, or prints why not and raises Failed (exit 2) ---


def _parse_sizes(text: str) -> tuple[float, ...]:
    """Distinct fractions in (0, 1], ascending (the plot's x axis and the table's columns read left to right)."""
    sizes = set()
    for part in text.split(","):
        try:
            size = float(part)
        except ValueError:
            raise _usage("--sizes", f"{part.strip()!r} is not a number") from None
        if not (math.isfinite(size) and 0 < size <= 1):
            raise _usage("--sizes", f"{part.strip()} is not a fraction in (0, 1]")
        sizes.add(size)
    return tuple(sorted(sizes))


def _parse_policies(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """Registered names, in the order given, once each. ``belady`` is always run, so naming it adds nothing.
    ``lookahead:BASE`` is the look-ahead policy over another registered base policy (``lookahead`` alone: LRU)."""
    names: list[str] = []
    known_list = ", ".join(sorted(known))
    for part in text.split(","):
        head, colon, base = (s.strip() for s in part.partition(":"))
        name = f"{head}:{base}" if colon else head
        if colon:
            if head != "lookahead":
                raise _usage("--policies", f"{name!r}: only lookahead takes a base policy (lookahead:BASE)")
            if base not in known or base == "lookahead":
                bases = ", ".join(sorted(k for k in known if k != "lookahead"))
                raise _usage("--policies", f"{name!r}: the base must be another registered policy, one of {bases}")
            if base == "lru":
                name = "lookahead"  # LRU is lookahead's own base: the same policy, once
        if name == "belady" or name in names:
            continue
        if not colon and name not in known:
            raise _usage("--policies", f"unknown eviction policy {name!r}; known: {known_list} (belady always runs)")
        names.append(name)
    if not names:
        raise _usage("--policies", "name at least one policy besides belady")
    return tuple(names)


def _parse_columns(text: str) -> CsvColumns:
    """``role=column`` pairs over ``CsvColumns``' defaults; an empty column (``size=``) means "none"."""
    from dataclasses import fields, replace

    from ._readers import CsvColumns

    columns = CsvColumns()
    roles = [f.name for f in fields(CsvColumns)]
    for pair in text.split(","):
        role, eq, column = (s.strip() for s in pair.partition("="))
        if not eq or role not in roles:
            raise _usage("--csv-columns",
                         f"expected ROLE=COLUMN with ROLE one of {', '.join(roles)}, got {pair.strip()!r}")
        if not column and role in ("time", "id"):
            raise _usage("--csv-columns", f"{role} needs a column")
        columns = replace(columns, **{role: column or None})
    return columns


def _parse_utilisation(utilisation: float) -> float:
    if not (math.isfinite(utilisation) and 0 < utilisation < 1):
        raise _usage("--utilisation", f"expected a number in (0, 1), got {utilisation:g}: at U >= 1 the queue grows "
                                      "without bound")
    return utilisation


def _figure_class() -> Callable[..., Any]:
    """matplotlib's ``Figure``, imported only for ``--plot``: matplotlib is an optional extra."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise _error("error: --plot needs matplotlib: pip install 'evocache[bench]' (in a source checkout: "
                     ".venv/bin/pip install -e '.[bench]')", EXIT_FAILED) from None
    return Figure


def _libcachesim() -> ModuleType:
    """The ``libcachesim`` module, imported only for ``--peers``: it is GPL-3.0, an optional benchmark extra."""
    from ._peers import load_libcachesim

    try:
        return load_libcachesim()
    except ImportError as exc:
        raise _error(f"error: {exc}", EXIT_FAILED) from None


# -- the command --------------------------------------------------------------------------------------------

def eviction(
    trace_path: Annotated[Path, typer.Option("--trace", metavar="FILE", help="The trace to replay.")],
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="OUT", help="Also write every result here, as JSON.")
    ] = None,
    trace_format: Annotated[
        TraceFormat, typer.Option("--format", help="The trace's format; auto tells it by the file name (.csv) "
                                  "or by the keys of its first line.")
    ] = TraceFormat.auto,
    sizes_text: Annotated[
        str, typer.Option("--sizes", help="Cache sizes, comma-separated, as fractions of the trace's working set.")
    ] = "0.01,0.05,0.1",
    policies_text: Annotated[
        str, typer.Option("--policies", help="Eviction policies to replay, comma-separated: arc, learned, "
                          "learned-rank, lfu, lookahead, lru, lruk, s3fifo, weighted; lookahead:BASE is the "
                          "look-ahead over BASE. Belady always runs.")
    ] = "lru,lfu,lruk,s3fifo,weighted",
    plot: Annotated[
        Path | None, typer.Option("--plot", metavar="OUT.png", help="Plot hit ratio against size (matplotlib).")
    ] = None,
    unit: Annotated[
        Unit | None,
        typer.Option(
            "--unit",
            help="What a cache size counts: objects (each counts 1) or bytes. Default: objects for Mooncake "
            "traces, bytes otherwise.",
        ),
    ] = None,
    csv_columns: Annotated[
        str | None,
        typer.Option("--csv-columns", metavar="ROLE=COLUMN,...",
                     help="CSV traces: which header column holds each of time, id, size and ns (default: "
                          "time=time,id=id,size=size, no ns), e.g. id=lbn; size= (empty) for a trace without "
                          "sizes, every object counting 1."),
    ] = None,
    block_tokens: Annotated[
        int, typer.Option("--block-tokens", min=1, help="Mooncake traces: tokens per KV block (a block's size).")
    ] = 512,
    skip_bad: Annotated[
        bool, typer.Option("--skip-bad", help="Skip malformed trace lines (and count them) instead of failing.")
    ] = False,
    peers: Annotated[
        bool,
        typer.Option(
            "--peers",
            help="Add libCacheSim's LRU, ARC, S3-FIFO, SIEVE, LeCaR, Cacheus, WTinyLFU, GLCache and LRB as rows "
            "lcs:NAME (needs libcachesim, GPL-3.0: evocache's 'peers' extra).",
        ),
    ] = False,
    output_lengths: Annotated[
        bool,
        typer.Option(
            "--output-lengths",
            help="Mooncake traces: tell policies each request's output length (the tokens it generated) when the "
            "request completes, as a server knows it then; the replay serves one request at a time, so that is "
            "before the next request's blocks.",
        ),
    ] = False,
    utilisation: Annotated[
        float | None,
        typer.Option(
            "--utilisation",
            metavar="U",
            help="Mooncake traces: requests wait for one FIFO server whose service time per block makes its "
            "utilisation (arrival rate x mean service time) U, in (0, 1) (at U >= 1 the queue grows without "
            "bound); the lookahead policy is told the waiting requests. Other policies replay unchanged.",
        ),
    ] = None,
) -> None:
    """Replay a trace against eviction policies at several cache sizes, with Belady's optimum as the bound.

    The trace is read once into memory (every policy at every size replays it, and Belady needs it whole), so
    memory grows with its length. Sizes are fractions of the working set: its distinct objects with
    --unit objects, their bytes with --unit bytes. In bytes mode Belady is a heuristic (the true
    optimum for sizes is NP-hard). "gap closed" is (policy - LRU) / (Belady - LRU).

    With --peers, libCacheSim gets exactly the accesses, object identities, sizes (1 each with --unit objects)
    and capacities that evocache's policies get, and its hits are counted the same way.

    With --utilisation U (Mooncake traces), each request's blocks are accessed when its service starts at one
    FIFO server taking a fixed time per block, chosen so that arrival rate x mean service time = U; at that
    moment the lookahead policy is told the requests that have arrived and not started (nothing later). The
    JSON then holds "queue": the utilisation, the seconds per block, the (LLM) requests, their blocks, the
    arrival span, and the requests waiting at a service start, on average and at most. The JSON's own
    "requests" counts cache requests: block accesses, one per block of each LLM request on a Mooncake trace.
    """
    _bench(trace_path, json_out, trace_format.value, sizes_text, policies_text, plot,
           unit.value if unit is not None else None, csv_columns, block_tokens, skip_bad, peers, utilisation,
           output_lengths)


def _reflow(doc: str) -> str:
    # rich's --help keeps every line break of a docstring; one line per paragraph lets it wrap to the terminal.
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(doc).split("\n\n"))


eviction.__doc__ = _reflow(eviction.__doc__ or "")
app.command()(eviction)


def _bench(trace_path: Path, json_out: Path | None, trace_format: str, sizes_text: str, policies_text: str,
           plot: Path | None, unit: str | None, csv_columns: str | None, block_tokens: int,
           skip_bad: bool, peers: bool, utilisation: float | None = None, output_lengths: bool = False) -> None:
    from ..eviction import EVICTION_POLICIES
    from ._queue import Backlog, Load, QueueModel
    from ._sim import working_set

    sizes = _parse_sizes(sizes_text)
    policies = _parse_policies(policies_text, list(EVICTION_POLICIES))
    columns = _parse_columns(csv_columns) if csv_columns is not None else None
    if utilisation is not None:
        utilisation = _parse_utilisation(utilisation)
    # Before the replays: fail in a second, not at the end of a run of minutes.
    _writable("--json", json_out)
    _writable("--plot", plot)
    figure = _figure_class() if plot is not None else None
    lcs = _libcachesim() if peers else None

    trace, skipped = _read(trace_path, trace_format, columns, block_tokens, skip_bad, output_lengths)
    if skipped:
        typer.echo(f"skipped {skipped} malformed line(s) of {trace_path}", err=True)
    # Mooncake accesses carry their request number; unit-size blocks are how bench/data/README.md's reference
    # points are taken.
    mooncake = trace[0].req >= 0
    if output_lengths and not mooncake:
        raise _usage("--output-lengths", "output lengths come with a KV-block (Mooncake) trace; this one has none")
    unit = unit or ("objects" if mooncake else "bytes")
    queue, queue_report, queue_notes = None, None, []
    if utilisation is not None:
        if not mooncake:
            raise _usage("--utilisation", "the queue model needs a KV-block (Mooncake) trace")
        try:
            queue = QueueModel.for_utilisation(trace, utilisation)
            load = Load.of(trace)
            backlog = Backlog.of(trace, queue)
        except ValueError as exc:
            raise _usage("--utilisation", str(exc)) from None
        queue_report = {"utilisation": utilisation, "per_block_s": queue.per_block, "requests": load.requests,
                        "blocks": load.blocks, "span_s": load.span, "mean_waiting": backlog.mean,
                        "max_waiting": backlog.most}
        queue_notes.append(
            f"queue: one FIFO server, {queue.per_block * 1000:.3f} ms per block: utilisation {utilisation:g} "
            f"({load.requests} requests over {load.span:g} s, {load.blocks} blocks); at a service start "
            f"{backlog.mean:.1f} requests wait on average, {backlog.most} at most; lookahead is told the "
            "waiting requests at each service start, the other policies replay unchanged")
    elif any(name.partition(":")[0] == "lookahead" for name in policies):
        queue_notes.append("lookahead ran without a queue (no --utilisation): it decides as its base policy")

    ws = working_set(trace)
    whole = ws.objects if unit == "objects" else ws.bytes
    capacities = {size: max(1, math.floor(size * whole)) for size in sizes}  # as replay(fraction=...) sizes it
    peer_names, peer_notes = _peer_names(lcs, min(capacities.values())) if lcs is not None else ((), [])
    results, lru = _run(trace, capacities, policies, unit, lcs, peer_names, queue)
    rows = [
        {
            "policy": r.policy,
            "size": size,
            "capacity": r.capacity,
            "hit_ratio": r.hit_ratio,
            "byte_hit_ratio": r.byte_hit_ratio,
            "prefix_hit_ratio": r.prefix_hit_ratio if mooncake else None,
        }
        for size in sizes
        for r in results[size]
    ]
    report = {"trace": str(trace_path), "requests": len(trace), "objects": ws.objects, "unit": unit,
              "skipped": skipped, "rows": rows}
    if queue_report is not None:
        report["queue"] = queue_report
    if output_lengths:
        report["output_lengths"] = True
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise _error(f"error: --json: {json_out}: {exc.strerror or exc}", EXIT_UNREADABLE) from None

    notes = queue_notes + peer_notes + (_peer_result_notes(results, sizes, len(trace)) if peer_names else [])
    if output_lengths:
        notes.insert(0, "--output-lengths: policies learn each request's output_length when it completes (before the "
                        "next request: one request at a time); the learned policy classifies its blocks then")
    _print_table(results, lru, sizes, capacities, unit, mooncake, lru_requested="lru" in policies, extra=notes)
    if figure is not None:
        assert plot is not None
        _plot(figure, plot, results, sizes, unit, trace_path.name)


def _read(path: Path, fmt: str, columns: CsvColumns | None, block_tokens: int,
          skip_bad: bool, output_lengths: bool = False) -> tuple[list[Access], int]:
    """The whole trace and the number of lines skipped; prints and raises ``Failed`` when it cannot be read."""
    from ..errors import TraceError
    from ._readers import NO_SIZES_HINT, ReadStats, read_trace

    stats = ReadStats()
    try:  # read_trace checks its options at once, and reads nothing until iterated
        accesses = read_trace(path, fmt, skip_bad=skip_bad, stats=stats, block_tokens=block_tokens,
                              csv_columns=columns, output_lengths=output_lengths)
    except ValueError as exc:
        raise _usage("--format", str(exc)) from None
    try:
        trace = list(accesses)
    except TraceError as exc:
        message = exc.message
        if message.endswith(NO_SIZES_HINT):  # the reader's hint spells the Python API; say it as an option
            message = message.removesuffix(NO_SIZES_HINT) + " (--csv-columns size= for a trace without sizes)"
        raise _error(f"{exc.file}:{exc.line}: {message}", EXIT_FAILED) from None
    except UnicodeDecodeError:
        raise _error(f"error: {path}: not UTF-8 text", EXIT_FAILED) from None
    except OSError as exc:
        raise _error(f"error: {path}: {exc.strerror or exc}", EXIT_UNREADABLE) from None
    if not trace:
        raise _error(f"error: {path}: the trace has no accesses", EXIT_FAILED)
    return trace, stats.skipped


def _peer_names(lcs: ModuleType, smallest_capacity: int) -> tuple[tuple[str, ...], list[str]]:
    """The peers that can run, and a note for each that cannot (told, not fatal: the rest run)."""
    from ._peers import PEERS, PREFIX, unavailable

    missing = unavailable(lcs, smallest_capacity)
    notes = [f"{PREFIX}{name} not run: {why}" for name, why in missing.items()]
    return tuple(name for name in PEERS if name not in missing), notes


def _peer_result_notes(results: dict[float, list[ReplayResult]], sizes: tuple[float, ...],
                       accesses: int) -> list[str]:
    """What a reader must know to read the lcs: rows right (see ``_peers``)."""
    from importlib.metadata import version

    from ._peers import LRB_MIN_SAMPLES, PREFIX, RANDOMISED

    notes = [f"{PREFIX}* rows: libCacheSim {version('libcachesim')} with its default parameters, fed the same "
             "accesses, objects, sizes and capacities"]
    by_name = {size: {r.policy: r for r in results[size]} for size in sizes}
    randomised = [PREFIX + name for name in RANDOMISED if PREFIX + name in by_name[sizes[0]]]
    if randomised:
        notes.append(f"{' and '.join(randomised)} use libCacheSim's own unseeded random generator: they vary "
                     "from run to run")
    lrb, lcs_lru = PREFIX + "LRB", PREFIX + "LRU"
    if lrb in by_name[sizes[0]] and lcs_lru in by_name[sizes[0]] and all(
            by_name[s][lrb].hits == by_name[s][lcs_lru].hits for s in sizes):
        notes.append(f"{lrb} equals {lcs_lru} here: libCacheSim's LRB trains only after {LRB_MIN_SAMPLES:,} "
                     f"labelled samples, and this trace has {accesses:,} accesses")
    return notes


def _run(trace: list[Access], capacities: dict[float, int], policies: tuple[str, ...], unit: str,
         lcs: ModuleType | None = None, peers: tuple[str, ...] = (), queue: QueueModel | None = None
         ) -> tuple[dict[float, list[ReplayResult]], dict[float, ReplayResult]]:
    """Per size (``capacities``' keys, ascending): the requested policies' results, then libCacheSim's
    ``peers`` (with ``lcs``), then Belady's; and LRU's (the gap's baseline) even if not asked. ``queue``
    reaches every replay (only a look-ahead policy reads it)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ._belady import belady_size, belady_unit
    from ._peers import PREFIX, encode, replay_peer  # libcachesim itself comes in as ``lcs``
    from ._sim import replay

    capacity_arg = "capacity_objects" if unit == "objects" else "capacity_bytes"
    belady = belady_unit if unit == "objects" else belady_size
    runs = list(policies) if "lru" in policies else ["lru", *policies]
    encoded = encode(trace, "objects" if unit == "objects" else "bytes") if peers else None  # once for all
    results: dict[float, list[ReplayResult]] = {}
    lru: dict[float, ReplayResult] = {}
    # stderr and transient: the table on stdout stays clean, and nothing is left behind in a terminal. Off when
    # stderr is not a terminal: a log file would only get a stray line.
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=not console.is_terminal)
    with progress:
        task = progress.add_task("replay", total=len(capacities) * (len(runs) + len(peers) + 1))
        for size, capacity in capacities.items():
            row: list[ReplayResult] = []
            for name in runs:
                progress.update(task, description=f"{name} @ {size:g}")
                result = replay(trace, _policy(name, capacity), queue=queue, **{capacity_arg: capacity})
                if name == "lru":
                    lru[size] = result
                if name in policies:
                    row.append(result)
                progress.advance(task)
            for name in peers:
                assert lcs is not None and encoded is not None
                progress.update(task, description=f"{PREFIX}{name} @ {size:g}")
                row.append(replay_peer(lcs, name, encoded, capacity))
                progress.advance(task)
            progress.update(task, description=f"belady @ {size:g}")
            row.append(belady(trace, capacity))
            progress.advance(task)
            results[size] = row
    return results, lru


def _policy(name: str, capacity: int) -> str | PolicyFactory:
    """What ``replay`` takes for a ``--policies`` name: the name itself, or for ``lookahead:BASE`` a factory
    whose results carry that name."""
    head, _, base = name.partition(":")
    if not base:
        return name

    def factory(*, clock: Clock, rng: random.Random) -> EvictionPolicy:
        from ..eviction import make_eviction_policy

        policy = make_eviction_policy(head, capacity=capacity, base=base, clock=clock, rng=rng)
        policy.name = name  # the row's name in the table and the JSON
        return policy

    return factory


def _gap(result: ReplayResult, lru: ReplayResult, best: ReplayResult) -> str:
    """The share of LRU's distance to Belady that ``result`` closes; blank where it means nothing."""
    if result is best or result.policy == "lru" or best.hit_ratio == lru.hit_ratio:
        return ""
    return f"{(result.hit_ratio - lru.hit_ratio) / (best.hit_ratio - lru.hit_ratio):.1%}"


def _percent(size: float) -> str:
    return f"{size * 100:g}%"


def _print_table(results: dict[float, list[ReplayResult]], lru: dict[float, ReplayResult],
                 sizes: tuple[float, ...], capacities: dict[float, int], unit: str, mooncake: bool,
                 lru_requested: bool, extra: Sequence[str] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("policy")
    for size in sizes:
        table.add_column(f"{_percent(size)} hit", justify="right")
        table.add_column(f"{_percent(size)} gap", justify="right")
        if mooncake:
            table.add_column(f"{_percent(size)} prefix", justify="right")
    for i, first in enumerate(results[sizes[0]]):
        cells = [first.policy]
        for size in sizes:
            result, best = results[size][i], results[size][-1]
            cells += [f"{result.hit_ratio:.3f}", _gap(result, lru[size], best)]
            if mooncake:
                cells.append(f"{result.prefix_hit_ratio:.3f}")
        table.add_row(*cells)
    notes = [
        "capacity: " + ", ".join(f"{_percent(s)} = {capacities[s]} {unit}" for s in sizes),
        "gap = (policy - LRU) / (Belady - LRU)",
    ]
    if not lru_requested:
        notes.append("LRU was not requested: it was run only as the gap's baseline")
    if unit == "bytes":
        notes.append("belady-size is a heuristic, not a bound: a policy may beat it")
    notes += extra
    # Piped or captured, rich would wrap the table to 80 columns; a file gets the table's own width. The
    # heading and notes are plain lines: as a title and caption rich would pad them to the table's width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 10_000)
    typer.echo(f"hit ratio by cache size (fraction of the working set's {unit})")
    console.print(table)
    typer.echo("\n".join(notes))


def _plot(figure_class: Callable[..., Any], path: Path, results: dict[float, list[ReplayResult]],
          sizes: tuple[float, ...], unit: str, title: str) -> None:
    from matplotlib.ticker import PercentFormatter

    # A Figure of its own, not pyplot: no global backend or figure registry is touched.
    fig = figure_class(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, first in enumerate(results[sizes[0]]):
        is_belady = i == len(results[sizes[0]]) - 1
        ax.plot(sizes, [results[s][i].hit_ratio for s in sizes], marker="o", label=first.policy,
                linestyle="--" if is_belady else "-", color="black" if is_belady else None)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(f"cache size (fraction of the working set's {unit})")
    ax.set_ylabel("hit ratio")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    try:
        fig.savefig(path, dpi=120, format="png")
    except OSError as exc:
        raise _error(f"error: --plot: {path}: {exc.strerror or exc}", EXIT_UNREADABLE) from None
