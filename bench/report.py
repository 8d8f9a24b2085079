"""Render the committed benchmark results into docs/benchmarks.md and the README's headline table.

    make bench-report     (or: .venv/bin/python bench/report.py [--results DIR] [--doc FILE] [--readme FILE]
                                                                [--check])

Reads every result file of bench/results/ (one per benchmark part, see bench/_results.py), writes
docs/benchmarks.md (a section per mechanism: its tables, and under each the command that produced it, when, on
how many cores at what load, with which versions) and rewrites the README's block between ``<!-- bench:begin
-->`` and ``<!-- bench:end -->`` with the headline figures, each linking to its section. Nothing is typed by
hand: a figure that is not in a result file is not published.

A missing result file (each is named with the command that makes it), one this script has no section for, or
one that is malformed fails the whole report, one line to stderr naming the file and the field, exit 1; nothing
is written then. ``--check`` writes nothing and exits 1 when either output differs from what the results give.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _results import RESULTS, ROOT, Result, ResultError, load

DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
HEADLINE_DELTA = 0.02  # the semantic bound the README quotes (the middle of the three measured)
HEADLINE_SIZES = (0.05, 0.1)  # the eviction cache sizes it quotes
HEADLINE_UTILISATION = 0.8  # the queue look-ahead's load it quotes

# Part -> the command that writes its result file.
PARTS: dict[str, str] = {
    "semantic-streams": "make bench-semantic",
    "semantic-pairs": "make bench-semantic",
    "semantic-generalisation": "make bench-semantic-generalisation",
    "eviction-mooncake": "make bench-eviction",
    "eviction-mooncake-output-lengths": "make bench-eviction",
    "eviction-lookahead": "make bench-eviction",
    "eviction-cloudphysics": "make bench-eviction",
    "eviction-throughput": "make bench-eviction",
    "eviction-cost": "make bench-eviction",
    "overhead": "make bench",
    "serving-hit": "make bench-serving",
    "serving-miss": "make bench-serving",
    "serving-affinity": "make bench-serving",
    "serving-load": "make bench-serving",
    "gateway-hit": "make bench-gateway",
    "gateway-miss": "make bench-gateway",
    "gateway-load": "make bench-gateway",
    "gateway-savings": "make bench-gateway",
    "kv-ttft": "make bench-kv",
    "kv-chunks": "make bench-kv",
    "kv-routing": "make bench-kv",
    "kv-memory": "make bench-kv",
    "loop-kv": "make bench-loop",
    "loop-semantic": "make bench-loop",
    "loop-stationary": "make bench-loop",
}


# -- reading rows, every field checked ---------------------------------------------------------------------

_NUMBER = (int, float)


def field(result: Result, where: str, obj: Any, name: str, kind: type | tuple[type, ...] = _NUMBER, *,
          optional: bool = False) -> Any:
    """``obj[name]``, of ``kind`` (None too if ``optional``); else ``ResultError`` naming file, place and field."""
    if not isinstance(obj, Mapping):
        raise ResultError(f"{result.path}: {where} must be an object")
    if name not in obj:
        raise ResultError(f"{result.path}: {where}: missing field {name!r}")
    value = obj[name]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ResultError(f"{result.path}: {where}: field {name!r} must be {_described(kind)}, got {value!r}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _described(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "an object",
             list: "a list"}
    return "a number" if kind == _NUMBER else " or ".join(names[k] for k in _kinds(kind))


def rows_of(result: Result) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """``(where, row)`` for each row: ``where`` names it in an error message."""
    if not result.rows:
        raise ResultError(f"{result.path}: field 'rows' is empty")
    return ((f"rows[{i}]", row) for i, row in enumerate(result.rows))


# -- formatting --------------------------------------------------------------------------------------------


def span(values: Sequence[float], fmt: str) -> str:
    """``low-high`` of ``values`` in ``fmt``, or one value when they format alike."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def percent(share: float) -> str:
    return f"{share * 100:.1f} %"


def size_label(size: float) -> str:
    return f"{size * 100:g} %"


def table(header: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def provenance(result: Result) -> list[str]:
    """What the reader needs to run it again and to judge the figures: command, date, machine, versions."""
    machine, load = result.machine, result.machine["load_average"]  # both checked by ``load``
    versions = ", ".join(f"{name} {version}" for name, version in result.versions.items() if version is not None)
    return [f"Command: `{result.command}`", "",
            f"Ran {result.date} on {machine['cores']} cores ({machine['platform']}), load average {load[0]:.2f} / "
            f"{load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min); {versions}."]


# -- eviction tables ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: rows are told apart by identity (``gaps``' keys)
class Replayed:
    """One row of `evocache bench eviction --json`, with what groups it (utilisation, output lengths)."""

    policy: str
    size: float
    hit_ratio: float
    utilisation: float | None = None
    output_lengths: bool = False


def replayed(result: Result, *, queued: bool = False) -> list[Replayed]:
    rows = []
    for where, row in rows_of(result):
        rows.append(Replayed(field(result, where, row, "policy", str), field(result, where, row, "size"),
                             field(result, where, row, "hit_ratio"),
                             field(result, where, row, "utilisation") if queued else None,
                             field(result, where, row, "output_lengths", bool) if queued else False))
    return rows


def sizes_of(rows: Sequence[Replayed]) -> list[float]:
    return list(dict.fromkeys(r.size for r in rows))


def gaps(result: Result, rows: Sequence[Replayed]) -> dict[Replayed, float | None]:
    """Each row's share of LRU's distance to Belady at its size (and queue): None for LRU, Belady, or no gap."""
    groups: dict[tuple, list[Replayed]] = {}
    for r in rows:
        groups.setdefault((r.size, r.utilisation, r.output_lengths), []).append(r)
    shares: dict[Replayed, float | None] = {}
    for key, group in groups.items():
        lru = [r for r in group if r.policy == "lru"]
        best = [r for r in group if r.policy.startswith("belady")]
        if len(lru) != 1 or len(best) != 1:
            raise ResultError(f"{result.path}: at size {key[0]:g} expected one 'lru' row and one 'belady' row, "
                              f"got {len(lru)} and {len(best)}")
        width = best[0].hit_ratio - lru[0].hit_ratio
        for r in group:
            special = r.policy == "lru" or r is best[0] or width == 0
            shares[r] = None if special else (r.hit_ratio - lru[0].hit_ratio) / width
    return shares


def cell(row: Replayed, gap: float | None) -> str:
    return f"{row.hit_ratio:.3f}" if gap is None else f"{row.hit_ratio:.3f} ({percent(gap)})"


def policy_table(sources: Sequence[tuple[Result, str]]) -> list[str]:
    """One table of hit ratios (gap closed) by policy and size; ``sources``: results and a label suffix for
    their rows. Later sources add their rows but LRU's and Belady's, which are the first's baseline and bound."""
    first, _ = sources[0]
    sizes = sizes_of(replayed(first))
    body: list[list[str]] = []
    for n, (result, suffix) in enumerate(sources):
        rows = replayed(result)
        shares = gaps(result, rows)
        if sizes_of(rows) != sizes:
            raise ResultError(f"{result.path}: sizes {sizes_of(rows)} differ from {first.path.name}'s {sizes}")
        for policy in dict.fromkeys(r.policy for r in rows):
            if n > 0 and (policy == "lru" or policy.startswith("belady")):
                continue
            label = policy + suffix
            by_size = {r.size: r for r in rows if r.policy == policy}
            body.append([label, *(cell(by_size[s], shares[by_size[s]]) if s in by_size else "" for s in sizes)])
    # Belady, the bound, last.
    body.sort(key=lambda cells: cells[0].startswith("belady"))
    return table(["policy", *(size_label(s) for s in sizes)], body)


def context_field(result: Result, name: str, kind: type | tuple[type, ...] = _NUMBER) -> Any:
    return field(result, "context", result.context, name, kind)


def eviction_mooncake(results: Mapping[str, Result]) -> list[str]:
    main, told = results["eviction-mooncake"], results["eviction-mooncake-output-lengths"]
    lines = [f"Hit ratio per block access on {context_field(main, 'trace', str)} "
             f"({context_field(main, 'requests', int):,} accesses to {context_field(main, 'objects', int):,} "
             f"distinct blocks, capacity in {context_field(main, 'unit', str)}) at a share of its blocks, and in "
             "brackets the share of the LRU → Belady gap closed. `lcs:` rows are libCacheSim's algorithms with "
             "their default parameters, fed the same accesses and counted by the same code; LeCaR and Cacheus "
             "draw from a generator libCacheSim's Python binding cannot seed, so their rows move between runs. "
             "The `--output-lengths` row is the learned policy told each request's output length when the "
             "request completes.", ""]
    lines += policy_table([(main, ""), (told, ", `--output-lengths`")])
    return [*lines, "", *provenance(main), "", *provenance(told)]


def eviction_lookahead(results: Mapping[str, Result]) -> list[str]:
    result = results["eviction-lookahead"]
    rows = replayed(result, queued=True)
    shares = gaps(result, rows)
    sizes = sizes_of(rows)
    queues = context_field(result, "queues", list)
    waiting = {field(result, "context.queues", q, "utilisation"): field(result, "context.queues", q, "mean_waiting")
               for q in queues}
    body = []
    for utilisation in dict.fromkeys(r.utilisation for r in rows):
        if utilisation not in waiting:
            raise ResultError(f"{result.path}: context.queues has no queue at utilisation {utilisation:g}")
        first = True
        for told in (False, True):
            group = [r for r in rows if r.utilisation == utilisation and r.output_lengths == told]
            for policy in dict.fromkeys(r.policy for r in group):
                if policy == "lru" or policy.startswith("belady") or (told and policy == "lookahead"):
                    continue
                by_size = {r.size: r for r in group if r.policy == policy}
                label = f"{policy}, U = {utilisation:g}" + (", `--output-lengths`" if told else "")
                body.append([label, f"{waiting[utilisation]:.1f}" if first else "",
                             *(cell(by_size[s], shares[by_size[s]]) if s in by_size else "" for s in sizes)])
                first = False
    lines = ["The replay serves the Mooncake trace's requests from one FIFO queue at utilisation U (arrival rate × "
             "mean service time), and tells `lookahead` policies the requests waiting at each service start: a "
             "signal a serving system has, so these rows are reported apart from the online policies. "
             "`lookahead` keeps the waiting requests' blocks over LRU, `lookahead:learned` over the learned "
             "policy. \"Waiting\" is the mean number of requests waiting at a service start. In brackets the "
             "share of the LRU → Belady gap closed (LRU and Belady do not read the queue: their rows are those "
             "of the table above).", ""]
    lines += table(["policy", "waiting", *(size_label(s) for s in sizes)], body)
    commands = context_field(result, "commands", list)
    lines += ["", "The `evocache` commands it ran:", "", *(f"    {c}" for c in commands)]
    return [*lines, "", *provenance(result)]


def eviction_cloudphysics(results: Mapping[str, Result]) -> list[str]:
    result = results["eviction-cloudphysics"]
    lines = [f"Hit ratio per access on {context_field(result, 'trace', str)} ({context_field(result, 'requests', int):,} "
             f"accesses, capacity in {context_field(result, 'unit', str)}). With sizes, Belady is a heuristic "
             "(`belady-size`), not a bound; in brackets the share of the gap from LRU to it.", ""]
    return [*lines, *policy_table([(result, "")]), "", *provenance(result)]


def eviction_throughput(results: Mapping[str, Result]) -> list[str]:
    result = results["eviction-throughput"]
    where, row = next(iter(rows_of(result)))
    accesses = field(result, where, row, "accesses", int)
    lines = [f"LRU replayed over {context_field(result, 'trace', str)} ({accesses:,} accesses, "
             f"{field(result, where, row, 'capacity_objects', int):,} objects), median of "
             f"{field(result, where, row, 'rounds', int)} interleaved rounds, against a plain `OrderedDict` LRU "
             "loop over the same accesses in the same process (both must hit alike).", ""]
    lines += table(["replay, M accesses/min", "plain loop, M accesses/min", "replay time / loop time"], [[
        f"{field(result, where, row, 'replay_per_min') / 1e6:.1f}",
        f"{field(result, where, row, 'baseline_per_min') / 1e6:.1f}", f"{field(result, where, row, 'ratio'):.1f}"]])
    return [*lines, "", *provenance(result)]


def eviction_cost(results: Mapping[str, Result]) -> list[str]:
    result = results["eviction-cost"]
    body = []
    for where, row in rows_of(result):
        body.append([field(result, where, row, "policy", str), f"{field(result, where, row, 'policy_us'):.2f}",
                     f"{field(result, where, row, 'policy_ratio'):.2f}", f"{field(result, where, row, 'cpu_us'):.2f}",
                     f"{field(result, where, row, 'cpu_ratio'):.2f}", f"{field(result, where, row, 'hit_ratio'):.3f}"])
    lines = [f"Each policy driven by the real L1 `MemoryTier` over {context_field(result, 'trace', str)} on the "
             "request path's calls (`peek`, then `get_many`, then `set_many` on a miss) at 5 % of its objects. "
             "\"In policy\" is the time inside the policy's methods (less "
             f"{context_field(result, 'timer_ns_subtracted'):.0f} ns a call, the timer's own cost); \"CPU\" is the "
             "process CPU time of the whole pass per request, every thread (a background trainer) included. The "
             "L1 tier gives no request context, so the hit ratios here are not the replay's.", ""]
    lines += table(["policy", "in policy, µs/request", "× LRU", "CPU, µs/request", "× LRU", "hit ratio"], body)
    return [*lines, "", *provenance(result)]


# -- semantic tables ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamRun:
    stream: str
    order: str
    seed: int
    delta: float
    hit_rate: float
    error_rate: float
    exploration_calls: int
    judge_calls: int
    static_threshold: float | None
    static_hit_rate: float
    static_error_rate: float
    ratio: float | None


def stream_runs(result: Result) -> list[StreamRun]:
    runs = []
    for where, row in rows_of(result):
        evo = field(result, where, row, "evocache", dict)
        static = field(result, where, row, "best_static", dict)
        runs.append(StreamRun(
            field(result, where, row, "stream", str), field(result, where, row, "order", str),
            field(result, where, row, "seed", int), field(result, where, row, "delta"),
            field(result, f"{where}.evocache", evo, "hit_rate"), field(result, f"{where}.evocache", evo, "error_rate"),
            field(result, f"{where}.evocache", evo, "exploration_calls", int),
            field(result, f"{where}.evocache", evo, "judge_calls", int),
            field(result, f"{where}.best_static", static, "threshold", optional=True),
            field(result, f"{where}.best_static", static, "hit_rate"),
            field(result, f"{where}.best_static", static, "error_rate"),
            field(result, where, row, "ratio", optional=True)))
    return runs


TARGET_RATIO = 1.25  # bench/semantic.py's: hit rate against the best static threshold in hindsight


def semantic_streams(results: Mapping[str, Result]) -> list[str]:
    result = results["semantic-streams"]
    runs = stream_runs(result)
    summary = []
    for stream, delta in dict.fromkeys((r.stream, r.delta) for r in runs):
        group = [r for r in runs if r.stream == stream and r.delta == delta]
        as_is = next((r for r in group if r.order == "as-is"), group[0])
        ratios = [r.ratio for r in group if r.ratio is not None]
        summary.append([
            stream, f"{delta:g}", str(len(group)), span([r.hit_rate for r in group], ".3f"),
            span([r.error_rate for r in group], ".4f"),
            f"{as_is.static_hit_rate:.3f} / {as_is.static_error_rate:.4f}",
            span(ratios, ".2f") if ratios else "n/a",
            f"{sum(r.ratio is not None and r.ratio >= TARGET_RATIO for r in group)} of {len(group)}",
            f"{sum(r.error_rate <= r.delta for r in group)} of {len(group)}",
        ])
    classify = "on" if context_field(result, "classify", bool) else "off (`--no-classify`)"
    lines = ["Each stream is replayed in order through a fresh cache bounded by δ, storing on a miss; answers "
             "reach the cache only through the judge. Hit rate = served hits / queries, error = wrong served hits "
             "/ queries, an exploration counts as a miss. \"Static\" is the best fixed cosine threshold meeting "
             "the same δ on the same stream, chosen in hindsight (each order has its own); the ratio is evocache's "
             f"hit rate over it. Answer classifier {classify}.", ""]
    lines += table(["stream", "δ", "runs", "evocache hit rate", "evocache error", "static hit / error (as-is order)",
                    "ratio", f"runs ≥ {TARGET_RATIO:g}×", "error ≤ δ"], summary)
    lines += ["", "Every run:", ""]
    lines += table(["stream", "order", "seed", "δ", "hit rate", "error", "exploration calls", "judge calls",
                    "static threshold", "static hit", "static error", "ratio"],
                   [[r.stream, r.order, str(r.seed), f"{r.delta:g}", f"{r.hit_rate:.3f}", f"{r.error_rate:.4f}",
                     str(r.exploration_calls), str(r.judge_calls),
                     "none" if r.static_threshold is None else f"{r.static_threshold:g}", f"{r.static_hit_rate:.3f}",
                     f"{r.static_error_rate:.4f}", "n/a" if r.ratio is None else f"{r.ratio:.2f}"] for r in runs])
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class Category:
    pairs: int
    hits: int
    traps_served: int
    trap: bool  # a trap category (b's answer differs from a's), not a paraphrase or near-repeat


@dataclass(frozen=True, slots=True)
class PairRun:
    seed: int
    run: str  # cold, warm, static
    threshold: float | None
    error_rate: float | None
    categories: dict[str, Category]


def pair_runs(result: Result) -> list[PairRun]:
    runs = []
    for where, row in rows_of(result):
        run = field(result, where, row, "run", str)
        if run not in ("cold", "warm", "static"):
            raise ResultError(f"{result.path}: {where}: field 'run' must be cold, warm or static, got {run!r}")
        cats = {}
        for name, c in field(result, where, row, "categories", dict).items():
            at = f"{where}.categories.{name}"
            cats[name] = Category(field(result, at, c, "pairs", int), field(result, at, c, "hits", int),
                                  field(result, at, c, "traps_served", int),
                                  field(result, at, c, "trap_rate", optional=True) is not None)
        runs.append(PairRun(field(result, where, row, "seed", int), run,
                            field(result, where, row, "threshold") if run == "static" else None,
                            None if run == "static" else field(result, where, row, "error_rate"), cats))
    return runs


def semantic_pairs(results: Mapping[str, Result]) -> list[str]:
    result = results["semantic-pairs"]
    runs = pair_runs(result)
    first = runs[0].seed
    at_first = {(r.run, r.threshold): r for r in runs if r.seed == first}
    if ("cold", None) not in at_first or ("warm", None) not in at_first:
        raise ResultError(f"{result.path}: no cold and warm run at pair seed {first}")
    warm, cold = at_first[("warm", None)], at_first[("cold", None)]
    statics = [r for r in runs if r.run == "static"]
    body = []
    for name, c in warm.categories.items():
        cells = [name, str(c.pairs)]
        for run in (warm, cold, *statics):
            if name not in run.categories:
                raise ResultError(f"{result.path}: pair seed {run.seed} {run.run}: no category {name!r}")
            cells.append(f"{run.categories[name].hits} / {run.categories[name].traps_served}")
        body.append(cells)
    delta = context_field(result, "delta")
    lines = [f"The fow pairs at δ = {delta:g}: each pair's `a` is stored, then its `b` looked up, in one scope. "
             "\"Cold\": the pairs alone; \"warm\": after the error model learnt the Banking77 stream in a scope of "
             "its own, so the pairs are a new tenant. Cells are b served / traps served (a wrong answer served for "
             f"a trap's b), of the pairs in the category, at pair seed {first}; static rows serve the nearest "
             "entry at a fixed cosine threshold.", ""]
    lines += table(["category", "pairs", "evocache warm", "evocache cold",
                    *(f"static {r.threshold:g}" for r in statics)], body)
    traps = [name for name, c in warm.categories.items() if c.trap]
    lines += ["", f"Traps served per pair seed ({' / '.join(traps)}) and the pairs' scope's error per lookup:", ""]
    per_seed = []
    for seed in dict.fromkeys(r.seed for r in runs if r.run != "static"):
        cells = [str(seed)]
        for kind in ("cold", "warm"):
            run = next((r for r in runs if r.seed == seed and r.run == kind), None)
            if run is None:
                raise ResultError(f"{result.path}: pair seed {seed} has no {kind} run")
            assert run.error_rate is not None
            cells += [" / ".join(str(run.categories[name].traps_served) for name in traps), f"{run.error_rate:.4f}"]
        per_seed.append(cells)
    lines += table(["pair seed", "cold traps", "cold error", "warm traps", "warm error"], per_seed)
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class GeneralisationRun:
    run: str  # prefix, cross, pairs
    stream: str
    order: str
    n: int
    learnt_on: str | None
    delta: float
    hit_rate: float
    error_rate: float
    judge_per_query: float
    delta_spent: float
    static_threshold: float | None
    static_hit_rate: float
    static_error_rate: float
    ratio: float | None
    transferred: tuple[float | None, float, float] | None  # threshold, hit rate, error rate
    explored: int  # would-be hits explored (not served) in the run
    calibration: float  # the shared calibration at the run's end
    calibration_bounded: bool  # whether that is the confidence sequence's bound, not the prior's cap


GENERALISATION_RUNS = ("prefix", "cross", "pairs")


def generalisation_runs(result: Result) -> list[GeneralisationRun]:
    runs = []
    for where, row in rows_of(result):
        run = field(result, where, row, "run", str)
        if run not in GENERALISATION_RUNS:
            raise ResultError(f"{result.path}: {where}: field 'run' must be prefix, cross or pairs, got {run!r}")
        evo = field(result, where, row, "evocache", dict)
        static = field(result, where, row, "best_static", dict)
        moved = field(result, where, row, "transferred_static", dict, optional=True)
        learnt_on = field(result, where, row, "learnt_on", str, optional=True)
        if (moved is None) != (learnt_on is None):
            raise ResultError(f"{result.path}: {where}: a run learnt on another stream has a transferred static "
                              "threshold, and only such a run")
        at = f"{where}.transferred_static"
        runs.append(GeneralisationRun(
            run, field(result, where, row, "stream", str), field(result, where, row, "order", str),
            field(result, where, row, "n", int), learnt_on, field(result, where, row, "delta"),
            field(result, f"{where}.evocache", evo, "hit_rate"), field(result, f"{where}.evocache", evo, "error_rate"),
            field(result, where, row, "judge_per_query"), field(result, where, row, "delta_spent"),
            field(result, f"{where}.best_static", static, "threshold", optional=True),
            field(result, f"{where}.best_static", static, "hit_rate"),
            field(result, f"{where}.best_static", static, "error_rate"),
            field(result, where, row, "ratio", optional=True),
            None if moved is None else (field(result, at, moved, "threshold", optional=True),
                                        field(result, at, moved, "hit_rate"), field(result, at, moved, "error_rate")),
            field(result, f"{where}.evocache", evo, "exploration_calls", int),
            field(result, f"{where}.evocache", evo, "calibration"),
            field(result, f"{where}.evocache", evo, "calibration_bounded", bool)))
    return runs


def threshold_cell(threshold: float | None) -> str:
    return "none" if threshold is None else f"{threshold:g}"


def semantic_generalisation(results: Mapping[str, Result]) -> list[str]:
    result = results["semantic-generalisation"]
    runs = generalisation_runs(result)
    budget = context_field(result, "judge_budget")
    summary = []
    for key in dict.fromkeys((r.run, r.stream, r.n, r.learnt_on, r.delta) for r in runs):
        group = [r for r in runs if (r.run, r.stream, r.n, r.learnt_on, r.delta) == key]
        ratios = [r.ratio for r in group if r.ratio is not None]
        moved = [r.transferred for r in group if r.transferred is not None]
        summary.append([
            key[0], key[1], str(key[2]), key[3] or "nothing", f"{key[4]:g}", str(len(group)),
            span([r.hit_rate for r in group], ".3f"), span([r.static_hit_rate for r in group], ".3f"),
            span(ratios, ".2f") if ratios else "n/a", span([r.error_rate for r in group], ".4f"),
            span([r.delta_spent for r in group], ".2f"), span([r.judge_per_query for r in group], ".2f"),
            f"{span([m[1] for m in moved], '.3f')} / {span([m[2] for m in moved], '.4f')}" if moved else "",
            f"{sum(r.ratio is not None and r.ratio >= TARGET_RATIO for r in group)} of {len(group)}",
            f"{sum(r.error_rate <= r.delta for r in group)} of {len(group)}",
            f"{sum(r.judge_per_query <= budget for r in group)} of {len(group)}",
        ])
    classify = "on" if context_field(result, "classify", bool) else "off (`--no-classify`)"
    warmup = field(result, "context", result.context, "warmup", int, optional=True)
    learnt = "all of it" if warmup is None else f"its first {warmup:,} queries"
    lines = ["How the cache does on traffic it was not tuned on. \"Prefix\": the first queries of a stream, in "
             "orders shuffled by seeds 100, 101, ..., through a cache that starts knowing nothing. \"Cross\": the "
             f"same prefixes after the cache learnt the other stream ({learnt}, as-is order) in a scope of its own, "
             "so the prefix is a new tenant of a model fitted elsewhere. \"Pairs\": the fow pairs as one stream "
             "(each pair's a, then its b), in several pair orders, alone and after each stream. \"Static\" is the "
             "best fixed cosine threshold meeting δ on the run's own queries, chosen in hindsight; the ratio is "
             "evocache's hit rate over it. \"Transferred\" is the threshold chosen in hindsight on the stream the "
             "run learnt on, replayed on the run's queries (its error is not bounded). δ spent = error / δ; judge "
             "calls per query count every judge call of the run. In the table of every run, \"explored\" is the "
             "share of queries explored (would-be hits checked by the judge, not served) and \"calibration\" the "
             "ratio the error model's estimates were scaled by at the end, marked \"cap\" while it was still the "
             "prior's bound rather than the confidence sequence's (docs/semantic.md, 'Calibration'). Target: ratio "
             f"≥ {TARGET_RATIO:g}×, error ≤ δ, ≤ {budget:g} judge calls per query. Answer classifier {classify}.",
             ""]
    lines += table(["run", "stream", "queries", "learnt on", "δ", "runs", "hit rate", "static hit", "ratio",
                    "error", "δ spent", "judge calls / query", "transferred hit / error",
                    f"ratio ≥ {TARGET_RATIO:g}×", "error ≤ δ", f"judge ≤ {budget:g}"], summary)
    lines += ["", "Every run:", ""]
    lines += table(["run", "stream", "order", "queries", "learnt on", "δ", "hit rate", "error", "δ spent",
                    "judge calls / query", "explored", "calibration", "static threshold", "static hit",
                    "static error", "ratio", "transferred threshold", "transferred hit", "transferred error"],
                   [[r.run, r.stream, r.order, str(r.n), r.learnt_on or "", f"{r.delta:g}", f"{r.hit_rate:.3f}",
                     f"{r.error_rate:.4f}", f"{r.delta_spent:.2f}", f"{r.judge_per_query:.2f}",
                     f"{r.explored / r.n:.3f}", f"{r.calibration:.2f}{'' if r.calibration_bounded else ' cap'}",
                     threshold_cell(r.static_threshold), f"{r.static_hit_rate:.3f}", f"{r.static_error_rate:.4f}",
                     "n/a" if r.ratio is None else f"{r.ratio:.2f}",
                     *(["", "", ""] if r.transferred is None else
                       [threshold_cell(r.transferred[0]), f"{r.transferred[1]:.3f}", f"{r.transferred[2]:.4f}"])]
                    for r in runs])
    return [*lines, "", *provenance(result)]


# -- overhead ----------------------------------------------------------------------------------------------

OVERHEAD = {
    "l1_hit_vs_cachetools": "L1 hit through `@cache_if` against a `cachetools.cached` hit",
    "l2_hit_vs_redis_get": "L2 hit (Redis only) against a raw redis-py GET of the same payload",
    "miss_path_vs_bare_1ms": "miss path against calling the same 1 ms function bare",
}


def overhead_rows(result: Result) -> dict[str, tuple[float, float, float, float]]:
    rows = {}
    for where, row in rows_of(result):
        name = field(result, where, row, "comparison", str)
        if name not in OVERHEAD:
            raise ResultError(f"{result.path}: {where}: unknown comparison {name!r}; known: {', '.join(OVERHEAD)}")
        rows[name] = (field(result, where, row, "candidate_us"), field(result, where, row, "baseline_us"),
                      field(result, where, row, "ratio"), field(result, where, row, "target"))
    missing = [name for name in OVERHEAD if name not in rows]
    if missing:
        raise ResultError(f"{result.path}: no row for {', '.join(missing)}")
    return rows


def overhead(results: Mapping[str, Result]) -> list[str]:
    result = results["overhead"]
    body = [[OVERHEAD[name], f"{c:.2f}", f"{b:.2f}", f"{r:.3f}", f"≤ {t:g}", "met" if r <= t else "not met"]
            for name, (c, b, r, t) in overhead_rows(result).items()]
    lines = ["Per-call cost of evocache's paths against the plain alternative, the two sides run back to back in "
             f"one process; each ratio is the median of {context_field(result, 'rounds', int)} interleaved rounds "
             "(the miss path: a third of them, at least 5). Events go to the in-memory ring, Prometheus metrics "
             "are on.", ""]
    lines += table(["comparison", "evocache, µs", "baseline, µs", "ratio", "target", ""], body)
    return [*lines, "", *provenance(result)]


# -- serving -----------------------------------------------------------------------------------------------

SERVING_HIT = {
    "hit_handle": "handle: the model deployment's `complete`",
    "hit_http": "HTTP: `/v1/completions` through the ingress",
    "hit_http_two_hops": "HTTP: `/v1/completions` through the ingress",
}


@dataclass(frozen=True, slots=True)
class Compared:
    """One row of bench/serving.py's parts a and b: p50 and p99 of both sides, in ms, and the target."""

    name: str
    baseline: str
    samples: int
    ours: tuple[float, float]
    theirs: tuple[float, float]
    ratio_p50: float
    ratio_p99: float
    target: float | None  # None: a baseline shown for scale (``untargeted``)


def compared_rows(result: Result, known: Sequence[str], untargeted: Sequence[str] = ()) -> dict[str, Compared]:
    """The comparison rows named ``known``; those named in ``untargeted`` may have no target."""
    rows = {}
    for where, row in rows_of(result):
        name = field(result, where, row, "comparison", str)
        if name not in known:
            raise ResultError(f"{result.path}: {where}: unknown comparison {name!r}; known: {', '.join(known)}")
        rows[name] = Compared(
            name, field(result, where, row, "baseline", str), field(result, where, row, "samples", int),
            (field(result, where, row, "evocache_p50_ms"), field(result, where, row, "evocache_p99_ms")),
            (field(result, where, row, "baseline_p50_ms"), field(result, where, row, "baseline_p99_ms")),
            field(result, where, row, "ratio_p50"), field(result, where, row, "ratio_p99"),
            field(result, where, row, "target_p50_ratio", optional=name in untargeted))
    missing = [name for name in known if name not in rows]
    if missing:
        raise ResultError(f"{result.path}: no row for {', '.join(missing)}")
    return rows


def ms_pair(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.2f} / {pair[1]:.2f}"


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def serving_hit(results: Mapping[str, Result]) -> list[str]:
    result = results["serving-hit"]
    rows = compared_rows(result, list(SERVING_HIT))
    body = [[SERVING_HIT[name], c.baseline, str(c.samples), ms_pair(c.ours), ms_pair(c.theirs), f"{c.ratio_p50:.2f}",
             f"{c.ratio_p99:.2f}", f"≤ {c.target:g}", met(c.ratio_p50 <= c.target)] for name, c in rows.items()]
    lines = ["An exact hit (L1) through a local Ray Serve, against bare Ray Serve deployments returning the same "
             f"payload (the hit's own `Completion`, or its {context_field(result, 'body_bytes', int)}-byte JSON body "
             "and `x-evocache-*` headers), one model replica. Each side is called one request at a time from the "
             f"driver, {context_field(result, 'rounds', int)} interleaved rounds of "
             f"{context_field(result, 'per_round', int)} calls (the side going first rotates); latencies are the "
             "client's, in ms. evocache's HTTP path is two deployments (the ingress authenticates, parses, "
             "tokenises and hashes the prompt's blocks, then calls the model deployment through a handle, where "
             "the prefix-affinity router runs); the second echo row has the same two hops.", ""]
    lines += table(["evocache", "baseline", "calls", "evocache p50 / p99", "baseline p50 / p99", "p50 ratio",
                    "p99 ratio", "target (p50)", ""], body)
    return [*lines, "", *provenance(result)]


def serving_miss(results: Mapping[str, Result]) -> list[str]:
    result = results["serving-miss"]
    c = compared_rows(result, ["miss_handle"])["miss_handle"]
    model_ms = context_field(result, "model_ms")
    lines = [f"Every request new (a unique prompt), through the model deployment over a handle, against a bare "
             f"deployment calling the same {model_ms:g} ms model and wrapping its answer in the same dataclasses; "
             f"{context_field(result, 'rounds', int)} interleaved rounds of {context_field(result, 'per_round', int)} "
             "calls per side, one at a time, in ms. The overhead is the p50 ratio less one.", ""]
    lines += table(["evocache", "baseline", "calls", "evocache p50 / p99", "baseline p50 / p99", "p50 overhead",
                    "p99 overhead", "target (p50)", ""],
                   [["miss path, handle", c.baseline, str(c.samples), ms_pair(c.ours), ms_pair(c.theirs),
                     f"{(c.ratio_p50 - 1) * 100:+.1f} %", f"{(c.ratio_p99 - 1) * 100:+.1f} %",
                     f"≤ {(c.target - 1) * 100:+g} %", met(c.ratio_p50 <= c.target)]])
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class RouterRow:
    router: str
    requests: int
    errors: int
    could_hit: int
    l1_hits: int
    l1_hit_ratio: float | None
    share: float
    p50: float
    p99: float
    spread: tuple[float, float, float]  # p50, p99, max
    over_threshold: float
    per_replica: list[int]


def router_rows(result: Result) -> dict[str, RouterRow]:
    rows = {}
    for where, row in rows_of(result):
        router = field(result, where, row, "router", str)
        if router not in ("affinity", "default"):
            raise ResultError(f"{result.path}: {where}: field 'router' must be affinity or default, got {router!r}")
        per_replica = field(result, where, row, "per_replica", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in per_replica):
            raise ResultError(f"{result.path}: {where}: field 'per_replica' must be a list of integers")
        rows[router] = RouterRow(
            router, field(result, where, row, "requests", int), field(result, where, row, "errors", int),
            field(result, where, row, "could_hit", int), field(result, where, row, "l1_hits", int),
            field(result, where, row, "l1_hit_ratio", optional=True), field(result, where, row, "affinity_share"),
            field(result, where, row, "p50_ms"), field(result, where, row, "p99_ms"),
            (field(result, where, row, "spread_p50"), field(result, where, row, "spread_p99"),
             field(result, where, row, "spread_max")),
            field(result, where, row, "over_threshold_share"), per_replica)
    for router in ("affinity", "default"):
        if router not in rows:
            raise ResultError(f"{result.path}: no row for router {router!r}")
    return rows


def serving_affinity(results: Mapping[str, Result]) -> list[str]:
    result = results["serving-affinity"]
    rows = router_rows(result)
    threshold = context_field(result, "imbalance_threshold", int)
    target = context_field(result, "target_share_ratio")
    body = [[{"affinity": "prefix affinity", "default": "Ray's default (power of two choices)"}[r.router],
             str(r.requests), str(r.errors),
             f"{r.l1_hits} / {r.could_hit}" + (f" ({percent(r.l1_hit_ratio)})" if r.l1_hit_ratio is not None else ""),
             f"{r.share:.3f}", f"{r.p50:.1f} / {r.p99:.1f}", f"{r.spread[0]:g} / {r.spread[1]:g} / {r.spread[2]:g}",
             percent(r.over_threshold), " / ".join(map(str, r.per_replica))] for r in rows.values()]
    ratio = rows["affinity"].share / rows["default"].share if rows["default"].share else None
    spread_p99 = rows["affinity"].spread[1]
    sent, total = context_field(result, "requests", int), context_field(result, "trace_requests", int)
    lines = [f"{'All' if sent == total else f'The first {sent:,} of'} the {total:,} requests of "
             f"{context_field(result, 'trace', str)} in order, each hash id a block of "
             f"{context_field(result, 'block_size', int)} characters (so requests sharing leading hash ids share "
             f"leading blocks), sent over HTTP by {context_field(result, 'clients', int)} clients to "
             f"{context_field(result, 'replicas', int)} model replicas of a {context_field(result, 'model_ms'):g} ms "
             "model; the two routers' applications run side by side and take the trace in alternating chunks of "
             f"{context_field(result, 'chunk', int)}. L1 hits / could hit: hits answered from the replica's own "
             "memory, of the requests identical to an earlier request of the trace (no Redis: a repeat sent to "
             "another replica misses, and so does one sent while its twin is still being answered). Affinity share: of each request's blocks that an earlier request carried, "
             "the share last answered by the replica this request went to (`x-evocache-replica`). Queue spread: at "
             "each request's send time, the most minus the fewest requests in flight per replica as the client "
             "saw them (sent and not yet answered, counted on the replica that answered), so it includes time in "
             f"the ingress; the router's imbalance threshold is {threshold}. Latencies in ms.", ""]
    lines += table(["router", "requests", "errors", "L1 hits / could hit", "affinity share", "p50 / p99",
                    "queue spread p50 / p99 / max", f"sends with spread > {threshold}", "requests per replica"], body)
    lines += ["", *table(["target", "measured", ""], [
        [f"affinity share ≥ {target:g}× the default router's", "n/a" if ratio is None else f"{ratio:.2f}×",
         "n/a" if ratio is None else met(ratio >= target)],
        [f"queue spread within the imbalance threshold ({threshold})", f"p99 {spread_p99:g}, max "
         f"{rows['affinity'].spread[2]:g}", met(spread_p99 <= threshold)],
    ])]
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class LoadRow:
    duration_s: float
    clients: int
    requests: int
    errors: int
    throughput: float
    p50: float
    p99: float
    hits: int
    rss: list[tuple[float, float, float, float]]  # start, after the warm-up, end (MiB), growth
    growth_max: float


def load_row(result: Result) -> LoadRow:
    where, row = next(iter(rows_of(result)))
    outcomes = field(result, where, row, "outcomes", dict)
    rss = []
    for i, r in enumerate(field(result, where, row, "rss", list)):
        at = f"{where}.rss[{i}]"
        rss.append((field(result, at, r, "start_mb"), field(result, at, r, "warm_mb"), field(result, at, r, "end_mb"),
                    field(result, at, r, "growth")))
    if not rss:
        raise ResultError(f"{result.path}: {where}: field 'rss' is empty")
    return LoadRow(field(result, where, row, "duration_s"), field(result, where, row, "clients", int),
                   field(result, where, row, "requests", int), field(result, where, row, "errors", int),
                   field(result, where, row, "throughput_rps"), field(result, where, row, "p50_ms"),
                   field(result, where, row, "p99_ms"), field(result, f"{where}.outcomes", outcomes, "hit", int),
                   rss, field(result, where, row, "rss_growth_max"))


def serving_load(results: Mapping[str, Result]) -> list[str]:
    result = results["serving-load"]
    r = load_row(result)
    warm = context_field(result, "warm_up_s")
    target = context_field(result, "target_rss_growth")
    lines = [f"{r.clients} clients over HTTP for {r.duration_s:.0f} s on 127.0.0.1, each sending its next request "
             f"when the last is answered: {percent(1 - context_field(result, 'fresh_share'))} repeats of "
             f"{context_field(result, 'pool', int)} prompts, the rest fresh prompts; "
             f"{context_field(result, 'replicas', int)} model replicas of an instant model behind the ingress. "
             "Resident set (`VmRSS`) of each model replica's process (`ray::ServeReplica:<app>:model`), at the "
             f"start, after {warm:g} s and at the end; growth is from {warm:g} s to the end. Latencies in ms.", ""]
    lines += table(["requests", "errors", "hits", "throughput", "p50 / p99", "replica RSS, MiB (start → "
                    f"{warm:g} s → end)", "RSS growth", "target", ""],
                   [[f"{r.requests:,}", str(r.errors), f"{r.hits:,}", f"{r.throughput:.0f} req/s",
                     f"{r.p50:.1f} / {r.p99:.1f}", "; ".join(f"{a:.0f} → {b:.0f} → {c:.0f}" for a, b, c, _ in r.rss),
                     " / ".join(f"{g * 100:+.1f} %" for *_, g in r.rss),
                     f"0 errors, growth < {target * 100:g} %", met(r.errors == 0 and r.growth_max < target)]])
    return [*lines, "", *provenance(result)]


# -- the gateway in front of vLLM --------------------------------------------------------------------------


def gateway_setup(result: Result) -> str:
    """What the gateway sections measure, from the first one's context: the two servers' commands."""
    return (f"`{context_field(result, 'serve_command', str)}` in front of vLLM's OpenAI server (`"
            f"{context_field(result, 'vllm_command', str)}`) on a {context_field(result, 'model', str)}, both on "
            f"this machine beside the benchmark's clients, started once for all four sections; every request a "
            f"{context_field(result, 'max_tokens', int)}-token greedy completion.")


GATEWAY_AS_ABOVE = "The servers of [the exact hit](#gateway-an-exact-hit-in-front-of-vllm), in the same run."


def _ratio(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3f}"


def gateway_hit(results: Mapping[str, Result]) -> list[str]:
    result = results["gateway-hit"]
    rows = compared_rows(result, ["hit_vs_echo", "hit_vs_vllm"], untargeted=["hit_vs_vllm"])
    per_round = context_field(result, "per_round", dict)
    rounds = context_field(result, "rounds", int)
    calls = {side: field(result, "context.per_round", per_round, side, int) * rounds
             for side in ("evocache", "echo", "vllm")}
    body = []
    for name, side in (("hit_vs_echo", "echo"), ("hit_vs_vllm", "vllm")):
        c = rows[name]
        body.append([c.baseline, f"{c.samples} / {calls[side]}", ms_pair(c.ours), ms_pair(c.theirs),
                     _ratio(c.ratio_p50), _ratio(c.ratio_p99), "-" if c.target is None else f"≤ {c.target:g}",
                     "" if c.target is None else met(c.ratio_p50 <= c.target)])
    tiers = ", ".join(f"{n} from {tier.upper() or '?'}"
                      for tier, n in context_field(result, "tiers", dict).items())
    lines = [gateway_setup(result), "",
             f"An exact hit (a {context_field(result, 'prompt_tokens', int)}-token prompt, a "
             f"{context_field(result, 'completion_tokens', int)}-token answer, a "
             f"{context_field(result, 'body_bytes', int)}-byte JSON body) through evocache's `/v1/completions`, "
             f"against a bare FastAPI echo server under uvicorn (bench/_gateway_echo.py) answering with the hit's "
             f"own body and `x-evocache-*` headers, and against the same request sent straight to vLLM, which "
             f"computes it. One request at a time over one httpx client with keep-alive, {rounds} interleaved "
             f"rounds of {per_round['evocache']} hits, {per_round['echo']} echo calls and {per_round['vllm']} "
             f"calls to vLLM (the side going first rotates); the hits were answered by the "
             f"{context_field(result, 'answered_by', str)} ({tiers}). Latencies are the client's, in ms. evocache "
             "answers through Ray Serve's HTTP proxy and its ingress replica; [Serving: an exact hit through Ray "
             "Serve](#serving-an-exact-hit-through-ray-serve) measures that path against bare Ray Serve "
             "deployments.", ""]
    lines += table(["baseline", "calls (evocache / baseline)", "evocache hit p50 / p99", "baseline p50 / p99",
                    "p50 ratio", "p99 ratio", "target (p50)", ""], body)
    return [*lines, "", *provenance(result)]


def gateway_miss(results: Mapping[str, Result]) -> list[str]:
    result = results["gateway-miss"]
    c = compared_rows(result, ["miss_vs_vllm"])["miss_vs_vllm"]
    where, row = next(iter(rows_of(result)))

    def tokens(side: str) -> str:
        return " / ".join(" or ".join(str(n) for n in field(result, where, row, f"{side}_{kind}_tokens", list))
                          for kind in ("prompt", "cached", "completion"))

    lines = [GATEWAY_AS_ABOVE, "",
             "Every request a new prompt (the shared preamble, then a ticket name no other request carries), "
             "through evocache (a miss: the replica streams it from vLLM and stores it) against straight to vLLM; "
             f"{context_field(result, 'rounds', int)} interleaved rounds of {context_field(result, 'per_round', int)} "
             "calls per side, one at a time, in ms. The overhead is the p50 ratio less one. Prompt / cached / "
             f"completion tokens per call: {tokens('evocache')} through evocache, {tokens('baseline')} straight "
             "(vLLM's prefix cache holds the preamble's first block for both).", ""]
    lines += table(["baseline", "calls", "evocache p50 / p99", "baseline p50 / p99", "p50 overhead",
                    "p99 overhead", "target (p50)", ""],
                   [[c.baseline, str(c.samples), ms_pair(c.ours), ms_pair(c.theirs),
                     f"{(c.ratio_p50 - 1) * 100:+.1f} %", f"{(c.ratio_p99 - 1) * 100:+.1f} %",
                     f"≤ {(c.target - 1) * 100:+g} %", met(c.ratio_p50 <= c.target)]])
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class GatewayLoad:
    """One row of bench/gateway.py's part c: the load through evocache or straight to vLLM."""

    target: str
    duration_s: float
    clients: int
    requests: int
    errors: int
    hits: int
    throughput: float
    tokens_per_s: float
    p50: float
    p99: float
    hit: tuple[float, float] | None
    miss: tuple[float, float] | None
    vllm_running: tuple[float, float]  # mean, max
    vllm_waiting_max: float


def gateway_loads(result: Result) -> dict[str, GatewayLoad]:
    rows = {}
    for where, row in rows_of(result):
        target = field(result, where, row, "target", str)
        if target not in ("evocache", "vllm"):
            raise ResultError(f"{result.path}: {where}: field 'target' must be evocache or vllm, got {target!r}")
        outcomes = field(result, where, row, "outcomes", dict)

        def pair(name: str) -> tuple[float, float] | None:
            if f"{name}_p50_ms" not in row:  # none of this outcome in the run
                return None
            return field(result, where, row, f"{name}_p50_ms"), field(result, where, row, f"{name}_p99_ms")

        rows[target] = GatewayLoad(
            target, field(result, where, row, "duration_s"), field(result, where, row, "clients", int),
            field(result, where, row, "requests", int), field(result, where, row, "errors", int),
            outcomes.get("hit", 0), field(result, where, row, "throughput_rps"),
            field(result, where, row, "completion_tokens_per_s"), field(result, where, row, "p50_ms"),
            field(result, where, row, "p99_ms"), pair("hit"), pair("miss"),
            (field(result, where, row, "vllm_running_mean"), field(result, where, row, "vllm_running_max")),
            field(result, where, row, "vllm_waiting_max"))
    for target in ("evocache", "vllm"):
        if target not in rows:
            raise ResultError(f"{result.path}: no row for target {target!r}")
    return rows


def _pair_cell(pair: tuple[float, float] | None, fmt: str = ".1f") -> str:
    return "-" if pair is None else f"{pair[0]:{fmt}} / {pair[1]:{fmt}}"


def _p99(pair: tuple[float, float] | None, fmt: str = ".1f") -> str:
    return "-" if pair is None else format(pair[1], fmt)


def gateway_load(results: Mapping[str, Result]) -> list[str]:
    result = results["gateway-load"]
    loads = gateway_loads(result)
    ours = loads["evocache"]
    where, row = next((w, r) for w, r in rows_of(result) if r.get("target") == "evocache")
    rss, probe, lookup = (field(result, where, row, name, dict) for name in ("rss", "probe", "hit_lookup"))
    warm = context_field(result, "warm_up_s")
    vllm_rss = context_field(result, "vllm_rss_mb", dict)
    target_p99 = context_field(result, "target_hit_p99_ms")
    body = [[{"evocache": "through evocache", "vllm": "straight to vLLM"}[r.target], f"{r.duration_s:.0f}",
             f"{r.requests:,}", str(r.errors), f"{r.hits:,}",
             f"{r.throughput:.1f} req/s ({r.tokens_per_s:,.0f} tokens/s)",
             f"{r.p50:.0f} / {r.p99:.0f}", _pair_cell(r.hit), _pair_cell(r.miss, ".0f"),
             f"{r.vllm_running[0]:.1f} / {r.vllm_running[1]:g}", f"{r.vllm_waiting_max:g}"]
            for r in loads.values()]
    lines = [GATEWAY_AS_ABOVE, "",
             f"{ours.clients} clients (aiohttp), each sending its next request when the last is answered: "
             f"{percent(context_field(result, 'repeat_share'))} repeat a prompt already answered in the run, the "
             f"rest are new. The same load runs {context_field(result, 'order', str)}, for "
             f"{context_field(result, 'load_s'):g} s each (a run lasts until its last request is answered), one "
             "after the other rather than interleaved, so the machine's other load may differ between the two. "
             "Straight to vLLM every answer is computed. vLLM's queue: `vllm:num_requests_running` (mean / max) "
             "and `vllm:num_requests_waiting` (max) on its `/metrics`, every second. Latencies in ms.", ""]
    lines += table(["load", "s", "requests", "errors", "hits", "throughput", "p50 / p99", "hits p50 / p99",
                    "misses p50 / p99", "vLLM running", "vLLM waiting"], body)
    lines += ["", f"Where a hit waits under this load: a probe sent one recorded hit to evocache and the same request "
              f"to the bare echo server in turn every {field(result, where, probe, 'interval_s'):g} s "
              f"({field(result, where, probe, 'samples', int)} each), and each hit's own time in the cache is its "
              f"access event's `latency_ms` ({field(result, where, lookup, 'events', int):,} hits).", ""]
    lines += table(["", "p50", "p99"], [
        ["hit through evocache (probe)", f"{field(result, where, probe, 'evocache_p50_ms'):.1f}",
         f"{field(result, where, probe, 'evocache_p99_ms'):.1f}"],
        ["bare echo server (probe)", f"{field(result, where, probe, 'echo_p50_ms'):.1f}",
         f"{field(result, where, probe, 'echo_p99_ms'):.1f}"],
        ["the hit's lookup in the cache (access events)", f"{field(result, where, lookup, 'p50_ms'):.2f}",
         f"{field(result, where, lookup, 'p99_ms'):.2f}"],
    ])
    lines += ["", f"Resident set of the `evocache serve` process tree (the command, its Ray and the replicas, "
              f"{field(result, where, rss, 'processes', int)} processes; shared pages count once per process), "
              f"MiB: {field(result, where, rss, 'start_mb'):,.0f} at the start, "
              f"{field(result, where, rss, 'warm_mb'):,.0f} after {warm:.0f} s, "
              f"{field(result, where, rss, 'end_mb'):,.0f} at the end, {field(result, where, rss, 'peak_mb'):,.0f} at most; vLLM's server for scale: "
              f"{field(result, 'context.vllm_rss_mb', vllm_rss, 'end_mb'):,.0f} MiB.", ""]
    lines += table(["target", "measured", ""], [
        ["no errors through evocache", str(ours.errors), met(ours.errors == 0)],
        [f"hit p99 ≤ {target_p99:g} ms while misses queue", f"{_p99(ours.hit)} ms",
         met(ours.hit is not None and ours.hit[1] <= target_p99)],
    ])
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class Spent:
    """One outcome's row of bench/gateway.py's savings: its usage, what vLLM computed, what it cost or saved."""

    outcome: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    computed_tokens: int
    cost_usd: float
    saved_tokens: int
    saved_usd: float
    saved_usd_prompts_cached: float


def gateway_spent(result: Result) -> dict[str, Spent]:
    rows = {}
    for where, row in rows_of(result):
        outcome = field(result, where, row, "outcome", str)
        rows[outcome] = Spent(outcome, *(field(result, where, row, name, int) for name in (
            "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "computed_tokens")),
            field(result, where, row, "cost_usd"), field(result, where, row, "saved_tokens", int),
            field(result, where, row, "saved_usd"), field(result, where, row, "saved_usd_prompts_cached"))
    if "hit" not in rows:
        raise ResultError(f"{result.path}: no row for outcome 'hit'")
    return rows


def money(usd: float) -> str:
    return f"${usd:.4f}"


def gateway_savings(results: Mapping[str, Result]) -> list[str]:
    result = results["gateway-savings"]
    spent = gateway_spent(result)
    prices = context_field(result, "prices_usd_per_million", dict)
    price = {name: field(result, "context.prices_usd_per_million", prices, name)
             for name in ("input", "cached_input", "output")}
    body = [[s.outcome, f"{s.requests:,}", f"{s.prompt_tokens:,} ({s.cached_tokens:,})", f"{s.completion_tokens:,}",
             f"{s.computed_tokens:,}", money(s.cost_usd), f"{s.saved_tokens:,}",
             f"{money(s.saved_usd_prompts_cached)}-{money(s.saved_usd)}" if s.saved_tokens else "-"]
            for s in spent.values()]
    total_tokens = sum(s.prompt_tokens + s.completion_tokens for s in spent.values())
    saved = sum(s.saved_tokens for s in spent.values())
    cost = sum(s.cost_usd for s in spent.values())
    high = sum(s.saved_usd for s in spent.values())
    low = sum(s.saved_usd_prompts_cached for s in spent.values())
    requests = context_field(result, "requests", int)
    lines = [f"The responses of the load through evocache above ({requests:,} answered in "
             f"{context_field(result, 'duration_s'):.0f} s), by their `usage`: a hit's counts the tokens vLLM did "
             "not compute (its prompt, reported as cached, and its completion); a miss's `cached_tokens` are those "
             "vLLM's own prefix cache supplied. Money at an **illustrative** price table given on the command line "
             f"(`--price-input`, `--price-cached`, `--price-output`): ${price['input']:g} per million input tokens, "
             f"${price['cached_input']:g} per million cached input tokens, ${price['output']:g} per million output "
             f"tokens ({context_field(result, 'prices_note', str)}). A hit's saving is a range: its prompt at the "
             "cached rate (an upstream whose prefix cache still held it) up to the input rate.", ""]
    lines += table(["outcome", "requests", "prompt tokens (cached)", "completion tokens", "computed by vLLM",
                    "cost", "tokens saved", "saved"], body)
    lines += ["", f"Tokens vLLM did not compute: {saved:,} of {total_tokens:,} ({percent(saved / total_tokens)}); "
              f"money saved {money(low)}-{money(high)} against {money(cost)} spent on the misses, "
              f"{money(low / requests * 1000)}-{money(high / requests * 1000)} per 1,000 requests of this mix.", ""]
    return [*lines, *provenance(result)]


# -- the KV prefix cache -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TtftRow:
    """One case of bench/kv.py part a: where the prefix came from, and the median time to the first token."""

    case: str
    tier: str | None
    hit: float
    prefetch: bool
    queued: bool
    samples: int
    ttft_ms: float
    speedup: float
    reused_tokens: int
    load_ms: float
    prefetch_ms: float
    hidden_ms: float
    hidden_fraction: float | None
    spread: tuple[float, float]  # the fastest and the slowest round, ms


def ttft_rows(result: Result) -> dict[str, TtftRow]:
    rows = {}
    for where, row in rows_of(result):
        tier = field(result, where, row, "tier", str, optional=True)
        if tier not in (None, "l1", "l2", "l3"):
            raise ResultError(f"{result.path}: {where}: field 'tier' must be l1, l2, l3 or null, got {tier!r}")
        name = field(result, where, row, "case", str)
        rows[name] = TtftRow(
            name, tier, field(result, where, row, "hit"), field(result, where, row, "prefetch", bool),
            field(result, where, row, "queued", bool), field(result, where, row, "samples", int),
            field(result, where, row, "ttft_ms"), field(result, where, row, "speedup"),
            field(result, where, row, "reused_tokens", int), field(result, where, row, "load_ms"),
            field(result, where, row, "prefetch_ms"), field(result, where, row, "hidden_ms"),
            field(result, where, row, "hidden_fraction", optional=True), samples_spread(result, where, row, "ttft_ms_all"))
    for name in ("cold", "l1-0.9", "l2-0.9-prefetch"):
        if name not in rows:
            raise ResultError(f"{result.path}: no row for case {name!r}")
    return rows


def samples_spread(result: Result, where: str, row: Mapping[str, Any], name: str) -> tuple[float, float]:
    values = field(result, where, row, name, list)
    if not values or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ResultError(f"{result.path}: {where}: field {name!r} must be a non-empty list of numbers")
    return min(values), max(values)


def model_line(result: Result) -> str:
    spec = context_field(result, "model", dict)
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size")
    values = [field(result, "context.model", spec, name, int) for name in names]
    return (f"a Llama of hidden size {values[0]}, {values[1]} layers, {values[2]} heads ({values[3]} KV heads), "
            f"intermediate size {values[4]} and vocabulary {values[5]:,} (`LlamaConfig`, random weights, fp32, "
            "built locally)")


def kv_ttft(results: Mapping[str, Result]) -> list[str]:
    result = results["kv-ttft"]
    rows = ttft_rows(result)
    tokens, bs = context_field(result, "tokens", int), context_field(result, "block_size", int)
    targets = context_field(result, "targets", dict)

    def where(r: TtftRow) -> str:
        if r.tier is None:
            return "cold (no cache)" + (", behind another prefill" if r.queued else "")
        tier = {"l1": "L1 (replica memory)", "l2": "L2 (Redis)", "l3": "L3 (disk)"}[r.tier]
        return tier + (", prefetched behind another prefill" if r.prefetch else "")

    body = [[where(r), "" if r.tier is None else f"{r.hit * 100:g} % ({r.reused_tokens:,} tokens)",
             f"{r.ttft_ms:.1f}", f"{r.spread[0]:.0f}–{r.spread[1]:.0f}", f"{r.speedup:.2f}×", f"{r.load_ms:.1f}" if r.tier in ("l2", "l3") else "",
             f"{r.prefetch_ms:.1f}" if r.prefetch else "",
             "" if r.hidden_fraction is None else percent(r.hidden_fraction)]
            for r in rows.values()]
    l1, l2 = rows["l1-0.9"], rows["l2-0.9-prefetch"]
    l1_target = field(result, "context.targets", targets, "l1_speedup_90")
    l2_target = field(result, "context.targets", targets, "l2_prefetch_speedup_90")
    hidden_target = field(result, "context.targets", targets, "l2_hidden_fraction")
    hidden = l2.hidden_fraction or 0.0
    lines = [f"Time to the first token of a {tokens:,}-token prompt on {model_line(result)}, served by the "
             f"production `HFGenerator` with a `KvPrefixCache` attached (blocks of {bs} tokens, "
             f"{context_field(result, 'block_bytes', int):,} bytes each), {context_field(result, 'threads', int)} "
             f"torch threads on the {context_field(result, 'device', str)}. Cold: no cache attached, "
             f"{context_field(result, 'cold_ms'):.0f} ms. A prefix hit is the first 50 % or 90 % of the prompt "
             "(whole blocks) cached by an earlier prompt, the rest new. L2 and L3 cases start from an empty L1 (a "
             "cold replica sharing the tiers); their time includes loading the blocks on the request path and "
             "writing the new blocks back. Prefetched: the request waits behind another request's cold prefill "
             "(a thread runs it first) while the cache loads its blocks into L1; its time runs from the end of "
             "that prefill to its own first token. Hidden: the share of the tier's load time (prefetch and "
             "request path) spent while the request waited. Medians of "
             f"{context_field(result, 'rounds', int)} interleaved rounds (one warm-up round before), in ms; the "
             "fastest and slowest rounds show how loaded the shared machine was.", ""]
    lines += table(["blocks from", "prefix hit", "TTFT, ms", "fastest–slowest round", "against cold", "load on the path, ms", "prefetch, ms",
                    "hidden"], body)
    lines += ["", *table(["target", "measured", ""], [
        [f"90 % prefix from L1 ≥ {l1_target:g}× faster than cold", f"{l1.speedup:.2f}×", met(l1.speedup >= l1_target)],
        [f"90 % prefix from L2 with prefetch ≥ {l2_target:g}× faster than cold", f"{l2.speedup:.2f}×",
         met(l2.speedup >= l2_target)],
        [f"≥ {percent(hidden_target)} of the L2 load time hidden", percent(hidden), met(hidden >= hidden_target)],
    ])]
    return [*lines, "", *provenance(result)]


def kv_chunks(results: Mapping[str, Result]) -> list[str]:
    result = results["kv-chunks"]
    body = []
    full_ms = None
    for where, row in rows_of(result):
        k = field(result, where, row, "recompute_tokens", int, optional=True)
        ms = field(result, where, row, "prefill_ms")
        if k is None:
            full_ms = ms
            body.append(["full recompute", "0", "", "", "", f"{ms:.0f}", ""])
            continue
        body.append([f"k = {k}", f"{field(result, where, row, 'chunk_tokens', int):,}",
                     f"{field(result, where, row, 'kl'):.3e}", f"{field(result, where, row, 'max_dlogit'):.3e}",
                     f"{field(result, where, row, 'greedy_agreeing', int)} "
                     f"({field(result, where, row, 'greedy_same', int)})", f"{ms:.0f}",
                     percent(field(result, where, row, "saved"))])
    if full_ms is None:
        raise ResultError(f"{result.path}: no full-recompute row (recompute_tokens null)")
    generated = context_field(result, "generated", int)
    lines = [f"Chunk reuse (`kv: {{reuse: chunks}}`, approximate) on {model_line(result)}: a "
             f"{context_field(result, 'chunk', int):,}-token chunk computed after a "
             f"{context_field(result, 'preamble_first', int)}-token preamble, reused after a "
             f"{context_field(result, 'preamble_second', int)}-token one and followed by a "
             f"{context_field(result, 'question', int)}-token question ({context_field(result, 'tokens', int):,} "
             "tokens), its keys moved by RoPE and its first k tokens recomputed over the real context "
             f"(`recompute_fraction` {context_field(result, 'recompute_fraction'):g}). Against a full recompute of "
             f"the same prompt: KL of the next-token distribution, the largest logit difference, the greedy tokens "
             f"(of {generated}) agreeing before the first difference (in brackets: at the same positions), and the "
             f"prefill time (median of {context_field(result, 'rounds', int)} interleaved rounds; saved: one less "
             "the median of each round's ratio to the full recompute's). Random weights: "
             "their next-token distribution is nearly flat, so a small logit change flips the argmax and the "
             "agreement is a floor, not what a trained model shows.", ""]
    lines += table(["recomputed", "chunk tokens reused", "KL(full ‖ reuse)", "largest Δ logit",
                    f"greedy agreeing (of {generated})", "prefill, ms", "prefill saved"], body)
    return [*lines, "", *provenance(result)]


@dataclass(frozen=True, slots=True)
class RoutingRow:
    utilisation: float
    router: str
    policy: str
    hit_ratio: float
    waiting: float | None
    per_replica: list[int]


def routing_rows(result: Result) -> list[RoutingRow]:
    rows = []
    for where, row in rows_of(result):
        router = field(result, where, row, "router", str)
        if router not in ("affinity", "default"):
            raise ResultError(f"{result.path}: {where}: field 'router' must be affinity or default, got {router!r}")
        per_replica = field(result, where, row, "per_replica", list)
        rows.append(RoutingRow(field(result, where, row, "utilisation"), router, field(result, where, row, "policy", str),
                               field(result, where, row, "kv_hit_ratio"),
                               field(result, where, row, "mean_waiting", optional=True), per_replica))
    return rows


def routing_groups(result: Result) -> dict[tuple[float, str], dict[str, RoutingRow]]:
    """(utilisation, router) -> policy -> row; each group needs its LRU and Belady rows."""
    groups: dict[tuple[float, str], dict[str, RoutingRow]] = {}
    for r in routing_rows(result):
        groups.setdefault((r.utilisation, r.router), {})[r.policy] = r
    for (utilisation, router), group in groups.items():
        for policy in ("lru", "belady"):
            if policy not in group:
                raise ResultError(f"{result.path}: at utilisation {utilisation:g} the {router} router has no "
                                  f"{policy!r} row")
    return groups


def gap_share(group: Mapping[str, RoutingRow], policy: str) -> float | None:
    width = group["belady"].hit_ratio - group["lru"].hit_ratio
    return None if width <= 0 or policy not in group else (group[policy].hit_ratio - group["lru"].hit_ratio) / width


ROUTERS = {"affinity": "prefix affinity", "default": "Ray's default (power of two choices)"}


def kv_routing(results: Mapping[str, Result]) -> list[str]:
    result = results["kv-routing"]
    groups = routing_groups(result)
    targets = context_field(result, "targets", dict)
    ratio_target = field(result, "context.targets", targets, "affinity_hit_ratio")
    gap_target = field(result, "context.targets", targets, "queue_aware_gap_share")
    body, checks = [], []
    for (utilisation, router), group in groups.items():
        for policy, r in sorted(group.items(), key=lambda item: item[0] == "belady"):
            share = None if policy in ("lru", "belady") else gap_share(group, policy)
            body.append([f"{utilisation:g}", ROUTERS[router], policy,
                         f"{r.hit_ratio:.3f}" + ("" if share is None else f" ({percent(share)})"),
                         "" if r.waiting is None else f"{r.waiting:.2f}", " / ".join(map(str, r.per_replica))])
    for utilisation in dict.fromkeys(u for u, _ in groups):
        ours, theirs = groups.get((utilisation, "affinity")), groups.get((utilisation, "default"))
        if ours is None or theirs is None:
            raise ResultError(f"{result.path}: at utilisation {utilisation:g} both routers need rows")
        ratio = ours["lru"].hit_ratio / theirs["lru"].hit_ratio if theirs["lru"].hit_ratio else None
        checks.append([f"U = {utilisation:g}: affinity router's KV hit ratio ≥ {ratio_target:g}× the default's (LRU)",
                       "n/a" if ratio is None else f"{ratio:.2f}× ({ours['lru'].hit_ratio:.3f} against "
                       f"{theirs['lru'].hit_ratio:.3f})", "n/a" if ratio is None else met(ratio >= ratio_target)])
        for policy in ours:
            if policy.startswith("lookahead"):
                share = gap_share(ours, policy)
                checks.append([f"U = {utilisation:g}: `{policy}` ≥ LRU + {percent(gap_target)} of the LRU → Belady "
                               "gap (affinity router)", "n/a" if share is None else percent(share),
                               "n/a" if share is None else met(share >= gap_target)])
    lines = ["A replay of the production classes on a virtual clock, not a timed run of the model. The "
             f"{context_field(result, 'requests', int):,} requests of {context_field(result, 'trace', str)} arrive "
             f"at the trace's timestamps ({context_field(result, 'arrival_rate_rps'):.2f} requests/s) at "
             f"{context_field(result, 'replicas', int)} replicas, each a production `KvPrefixCache` whose L1 "
             "(`DeviceBlocks`, tiny blocks keyed by the trace's hash ids) holds "
             f"{context_field(result, 'l1_capacity_blocks', int):,} blocks "
             f"({context_field(result, 'l1_size') * 100:g} % of the trace's "
             f"{context_field(result, 'distinct_blocks', int):,} distinct blocks); each replica serves one request "
             "at a time from its FIFO queue, for a time proportional to the blocks it recomputes "
             "(`QueueModel(per_block)`, chosen so that U is a replica's utilisation if nothing were reused; reuse "
             "lowers it). Routing: the production affinity logic (`AffinityIndex`, `rendezvous_order`, the "
             f"imbalance threshold {context_field(result, 'imbalance_threshold', int)}, as `PrefixAffinityRouter` "
             "ranks), or power of two choices on the queue lengths (Ray's default). Eviction: LRU (vLLM's "
             "policy), `lookahead` over LRU and over `learned`, told the waiting requests as `HFGenerator` tells "
             "them; the KV L1 tells its policy a block's position in its prompt only (not its request, the "
             "request's length or the parent block, which the replays above give), so `learned` decides here on "
             "less than in the eviction tables. KV hit ratio: blocks reused / blocks requested; in brackets the share of the LRU → Belady gap "
             "closed. Belady: per replica, on the block accesses it saw under LRU, in its service order (a "
             "per-access optimum, so a bound on the reuse of leading blocks). Waiting: mean requests queued at a "
             "service start.", ""]
    lines += table(["U", "router", "eviction", "KV hit ratio", "waiting", "requests per replica"], body)
    lines += ["", *table(["target", "measured", ""], checks)]
    return [*lines, "", *provenance(result)]


def kv_memory(results: Mapping[str, Result]) -> list[str]:
    result = results["kv-memory"]
    per_token, bound = [], None
    for where, row in rows_of(result):
        kind = field(result, where, row, "kind", str)
        if kind == "per-token":
            per_token.append([field(result, where, row, "dtype", str),
                              f"{field(result, where, row, 'bytes_per_token', int):,}",
                              f"{field(result, where, row, 'block_bytes', int):,}",
                              f"{field(result, where, row, 'tokens_per_gib', int):,}"])
        elif kind == "bound":
            bound = (field(result, where, row, "capacity_bytes", int), field(result, where, row, "max_used_bytes", int),
                     field(result, where, row, "used_bytes", int), field(result, where, row, "held_storage_bytes", int),
                     field(result, where, row, "held_blocks", int), field(result, where, row, "stored_blocks", int),
                     field(result, where, row, "evictions", int))
        else:
            raise ResultError(f"{result.path}: {where}: field 'kind' must be per-token or bound, got {kind!r}")
    if bound is None or not per_token:
        raise ResultError(f"{result.path}: needs per-token rows and a bound row")
    capacity, most, used, storage, held, stored, evictions = bound
    bs = context_field(result, "block_size", int)
    lines = [f"What a cached token costs for the model of the first table ({context_field(result, 'layers', int)} "
             f"layers × {context_field(result, 'kv_heads', int)} KV heads × head size "
             f"{context_field(result, 'head_dim', int)}, keys and values, blocks of {bs} tokens), per dtype:", ""]
    lines += table(["dtype", "bytes per token", "bytes per block", "tokens per GiB"], per_token)
    lines += ["", f"L1 at its bound: {context_field(result, 'prompts', int)} prompts of "
              f"{context_field(result, 'prompt_tokens', int):,} tokens through the model into an L1 of "
              f"{context_field(result, 'capacity_blocks'):g} blocks (fp32, LRU).", ""]
    lines += table(["capacity, bytes", "most used, bytes", "used at the end", "held tensors' storage", "blocks held",
                    "blocks stored", "evictions", ""],
                   [[f"{capacity:,}", f"{most:,}", f"{used:,}", f"{storage:,}", str(held), str(stored), str(evictions),
                     "within the bound" if max(most, used, storage) <= capacity else "over the bound"]])
    return [*lines, "", *provenance(result)]


# -- the policy loop ---------------------------------------------------------------------------------------


def ratio_cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def interval_cell(ci: Sequence[float] | None) -> str:
    return "n/a" if not ci else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def measured_cell(value: Any) -> str:
    """A target's measured figure as bench/loop.py records it: a number, a window, a list, a status or none."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ", ".join(measured_cell(v) for v in value) or "none"
    return str(value)


def target_rows(result: Result) -> list[list[str]]:
    body = []
    for i, t in enumerate(context_field(result, "targets", list)):
        where = f"context.targets[{i}]"
        passed = field(result, where, t, "passed", bool, optional=True)
        body.append([field(result, where, t, "name", str), field(result, where, t, "target", str),
                     measured_cell(t.get("measured")), "not measured" if passed is None else met(passed)])
    return body


def loop_drift(result: Result, what: str) -> list[str]:
    windows = []
    for where, row in rows_of(result):
        windows.append([str(field(result, where, row, "window", int)),
                        "+".join(field(result, where, row, "phases", list)),
                        f"{field(result, where, row, 'static_a'):.3f}", f"{field(result, where, row, 'loop'):.3f}",
                        f"{field(result, where, row, 'hindsight'):.3f}",
                        field(result, where, row, "loop_policy", str)
                        + (f" (canary {row['canary']})" if row.get("canary") else ""),
                        ", ".join(field(result, where, row, "findings", list)) or "-",
                        ratio_cell(field(result, where, row, "harmful_run", optional=True))])
    grid = context_field(result, "grid", list)
    b = context_field(result, "phase_b", dict)
    found = context_field(result, "detection", dict)
    post = context_field(result, "post_drift", dict)
    delay = found.get("delay_windows")
    lines = [f"{what} {context_field(result, 'requests', int):,} requests in {context_field(result, 'windows', int)} "
             f"windows of {context_field(result, 'window', int)}, replayed by the loop's simulator with an L1 of "
             f"{context_field(result, 'capacity', int):,} (a tenth of the trace's distinct keys, in its size unit), "
             f"from `{context_field(result, 'policy', str)}`. Static A: the best of a grid of {len(grid)} policies "
             f"(edits of the kinds the loop proposes) on phase A, from a cold cache: "
             f"*{context_field(result, 'static_a', str)}*. The loop starts from static A; reviews it leaves waiting "
             "are answered by a stand-in reviewer (approve a waiting proposal, decline an inconclusive one). "
             "Hindsight: static A until phase B's first request, then the grid's best on phase B in the same "
             f"warm cache: *{context_field(result, 'hindsight_b', (str, type(None))) or 'none'}*. Hit ratio: keys "
             "served from cache / keys asked for, bypassed calls included.", ""]
    lines += table(["over phase B", "static A", "loop", "hindsight"],
                   [["hit ratio", ratio_cell(b.get("static_a")), ratio_cell(b.get("loop")),
                     ratio_cell(b.get("hindsight"))]])
    lines += ["", f"Phase B starts in window {found.get('drift_window')}; the loop reported a drift in window "
              f"{'never' if found.get('detected_at') is None else found['detected_at']}"
              + ("" if delay is None else f" (a delay of {delay} windows)")
              + f"; drift findings before phase B: {measured_cell(found.get('false_alarms'))}. Over windows "
              f"{measured_cell(post.get('windows'))} after detection the loop's hit ratio is "
              f"{ratio_cell(post.get('loop'))} against hindsight's {ratio_cell(post.get('hindsight'))}.", ""]
    proposals = context_field(result, "gains", list)
    lines += ["Promoted proposals, predicted (replayed before the canary) and realised (the windows after promotion, "
              "against the same schedule without the change) hit-ratio gains:", ""]
    lines += table(["proposal", "window", "edits", "predicted", "its interval", "realised", "error"],
                   [[str(p.get("id")), str(p.get("window")), "; ".join(p.get("edits") or []) or "-",
                     f"{p['predicted_gain']:+.4f}",
                     interval_cell(p.get("predicted_ci")),
                     "n/a" if p.get("realised_gain") is None else f"{p['realised_gain']:+.4f}",
                     "n/a" if p.get("relative_error") is None else percent(p["relative_error"])]
                    for p in proposals] or [["none", "", "", "", "", "", ""]])
    harmful = context_field(result, "harmful", (dict, type(None)))
    if harmful is None or harmful.get("proposal") is None:
        lines += ["", "No harmful proposal was injected (no window after detection without a canary and with room "
                  "to judge one)."]
    else:
        breach = harmful.get("breach") or {}
        served = harmful.get("canary_windows") or []
        lines += ["", f"A harmful proposal (every ttl cut to one second, predicted gain "
                  f"{harmful['predicted_gain']:+.4f}, approved against its evidence) injected at window "
                  f"{harmful['at']} of a second run: its canary served windows {measured_cell(served)}, where the "
                  f"run's hit ratio was {ratio_cell(harmful.get('harmed_hit_ratio'))} against the clean run's "
                  f"{ratio_cell(harmful.get('clean_hit_ratio'))} (a drop of "
                  f"{ratio_cell(harmful.get('hit_ratio_drop'))}); "
                  f"the loop's verdict: {harmful['status']}"
                  + ("" if harmful.get("final_status") in (None, harmful["status"])
                     else f" (then {harmful['final_status']} by the stand-in reviewer)")
                  + (f"; the breach: {breach['reason']}." if breach.get("reason") else ".")]
    lines += ["", *table(["target", "goal", "measured", ""], target_rows(result))]
    lines += ["", "Every window (hit ratio; the loop's policy and canary; its findings; the run with the harmful "
              "proposal):", ""]
    lines += table(["window", "phases", "static A", "loop", "hindsight", "loop's policy", "findings", "harmful run"],
                   windows)
    return [*lines, "", *provenance(result)]


def loop_kv(results: Mapping[str, Result]) -> list[str]:
    return loop_drift(results["loop-kv"], "The Mooncake trace in two phases (`agents._scenarios.kv_drift`): A, "
                      "one chat tenant; B, its later requests under a new prefix with a batch tenant's one-off "
                      "documents mixed in:")


def loop_semantic(results: Mapping[str, Result]) -> list[str]:
    return loop_drift(results["loop-semantic"], "A Banking77 question stream, then a CLINC150 one "
                      "(`agents._scenarios.semantic_drift`, Zipf popularity over each one's first questions):")


def loop_stationary(results: Mapping[str, Result]) -> list[str]:
    result = results["loop-stationary"]
    runs = context_field(result, "workloads", dict)
    body = []
    for name, run in runs.items():
        where = f"context.workloads.{name}"
        promoted = sum(p.get("status") == "promoted" for p in field(result, where, run, "proposals", list))
        body.append([name, f"{field(result, where, run, 'requests', int):,} in "
                           f"{field(result, where, run, 'windows', int)}",
                     field(result, where, run, "static_a", str),
                     f"{field(result, where, run, 'static_hit_ratio'):.3f}",
                     f"{field(result, where, run, 'loop_hit_ratio'):.3f}", str(promoted),
                     measured_cell(field(result, where, run, "false_alarms", list))])
    for where, row in rows_of(result):
        field(result, where, row, "drift", bool)
    lines = ["Phase A alone: the whole Mooncake trace as the one chat tenant, and the Banking77 stream for as long "
             "as the drifting stream. The loop runs as in the drifting scenarios, from the grid's best policy on "
             "the same traffic; nothing moved, so no drift should be reported.", ""]
    lines += table(["workload", "requests, windows", "static policy", "static hit ratio", "loop hit ratio",
                    "promoted", "drift findings in windows"], body)
    lines += ["", *table(["target", "goal", "measured", ""], target_rows(result))]
    return [*lines, "", *provenance(result)]


# -- the page and the headline -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    render: Callable[[Mapping[str, Result]], list[str]]


SECTIONS = (
    Section("Semantic caching: streams", semantic_streams),
    Section("Semantic caching: fow traps", semantic_pairs),
    Section("Semantic caching: generalisation", semantic_generalisation),
    Section("Eviction: the Mooncake trace", eviction_mooncake),
    Section("Eviction: queue look-ahead", eviction_lookahead),
    Section("Eviction: cloudPhysicsIO", eviction_cloudphysics),
    Section("Eviction policy cost on the request path", eviction_cost),
    Section("Replay throughput", eviction_throughput),
    Section("Per-call overhead", overhead),
    Section("Serving: an exact hit through Ray Serve", serving_hit),
    Section("Serving: the miss path", serving_miss),
    Section("Serving: prefix-affinity routing", serving_affinity),
    Section("Serving: sustained load", serving_load),
    Section("Gateway: an exact hit in front of vLLM", gateway_hit),
    Section("Gateway: the miss path in front of vLLM", gateway_miss),
    Section("Gateway: sustained load in front of vLLM", gateway_load),
    Section("Gateway: tokens and money saved", gateway_savings),
    Section("KV cache: time to first token", kv_ttft),
    Section("KV cache: chunk reuse", kv_chunks),
    Section("KV cache: routing and eviction on the Mooncake trace", kv_routing),
    Section("KV cache: memory", kv_memory),
    Section("Policy loop: KV drift", loop_kv),
    Section("Policy loop: semantic drift", loop_semantic),
    Section("Policy loop: stationary traffic", loop_stationary),
)

INTRO = """\
# Benchmark results

<!-- Generated by `make bench-report` (bench/report.py) from bench/results/*.json: do not edit by hand. -->

Every figure here is read from a result file under bench/results/ and printed with the command that produced it,
when it ran, on how many cores at what load average, and with which versions. What each benchmark measures and
why the mechanisms are built as they are is on the design pages: [semantic caching](semantic.md),
[eviction](eviction.md), [replay](replay.md), [serving](serving.md), [the KV cache](kv.md). To measure again
(tens of minutes on two cores) and regenerate this page and the README's headline table:

    make bench bench-eviction bench-semantic bench-semantic-generalisation bench-serving bench-gateway bench-kv
    make bench-loop bench-report
"""


def page(results: Mapping[str, Result]) -> str:
    lines = [INTRO.rstrip("\n")]
    for section in SECTIONS:
        lines += ["", f"## {section.title}", "", *section.render(results)]
    return "\n".join(lines) + "\n"


def link(title: str) -> str:
    return f"[details](docs/benchmarks.md#{anchor(title)})"


def headline(results: Mapping[str, Result]) -> str:
    """The README's block: a few figures, each linking to its section of docs/benchmarks.md."""
    body = []

    streams = results["semantic-streams"]
    runs = [r for r in stream_runs(streams) if r.delta == HEADLINE_DELTA]
    if not runs:
        raise ResultError(f"{streams.path}: no run at δ = {HEADLINE_DELTA:g}, which the headline quotes")
    per_stream = []
    for stream in dict.fromkeys(r.stream for r in runs):
        ratios = [r.ratio for r in runs if r.stream == stream and r.ratio is not None]
        per_stream.append(f"{stream} {span(ratios, '.2f') if ratios else 'n/a'}×")
    within = sum(r.error_rate <= r.delta for r in runs)
    body.append([f"Semantic hit rate against the best fixed similarity threshold chosen in hindsight, error bound "
                 f"δ = {HEADLINE_DELTA:g}", f"{', '.join(per_stream)}; error within δ in {within} of {len(runs)} runs",
                 link("Semantic caching: streams")])

    general = results["semantic-generalisation"]
    short = [r for r in generalisation_runs(general) if r.run in ("prefix", "cross") and r.delta == HEADLINE_DELTA]
    if not short:
        raise ResultError(f"{general.path}: no prefix or cross run at δ = {HEADLINE_DELTA:g}, which the headline "
                          "quotes")
    short = [r for r in short if r.n == max(g.n for g in short)]  # the longest prefix measured
    budget = context_field(general, "judge_budget")
    ratios = [r.ratio for r in short if r.ratio is not None]
    body.append([f"Semantic hit rate on traffic it was not tuned on: the first {short[0].n:,} queries of each stream, "
                 f"cold and after learning the other stream, against the best fixed threshold chosen in hindsight on "
                 f"those queries, δ = {HEADLINE_DELTA:g}",
                 f"{span(ratios, '.2f') if ratios else 'n/a'}× (mean {sum(ratios) / max(len(ratios), 1):.2f}×, target "
                 f"{TARGET_RATIO:g}× met in {sum(x >= TARGET_RATIO for x in ratios)} of {len(short)} runs); error within "
                 f"δ in {sum(r.error_rate <= r.delta for r in short)} of {len(short)}, at most "
                 f"{max(r.judge_per_query for r in short):.2f} judge calls per query (budget {budget:g})",
                 link("Semantic caching: generalisation")])

    pairs = results["semantic-pairs"]
    pair = [r for r in pair_runs(pairs) if r.run != "static"]
    worst = {kind: max(c.traps_served for r in pair if r.run == kind for c in r.categories.values() if c.trap)
             for kind in ("cold", "warm")}
    total = max(c.pairs for r in pair for c in r.categories.values() if c.trap)
    seeds = list(dict.fromkeys(r.seed for r in pair))
    body.append([f"Trap prompts (negation, entity swap, number, scope) served a wrong answer at δ = "
                 f"{context_field(pairs, 'delta'):g}, worst category", f"{worst['cold']} of {total} alone, "
                 f"{worst['warm']} as a new tenant ({len(seeds)} pair orders)", link("Semantic caching: fow traps")])

    mooncake, told = results["eviction-mooncake"], results["eviction-mooncake-output-lengths"]

    def at(result: Result, policy: str, rows: Sequence[Replayed] | None = None) -> list[Replayed]:
        chosen = []
        for size in HEADLINE_SIZES:
            found = [r for r in (rows if rows is not None else replayed(result)) if r.policy == policy and r.size == size]
            if not found:
                raise ResultError(f"{result.path}: no {policy!r} row at size {size:g}, which the headline quotes")
            chosen.append(found[0])
        return chosen

    def ratios(rows: Sequence[Replayed]) -> str:
        return " / ".join(f"{r.hit_ratio:.3f}" for r in rows)

    sizes = " / ".join(size_label(s) for s in HEADLINE_SIZES)
    body.append([f"Learned eviction on the Mooncake KV-block trace, hit ratio at {sizes} of its blocks",
                 f"{ratios(at(mooncake, 'learned'))}, {ratios(at(told, 'learned'))} told output lengths (LRU "
                 f"{ratios(at(mooncake, 'lru'))}, ARC {ratios(at(mooncake, 'arc'))}, Belady "
                 f"{ratios(at(mooncake, 'belady'))})", link("Eviction: the Mooncake trace")])

    queue = results["eviction-lookahead"]
    rows = [r for r in replayed(queue, queued=True) if r.utilisation == HEADLINE_UTILISATION and r.output_lengths]
    shares = gaps(queue, rows) if rows else {}
    chosen = at(queue, "lookahead:learned", rows)
    body.append([f"Learned eviction told the server's queue (utilisation {HEADLINE_UTILISATION:g}) and output "
                 f"lengths, share of the LRU → Belady gap closed at {sizes}",
                 " / ".join(percent(shares[r] or 0.0) for r in chosen), link("Eviction: queue look-ahead")])

    costs = overhead_rows(results["overhead"])
    for name, label in (("l1_hit_vs_cachetools", "L1 hit through `@cache_if`, against a `cachetools.cached` hit"),
                        ("l2_hit_vs_redis_get", "L2 hit, against a raw redis-py GET of the same payload"),
                        ("miss_path_vs_bare_1ms", "Miss path, against calling the same 1 ms function bare")):
        candidate, baseline, ratio, _ = costs[name]
        body.append([label, f"{ratio:.2f}× ({candidate:.2f} µs against {baseline:.2f} µs)", link("Per-call overhead")])

    hit = compared_rows(results["serving-hit"], list(SERVING_HIT))
    handle, two_hops = hit["hit_handle"], hit["hit_http_two_hops"]
    body.append(["Exact hit through Ray Serve against bare Ray Serve returning the same payload, p50",
                 f"{handle.ratio_p50:.2f}× over a handle ({handle.ours[0]:.2f} ms against {handle.theirs[0]:.2f} ms), "
                 f"{two_hops.ratio_p50:.2f}× over HTTP against the same two hops ({two_hops.ours[0]:.2f} ms against "
                 f"{two_hops.theirs[0]:.2f} ms), {hit['hit_http'].ratio_p50:.2f}× against one bare deployment",
                 link("Serving: an exact hit through Ray Serve")])
    miss = compared_rows(results["serving-miss"], ["miss_handle"])["miss_handle"]
    body.append([f"Miss path through a replica on a {context_field(results['serving-miss'], 'model_ms'):g} ms model, "
                 "against a bare deployment, p50", f"{(miss.ratio_p50 - 1) * 100:+.1f} % ({miss.ours[0]:.1f} ms "
                 f"against {miss.theirs[0]:.1f} ms)", link("Serving: the miss path")])
    routers = router_rows(results["serving-affinity"])
    ours, theirs = routers["affinity"], routers["default"]
    body.append(["Prefix-affinity router against Ray's default router (2 replicas, the Mooncake trace): share of "
                 "reused prefix blocks sent to the replica that last served them",
                 f"{ours.share:.2f} against {theirs.share:.2f}"
                 + (f" ({ours.share / theirs.share:.2f}×)" if theirs.share else ""),
                 link("Serving: prefix-affinity routing")])
    load = load_row(results["serving-load"])
    body.append([f"{load.clients} HTTP clients for {load.duration_s:.0f} s", f"{load.requests:,} requests, "
                 f"{load.errors} errors, {load.throughput:.0f} req/s, p99 {load.p99:.0f} ms; replica RSS "
                 f"{max(g for *_, g in load.rss) * 100:+.1f} % after the first "
                 f"{context_field(results['serving-load'], 'warm_up_s'):g} s", link("Serving: sustained load")])

    gateway = compared_rows(results["gateway-hit"], ["hit_vs_echo", "hit_vs_vllm"], untargeted=["hit_vs_vllm"])
    echo, computed = gateway["hit_vs_echo"], gateway["hit_vs_vllm"]
    body.append(["Exact hit through `evocache serve --upstream` in front of vLLM, p50, against a bare echo server "
                 "returning the same body, and against vLLM computing the answer",
                 f"{echo.ours[0]:.1f} ms: {echo.ratio_p50:.1f}× the echo server ({echo.theirs[0]:.2f} ms); vLLM "
                 f"{computed.theirs[0]:.0f} ms", link("Gateway: an exact hit in front of vLLM")])
    miss = compared_rows(results["gateway-miss"], ["miss_vs_vllm"])["miss_vs_vllm"]
    body.append(["Miss path through `evocache serve --upstream` against straight to vLLM, p50",
                 f"{(miss.ratio_p50 - 1) * 100:+.1f} % ({miss.ours[0]:.0f} ms against {miss.theirs[0]:.0f} ms)",
                 link("Gateway: the miss path in front of vLLM")])
    loads = gateway_loads(results["gateway-load"])
    ours, theirs = loads["evocache"], loads["vllm"]
    spent = gateway_spent(results["gateway-savings"])
    saved = sum(s.saved_tokens for s in spent.values())
    total = sum(s.prompt_tokens + s.completion_tokens for s in spent.values())
    load_s = context_field(results["gateway-load"], "load_s")
    body.append([f"{ours.clients} clients for {load_s:g} s through `evocache serve --upstream`, half repeats",
                 f"{ours.requests:,} requests, {ours.errors} errors, {ours.throughput:.1f} req/s (straight to vLLM "
                 f"{theirs.throughput:.1f}); hits p99 {_p99(ours.hit)} ms, misses p99 {_p99(ours.miss, '.0f')} ms; "
                 f"{percent(saved / total)} of the tokens not computed by vLLM",
                 link("Gateway: sustained load in front of vLLM")])

    ttft = results["kv-ttft"]
    cases = ttft_rows(ttft)
    l1, l2 = cases["l1-0.9"], cases["l2-0.9-prefetch"]
    body.append([f"KV prefix cache: time to first token of a {context_field(ttft, 'tokens', int):,}-token prompt "
                 "with 90 % of it cached, against cold", f"{l1.speedup:.2f}× from L1, {l2.speedup:.2f}× from Redis "
                 f"(L2) prefetched while queued, {percent(l2.hidden_fraction or 0.0)} of its load hidden (cold "
                 f"{context_field(ttft, 'cold_ms'):.0f} ms)", link("KV cache: time to first token")])
    routing = results["kv-routing"]
    groups = routing_groups(routing)
    utilisation = min(u for u, _ in groups)
    ours, theirs = groups[(utilisation, "affinity")]["lru"], groups.get((utilisation, "default"), {}).get("lru")
    if theirs is None:
        raise ResultError(f"{routing.path}: no default-router LRU row at utilisation {utilisation:g}")
    body.append([f"KV hit ratio on the Mooncake trace, 2 replicas (replayed, U = {utilisation:g}): prefix-affinity "
                 "router against Ray's default, LRU", f"{ours.hit_ratio:.3f} against {theirs.hit_ratio:.3f}"
                 + (f" ({ours.hit_ratio / theirs.hit_ratio:.2f}×)" if theirs.hit_ratio else ""),
                 link("KV cache: routing and eviction on the Mooncake trace")])

    speed = results["eviction-throughput"]
    where, row = next(iter(rows_of(speed)))
    body.append(["Replay of the production LRU class over the Mooncake trace",
                 f"{field(speed, where, row, 'replay_per_min') / 1e6:.1f} M accesses per minute",
                 link("Replay throughput")])

    drifts = []
    for part, name in (("loop-kv", "KV"), ("loop-semantic", "semantic")):
        found, post = context_field(results[part], "detection", dict), context_field(results[part], "post_drift", dict)
        delay = found.get("delay_windows")
        share = post.get("share")
        drifts.append(f"{name}: {'n/a' if share is None else percent(share)}, drift reported "
                      + ("never" if delay is None else f"{delay} windows after it came"))
    alarms = sum(len(run.get("false_alarms") or [])
                 for run in context_field(results["loop-stationary"], "workloads", dict).values())
    after = context_field(results["loop-kv"], "post_drift_windows", int)
    body.append([f"Policy loop on drifting traffic: its hit ratio over the {after} windows after it "
                 "reports the drift, as a share of the best static policy per phase chosen in hindsight",
                 "; ".join(drifts) + f"; {alarms} false drift reports on stationary traffic",
                 link("Policy loop: KV drift")])
    gains, harmful = [], []
    for part in ("loop-kv", "loop-semantic"):
        for g in context_field(results[part], "gains", list):
            low, high = g["predicted_ci"]
            realised = "not measured" if g["realised_gain"] is None else f"realised {g['realised_gain']:+.3f}"
            gains.append(f"{', '.join(g['edits'])}: predicted {g['predicted_gain']:+.3f} [{low:+.3f}, {high:+.3f}], "
                         f"{realised}")
        hurt = context_field(results[part], "harmful", dict)
        if hurt:
            harmful.append(bool(hurt.get("rolled_back")))
    body.append(["Policy loop: the gain of each promoted proposal, predicted by replay (90 % interval) and "
                 "realised after promotion; injected harmful proposals rolled back",
                 "; ".join(gains or ["no proposal promoted"])
                 + f"; harmful proposals rolled back: {sum(harmful)} of {len(harmful)}",
                 link("Policy loop: KV drift")])

    lines = [BEGIN, "",
             "Generated by `make bench-report` from the result files in bench/results/; "
             "[docs/benchmarks.md](docs/benchmarks.md) has every table, the commands and the machines.", ""]
    lines += table(["figure", "measured", ""], body)
    return "\n".join([*lines, "", END])


# -- files -------------------------------------------------------------------------------------------------


def load_all(directory: Path) -> dict[str, Result]:
    """Every part's result file in ``directory``; raises ``ResultError`` for missing, unknown or malformed ones."""
    missing = [f"{directory / part}.json (made by {command})" for part, command in PARTS.items()
               if not (directory / f"{part}.json").is_file()]
    if missing:
        raise ResultError("missing result file(s): " + "; ".join(missing))
    unknown = sorted(p.name for p in directory.glob("*.json") if p.stem not in PARTS)
    if unknown:
        raise ResultError(f"{directory}: no section for {', '.join(unknown)}; known parts: {', '.join(PARTS)}")
    return {part: load(directory / f"{part}.json") for part in PARTS}


def with_headline(readme: str, block: str, path: Path) -> str:
    """``readme`` with the text from BEGIN to END replaced by ``block``; each marker must occur exactly once."""
    for marker in (BEGIN, END):
        if readme.count(marker) != 1:
            raise ResultError(f"{path}: expected the line {marker} once, found it {readme.count(marker)} times")
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    if end < start:
        raise ResultError(f"{path}: {END} comes before {BEGIN}")
    return readme[:start] + block + readme[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__.partition("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files (default: bench/results)")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page written (default: docs/benchmarks.md)")
    parser.add_argument("--readme", type=Path, default=README, help="the README whose block is rewritten "
                                                                       "(default: README.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if either output is stale")
    args = parser.parse_args(argv)
    try:
        results = load_all(args.results)
        doc = page(results)
        readme_text = args.readme.read_text(encoding="utf-8")
        readme = with_headline(readme_text, headline(results), args.readme)
    except (ResultError, OSError) as exc:
        print(f"report.py: error: {exc}", file=sys.stderr)
        return 1
    if args.check:
        stale = [str(p) for p, text in ((args.doc, doc), (args.readme, readme))
                 if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if stale:
            print(f"report.py: stale: {', '.join(stale)} (run make bench-report)", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(doc, encoding="utf-8")
    args.readme.write_text(readme, encoding="utf-8")
    print(f"wrote {args.doc} and the headline block of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
