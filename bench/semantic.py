"""The semantic-caching figures (error bound, hit rate against the best static threshold, fow traps).

    .venv/bin/python bench/semantic.py [--streams banking77,clinc150] [--deltas 0.01,0.02,0.05]
                                       [--seeds 0,1,2] [--shuffled 1] [--pairs-delta 0.02] [--pairs-seeds 0]
                                       [--no-pairs] [--no-classify] [--out DIR] [--embed-cache DIR]
                                       [--results DIR]
    .venv/bin/python bench/semantic.py --generalisation [--streams ...] [--gen-deltas 0.02]
                                       [--gen-prefixes 1000,3000,all] [--gen-shuffles 3]
                                       [--gen-pairs-seeds 0,1,2] [--gen-warmup all] [--no-classify]
                                       [--out DIR] [--embed-cache DIR] [--results DIR]

Every option is checked before any work; a bad one fails in one line (exit 2).

(a) For each stream (examples/data/banking77_train.jsonl, bench/data/clinc150_train.jsonl), each delta and each
    seed: evocache's hit rate, error rate, exploration and judge calls, against the best static threshold
    meeting the same delta on the same stream, chosen in hindsight. ``--shuffled N`` adds N runs per
    (stream, delta) on the stream shuffled by seeds 100, 101, ... (another arrival order; its own hindsight
    static threshold). A row fails the target when error > delta or hit rate < 1.25x the static one.
(b) fow traps (bench/data/fow_traps.jsonl) at delta 0.02: b served and traps served per category, the error
    model warmed on the Banking77 stream (``--warmup``), and the static thresholds next to it, for the first of
    ``--pairs-seeds`` (pair orders); with more seeds, one line of traps served per seed, cold and warm.
(c) ``--generalisation``, instead of (a) and (b): how the cache does on traffic it was not tuned on, at each of
    ``--gen-deltas``. "prefix": the first N queries (``--gen-prefixes``) of each stream in orders shuffled by
    seeds 100, 101, ... (``--gen-shuffles``), a cache that starts knowing nothing (one replay per order gives
    every prefix: the first N lookups of a longer stream are the stream of N) but the error model's prior,
    fitted without the measured stream (``held_out_prior``). "cross": the same prefixes,
    after the cache learnt the other stream (its first ``--gen-warmup`` queries, as-is order; all of it by
    default) in a scope of its own, with the static threshold chosen in hindsight on those queries replayed on
    the prefix ("transferred"). "pairs": the fow pairs as a stream (store a, ask b; pair orders
    ``--gen-pairs-seeds``), cold and after each stream. Every run has its own hindsight-best static threshold
    (chosen on the run's own queries) and the ratio against it, error rate, judge calls per query and the
    share of delta spent (error / delta). A run meets the target when error <= delta, ratio >= 1.25 and at
    most 2 judge calls per query. Result file: semantic-generalisation.

Every row is computed by the same code `evocache bench semantic` runs (``controller/semantic/_bench.py``); the
embeddings are computed once per text set and kept under ``--embed-cache`` (default ``.evocache/embeddings``).
Results go to ``--out`` (JSON per part, and ``semantic.md``, the tables); with ``--results DIR`` also the result
files that bench/report.py renders into docs/benchmarks.md (``make bench-semantic`` passes ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, NoReturn, TypeVar

if TYPE_CHECKING:
    from evocache.controller.semantic._bench import PairRow, StreamRow, VectorTable

ROOT = Path(__file__).resolve().parent.parent
STREAMS = {
    "banking77": ROOT / "examples" / "data" / "banking77_train.jsonl",
    "clinc150": ROOT / "bench" / "data" / "clinc150_train.jsonl",
}
PAIRS = ROOT / "bench" / "data" / "fow_traps.jsonl"
TARGET_RATIO = 1.25
T = TypeVar("T")


class Options(NamedTuple):
    """The command line, checked (``options``). A NamedTuple, not a dataclass: bench/semantic_ceiling.py loads
    this script by path, outside ``sys.modules``, where a dataclass cannot resolve its annotations."""

    streams: tuple[str, ...]
    deltas: tuple[float, ...]
    seeds: tuple[int, ...]
    shuffled: int
    pairs_delta: float
    pairs_seeds: tuple[int, ...]
    pairs: bool
    out: Path
    embed_cache: Path
    classify: bool = True
    results: Path | None = None
    generalisation: bool = False
    gen_deltas: tuple[float, ...] = (0.02,)
    gen_prefixes: tuple[int | None, ...] = (1000, 3000, None)  # None: the whole stream
    gen_shuffles: int = 3
    gen_pairs_seeds: tuple[int, ...] = (0, 1, 2)
    gen_warmup: int | None = None  # queries of the other stream learnt first; None: all of it


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, as evocache's commands fail: the usage block would bury the reason.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _value(parser: _Parser, option: str, text: str, parse: Callable[[str], T], what: str) -> T:
    """``parse(text)``; a ``ValueError`` fails the command, naming ``option`` and what it takes."""
    try:
        return parse(text.strip())
    except ValueError:
        parser.error(f"{option}: {text.strip()!r} is not {what}")


def _values(parser: _Parser, option: str, text: str, parse: Callable[[str], T], what: str) -> tuple[T, ...]:
    return tuple(_value(parser, option, part, parse, what) for part in text.split(","))


def _delta(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 0.5):
        raise ValueError(text)
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _prefix(text: str) -> int | None:
    return None if text == "all" else _positive(text)


def _stream(text: str) -> str:
    if text not in STREAMS:
        raise ValueError(text)
    return text


DELTA = "a number in (0, 0.5]"


def options(argv: Sequence[str] | None = None) -> Options:
    """The command line, every option checked before any work (a bad one fails in a second, not after minutes
    of streams): one line to stderr and exit 2."""
    parser = _Parser(prog=Path(__file__).name, description=__doc__.partition("\n")[0])
    parser.add_argument("--streams", default=",".join(STREAMS), metavar="NAME,...",
                        help=f"streams to replay, of {', '.join(STREAMS)} (default: %(default)s)")
    parser.add_argument("--deltas", default="0.01,0.02,0.05", metavar="D,...",
                        help=f"error bounds, each {DELTA} (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", metavar="S,...",
                        help="exploration seeds of the as-is order, integers (default: %(default)s)")
    parser.add_argument("--shuffled", default="1", metavar="N",
                        help="extra runs per (stream, delta) on orders shuffled by seeds 100, 101, ... "
                             "(default: %(default)s)")
    parser.add_argument("--pairs-delta", default="0.02", metavar="D",
                        help=f"the fow traps' error bound, {DELTA} (default: %(default)s)")
    parser.add_argument("--pairs-seeds", default="0", metavar="S,...",
                        help="pair orders to replay, integers; the first one's table is printed in full, each "
                             "seed gets a line of traps served, cold and warm (default: %(default)s)")
    parser.add_argument("--no-pairs", action="store_true", help="skip the fow traps (default: run them)")
    parser.add_argument("--no-classify", action="store_true",
                        help="the cache's answer classifier off (SemanticCache(classify=False); default: on)")
    parser.add_argument("--out", type=Path, default=ROOT / ".evocache" / "bench-semantic", metavar="DIR",
                        help="where the JSON and semantic.md go (default: %(default)s)")
    parser.add_argument("--embed-cache", type=Path, default=ROOT / ".evocache" / "embeddings", metavar="DIR",
                        help="embeddings kept between runs, keyed by model and texts (default: %(default)s)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="also write the result files semantic-streams.json and semantic-pairs.json (with "
                             "--generalisation: semantic-generalisation.json) here, for bench/report.py (make "
                             "bench-semantic passes bench/results; default: none)")
    gen = parser.add_argument_group("generalisation (--generalisation)")
    gen.add_argument("--generalisation", action="store_true",
                     help="run the generalisation evaluation (short prefixes, cross-domain, fow pairs as a stream) "
                          "instead of the stream table and the fow traps (default: off)")
    gen.add_argument("--gen-deltas", default="0.02", metavar="D,...",
                     help=f"its error bounds, each {DELTA} (default: %(default)s)")
    gen.add_argument("--gen-prefixes", default="1000,3000,all", metavar="N,...",
                     help="queries replayed of each stream, integers >= 1 or all (default: %(default)s)")
    gen.add_argument("--gen-shuffles", default="3", metavar="N",
                     help="arrival orders per stream, shuffled by seeds 100, 101, ... (default: %(default)s)")
    gen.add_argument("--gen-pairs-seeds", default="0,1,2", metavar="S,...",
                     help="orders of the fow pairs replayed as a stream, integers (default: %(default)s)")
    gen.add_argument("--gen-warmup", default="all", metavar="N",
                     help="queries of the other stream (as-is order) a cross run learns first, an integer >= 1 "
                          "or all (default: %(default)s)")
    args = parser.parse_args(argv)

    known = f"a known stream ({', '.join(STREAMS)})"
    checked = Options(
        streams=tuple(dict.fromkeys(_values(parser, "--streams", args.streams, _stream, known))),
        deltas=_values(parser, "--deltas", args.deltas, _delta, DELTA),
        seeds=_values(parser, "--seeds", args.seeds, int, "an integer"),
        shuffled=_value(parser, "--shuffled", args.shuffled, _count, "an integer >= 0"),
        pairs_delta=_value(parser, "--pairs-delta", args.pairs_delta, _delta, DELTA),
        pairs_seeds=_values(parser, "--pairs-seeds", args.pairs_seeds, int, "an integer"),
        pairs=not args.no_pairs,
        out=args.out,
        embed_cache=args.embed_cache,
        classify=not args.no_classify,
        results=args.results,
        generalisation=args.generalisation,
        gen_deltas=_values(parser, "--gen-deltas", args.gen_deltas, _delta, DELTA),
        gen_prefixes=tuple(dict.fromkeys(_values(parser, "--gen-prefixes", args.gen_prefixes, _prefix,
                                                 "an integer >= 1 or all"))),
        gen_shuffles=_value(parser, "--gen-shuffles", args.gen_shuffles, _positive, "an integer >= 1"),
        gen_pairs_seeds=_values(parser, "--gen-pairs-seeds", args.gen_pairs_seeds, int, "an integer"),
        gen_warmup=_value(parser, "--gen-warmup", args.gen_warmup, _prefix, "an integer >= 1 or all"),
    )
    from evocache.controller.cli_errors import unwritable

    dirs = [("--out", checked.out), ("--embed-cache", checked.embed_cache)]
    if checked.results is not None:
        dirs.append(("--results", checked.results))
    for option, path in dirs:
        why = unwritable(path, directory=True)
        if why is not None:
            parser.error(f"{option}: {why}")
    return checked


def main() -> int:
    args = options()
    if args.generalisation:
        return generalisation_main(args)

    from evocache.controller.semantic import SentenceTransformerEmbedder
    from evocache.controller.semantic._bench import (
        VectorTable,
        best_static,
        embed_cached,
        oracle_hit_rate,
        read_rows,
        replay_pairs,
        replay_stream,
    )

    deltas, seeds = args.deltas, args.seeds
    embedder = SentenceTransformerEmbedder()
    rows_out = []
    for name in args.streams:
        rows = read_rows(STREAMS[name])
        texts = list(dict.fromkeys(r.prompt for r in rows))
        vecs = embed_cached(texts, embedder, args.embed_cache)
        table = VectorTable(texts, vecs, embedder.name)
        orders = [("as-is", rows, s) for s in seeds]
        for k in range(args.shuffled):
            shuffled = list(rows)
            random.Random(100 + k).shuffle(shuffled)
            orders.append((f"shuffled-{100 + k}", shuffled, 100 + k))
        statics: dict[str, dict[float, dict]] = {}
        for order, stream, seed in orders:
            if order not in statics:
                t0 = time.perf_counter()
                statics[order] = best_static(stream, table.embed([r.prompt for r in stream]), deltas)
                print(f"[{name} {order}] static sweep {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            for delta in deltas:
                t0 = time.perf_counter()
                evo = replay_stream(stream, table, delta, seed=seed, classify=args.classify)
                static = statics[order][delta]
                ratio = evo["hit_rate"] / static["hit_rate"] if static["hit_rate"] else None
                row = {"stream": name, "order": order, "seed": seed, "delta": delta, "classify": args.classify,
                       "n": len(stream),
                       "oracle_hit_rate": oracle_hit_rate(stream), "evocache": evo, "best_static": static,
                       "ratio": ratio,
                       "meets": evo["error_rate"] <= delta and ratio is not None and ratio >= TARGET_RATIO}
                rows_out.append(row)
                shown = "n/a" if ratio is None else f"{ratio:.2f}"
                print(f"[{name} {order} seed {seed} delta {delta}] hit {evo['hit_rate']:.4f} err "
                      f"{evo['error_rate']:.4f} | static {static['threshold']} hit {static['hit_rate']:.4f} err "
                      f"{static['error_rate']:.4f} | ratio {shown} | {time.perf_counter() - t0:.0f}s",
                      file=sys.stderr, flush=True)
                (args.out / "streams.json").write_text(json.dumps(rows_out, indent=2) + "\n")

    pairs_report = None
    if args.pairs:
        pairs = read_rows(PAIRS)
        warm = read_rows(STREAMS["banking77"])
        texts = list(dict.fromkeys([t for p in pairs for t in (p.a, p.b)] + [r.prompt for r in warm]))
        table = VectorTable(texts, embed_cached(texts, embedder, args.embed_cache), embedder.name)
        pair_seeds = args.pairs_seeds
        by_seed = {seed: {"warm": replay_pairs(pairs, table, args.pairs_delta, seed=seed, warmup=warm,
                                               classify=args.classify),
                          "cold": replay_pairs(pairs, table, args.pairs_delta, seed=seed, classify=args.classify)}
                   for seed in pair_seeds}
        pairs_report = {
            "delta": args.pairs_delta,
            "classify": args.classify,
            "seed": pair_seeds[0],
            "warm": by_seed[pair_seeds[0]]["warm"],
            "cold": by_seed[pair_seeds[0]]["cold"],
            "seeds": {str(seed): runs for seed, runs in by_seed.items()},
            "static": {f"{t:g}": replay_pairs(pairs, table, args.pairs_delta, mode="static", threshold=t)["categories"]
                       for t in (0.8, 0.85, 0.9, 0.95)},
        }
        (args.out / "pairs.json").write_text(json.dumps(pairs_report, indent=2) + "\n")

    (args.out / "semantic.md").write_text(
        _markdown(rows_out, pairs_report)
        + f"\nAnswer classifier: {'on' if args.classify else 'off (--no-classify)'}.\n"
    )
    print((args.out / "semantic.md").read_text())
    if args.results is not None:
        for path in write_results(args, rows_out, pairs_report):
            print(f"(written to {path})")
    return 0


def write_results(args: Options, rows: list[dict], pairs: dict | None) -> list[Path]:
    """The result files of this run (bench/_results.py), rows as streams.json and pairs.json hold them:
    semantic-streams (one row per stream, order, seed and delta) and, unless ``--no-pairs``, semantic-pairs (one
    row per pair seed and run, cold and warm, then one per static threshold, at the first pair seed)."""
    from _results import command_line, write  # bench/_results.py: this script's directory is on sys.path

    assert args.results is not None
    command = command_line()
    written = [write(args.results, "semantic-streams", rows, command=command, context={"classify": args.classify})]
    if pairs is not None:
        runs = [{"seed": int(seed), "run": kind, **by_kind[kind]}
                for seed, by_kind in pairs["seeds"].items() for kind in ("cold", "warm")]
        statics = [{"seed": pairs["seed"], "run": "static", "threshold": float(t), "categories": categories}
                   for t, categories in pairs["static"].items()]
        written.append(write(args.results, "semantic-pairs", runs + statics, command=command,
                             context={"delta": pairs["delta"], "classify": pairs["classify"]}))
    return written


# -- (c) generalisation ----------------------------------------------------------------------------------------

PAIRS_STREAM = "fow-pairs"  # the fow pairs replayed as a stream, a then b of each pair
JUDGE_BUDGET = 2.0  # judge calls per query a run may make on average


def generalisation_main(args: Options) -> int:
    from evocache.controller.semantic import SentenceTransformerEmbedder
    from evocache.controller.semantic._bench import embedded_table, read_rows

    streams = {name: read_rows(STREAMS[name]) for name in args.streams}
    pairs = read_rows(PAIRS)
    # One text set per stream, as the stream table embeds them, so both read the same cached embeddings.
    text_sets = [list(dict.fromkeys(r.prompt for r in rows)) for rows in streams.values()]
    text_sets.append(list(dict.fromkeys(t for p in pairs for t in (p.a, p.b))))
    table = embedded_table(text_sets, SentenceTransformerEmbedder(), args.embed_cache)
    rows = generalisation(args, streams, pairs, table)
    (args.out / "generalisation.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "generalisation.md").write_text(
        generalisation_markdown(rows) + f"\nAnswer classifier: {'on' if args.classify else 'off (--no-classify)'}.\n")
    print((args.out / "generalisation.md").read_text())
    if args.results is not None:
        from _results import command_line, write  # bench/_results.py: this script's directory is on sys.path

        path = write(args.results, "semantic-generalisation", rows, command=command_line(),
                     context=generalisation_context(args))
        print(f"(written to {path})")
    return 0


def held_out_prior(stream: str) -> Path:
    """The error model's prior fitted without ``stream`` (bench/data/semantic_priors/, ``make
    semantic-prior``): a run measures the cache on traffic its prior never saw, as a user's would be."""
    name = "fow_traps" if stream == PAIRS_STREAM else stream
    return ROOT / "bench" / "data" / "semantic_priors" / f"without_{name}.json"


def generalisation_context(args: Options) -> dict:
    """What the rows of semantic-generalisation need to be read: the runs' settings and the target."""
    return {"deltas": list(args.gen_deltas), "prefixes": list(args.gen_prefixes), "shuffles": args.gen_shuffles,
            "pairs_seeds": list(args.gen_pairs_seeds), "warmup": args.gen_warmup, "classify": args.classify,
            "target_ratio": TARGET_RATIO, "judge_budget": JUDGE_BUDGET,
            "prior": "fitted without the measured stream (bench/data/semantic_priors/without_<stream>.json)"}


def generalisation(args: Options, streams: dict[str, list[StreamRow]], pairs: Sequence[PairRow],
                   table: VectorTable) -> list[dict]:
    """The generalisation runs (module docstring, (c)) over ``streams`` (name -> labelled rows, as-is order) and
    the fow ``pairs``, embedded by ``table``: one row per run and delta, in the order they ran."""
    from evocache.controller.semantic._bench import best_static, pair_rows, replay_prefixes, static_at

    deltas = args.gen_deltas
    learnt = {name: list(rows[: args.gen_warmup]) for name, rows in streams.items()}
    # The static threshold each stream would have been tuned to in hindsight, on what a cross run learns of it.
    tuned = {name: best_static(rows, table.embed([r.prompt for r in rows]), deltas) for name, rows in learnt.items()}
    out: list[dict] = []

    def measure(run: str, stream: str, order: str, seed: int, rows: list[StreamRow], lengths: Sequence[int],
                others: Sequence[str]) -> None:
        """Every prefix of ``rows`` in ``lengths``, cold and after each of ``others``, from one replay each."""
        prefixes = {n: (rows[:n], table.embed([r.prompt for r in rows[:n]])) for n in lengths}
        own = {n: best_static(prefix, vecs, deltas) for n, (prefix, vecs) in prefixes.items()}
        for delta in deltas:
            for warm in (None, *others):
                t0 = time.perf_counter()
                reports = replay_prefixes(rows, table, delta, lengths, seed=seed,
                                          warmup=learnt[warm] if warm else (), classify=args.classify,
                                          prior=held_out_prior(stream))
                for n, evo in zip(lengths, reports, strict=True):
                    prefix, vecs = prefixes[n]
                    moved = None if warm is None else {"from": warm,
                                                       **static_at(prefix, vecs, tuned[warm][delta]["threshold"])}
                    kind = run if warm is None or run == "pairs" else "cross"
                    row = generalisation_row(kind, stream, order, seed, delta, prefix, len(rows), evo,
                                             own[n][delta], warm, len(learnt[warm]) if warm else 0, moved)
                    out.append(row)
                    ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"
                    print(f"[{kind} {stream} {order} n {n}{f' after {warm}' if warm else ''} delta {delta}] hit "
                          f"{evo['hit_rate']:.4f} err {evo['error_rate']:.4f} | static {own[n][delta]['threshold']} "
                          f"hit {own[n][delta]['hit_rate']:.4f} | ratio {ratio} | judge/query "
                          f"{row['judge_per_query']:.2f}", file=sys.stderr, flush=True)
                print(f"[{stream} {order}{f' after {warm}' if warm else ''} delta {delta}] "
                      f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    for name, rows in streams.items():
        others = [other for other in streams if other != name]
        lengths = list(dict.fromkeys(len(rows) if n is None else min(n, len(rows)) for n in args.gen_prefixes))
        for k in range(args.gen_shuffles):
            shuffled = list(rows)
            random.Random(100 + k).shuffle(shuffled)
            measure("prefix", name, f"shuffled-{100 + k}", 100 + k, shuffled, lengths, others)
    if pairs:
        for seed in args.gen_pairs_seeds:
            stream = pair_rows(pairs, seed)
            measure("pairs", PAIRS_STREAM, f"pairs-{seed}", seed, stream, [len(stream)], list(streams))
    return out


def generalisation_row(run: str, stream: str, order: str, seed: int, delta: float, rows: Sequence[StreamRow], of: int,
                       evo: dict, static: dict, learnt_on: str | None, warmup_n: int,
                       transferred: dict | None) -> dict:
    """One run's row: what ran, evocache's figures, the static references, and the derived figures."""
    n = len(rows)
    ratio = evo["hit_rate"] / static["hit_rate"] if static["hit_rate"] else None
    judge_per_query = evo["judge_calls"] / n
    return {"run": run, "stream": stream, "order": order, "seed": seed, "delta": delta, "n": n, "stream_n": of,
            "learnt_on": learnt_on, "warmup_n": warmup_n,
            "evocache": evo, "best_static": static, "transferred_static": transferred, "ratio": ratio,
            "judge_per_query": judge_per_query, "delta_spent": evo["error_rate"] / delta,
            "meets": (evo["error_rate"] <= delta and ratio is not None and ratio >= TARGET_RATIO
                      and judge_per_query <= JUDGE_BUDGET)}


def generalisation_markdown(rows: list[dict]) -> str:
    lines = ["| run | stream | order | n | learnt on | δ | hit | error | δ spent | judge / query | static t | "
             "static hit | ratio | transferred t: hit / error |", "|" + "---|" * 14]
    for r in rows:
        e, s, t = r["evocache"], r["best_static"], r["transferred_static"]
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        moved = "" if t is None else f"{t['threshold']}: {t['hit_rate']:.3f} / {t['error_rate']:.4f}"
        lines.append(f"| {r['run']} | {r['stream']} | {r['order']} | {r['n']} | {r['learnt_on'] or ''} | "
                     f"{r['delta']:g} | {e['hit_rate']:.3f} | {e['error_rate']:.4f} | {r['delta_spent']:.2f} | "
                     f"{r['judge_per_query']:.2f} | {s['threshold']} | {s['hit_rate']:.3f} | {ratio} | {moved} |")
    return "\n".join(lines) + "\n"


def _markdown(rows: list[dict], pairs: dict | None) -> str:
    lines = ["| stream | order | seed | δ | evocache hit | error | explore calls | judge calls | static t | static hit "
             "| static error | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, s = r["evocache"], r["best_static"]
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['stream']} | {r['order']} | {r['seed']} | {r['delta']:g} | {e['hit_rate']:.3f} | "
                     f"{e['error_rate']:.4f} | {e['exploration_calls']} | {e['judge_calls']} | {s['threshold']} | "
                     f"{s['hit_rate']:.3f} | {s['error_rate']:.4f} | {ratio} |")
    if pairs is not None:
        lines += ["", f"fow traps at δ = {pairs['delta']:g}, pair seed {pairs['seed']} (b served / traps served, of "
                  "the pairs in the category)",
                  "", "Traps served are wrong answers served for a trap's b; an exact hit (the same text stored for "
                  "another pair) is that text's own answer. The pairs' scope's error per lookup (a and b): warm "
                  f"{pairs['warm']['error_rate']:.4f}, cold {pairs['cold']['error_rate']:.4f} "
                  f"(of {pairs['cold']['lookups']} lookups).",
                  "", "| category | pairs | evocache warm | evocache cold | " + " | ".join(
                      f"static {t}" for t in pairs["static"]) + " |",
                  "|---|---|---|---|" + "---|" * len(pairs["static"])]
        for name, c in pairs["warm"]["categories"].items():
            cold = pairs["cold"]["categories"][name]
            cells = [f"{c['hits']} / {c['traps_served']}", f"{cold['hits']} / {cold['traps_served']}"]
            cells += [f"{cats[name]['hits']} / {cats[name]['traps_served']}" for cats in pairs["static"].values()]
            lines.append(f"| {name} | {c['pairs']} | " + " | ".join(cells) + " |")
        traps = [name for name, c in pairs["warm"]["categories"].items() if c["trap_rate"] is not None]
        if len(pairs["seeds"]) > 1:
            lines += ["", "Traps served per pair seed (" + " / ".join(traps) + "):", ""]
            for seed, runs in pairs["seeds"].items():
                cells = [" / ".join(str(runs[kind]["categories"][name]["traps_served"]) for name in traps)
                         + f" (error per lookup {runs[kind]['error_rate']:.4f})" for kind in ("cold", "warm")]
                lines.append(f"- seed {seed}: cold {cells[0]}; warm {cells[1]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
