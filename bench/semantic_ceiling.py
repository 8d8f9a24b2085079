"""How far a hit rate of 1.25x the best static threshold is from what any neighbour-based cache could reach.

The analysis behind docs/semantic.md, 'Ceiling'.

    .venv/bin/python bench/semantic_ceiling.py [--streams banking77,clinc150] [--deltas 0.01,0.02,0.05]
                                               [--prefixes 1000,3000 --orders 100,101,102]
    .venv/bin/python bench/semantic_ceiling.py --losses [--prefixes 1000,3000 --orders 100,101,102]

With ``--prefixes``, the same for the first N queries of each stream in each order (``--orders``: the seeds
that shuffle it, as the generalisation runs of bench/semantic.py do; default the order as shipped): how far the
target is on a short stream, where the oracle too has stored less.

A *label oracle* that no real cache can be: it stores every prompt (hits included) and knows the true answer
group of every stored prompt. For each query it predicts the group by a similarity-weighted vote of its 10
nearest earlier prompts (weight exp(20 (s - s1)), s1 the nearest one's similarity) and scores its confidence as
the mean of the winning share and s1. In hindsight it serves the queries in order of confidence until delta x
queries wrong answers are spent: its hit rate is the *label-oracle frontier*. It pays nothing for exploration.

Printed next to it: the best static threshold of `bench/semantic.py` (stored on miss, as the bench replays it;
chosen in hindsight), the 1.25x that the target asks, and that as a share of the frontier. A real cache learns
the groups only through its judge, stores only misses and explores about 5 % of its would-be hits, so a target
near the frontier is out of its reach whatever its decision rule.

With ``--losses``, what each part of the real cache costs a short stream, at delta 0.02: the generalisation runs
of bench/semantic.py (each stream's prefixes in each order, cold and after the other stream's first 3,000
queries, the prior fitted without the stream) replayed side by side with the same cache made less careful one
part at a time, each step keeping the ones before: "known ratio", the calibration fixed at 1 (the error model's
estimates taken as they are, as if the ratio of wrong answers to estimates were known: what the confidence
sequence's width costs); "no exploration", nothing explored (what the uniform sample costs); "unbounded judge",
no judge budget (what the budget's cut link searches cost). The steps after the first are not valid caches:
nothing bounds their error, which is printed next to their hit rate.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _bench_semantic() -> ModuleType:
    """bench/semantic.py (a sibling script, not a package module): its streams and target, one definition."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_semantic", Path(__file__).with_name("semantic.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BENCH = _bench_semantic()
STREAMS: dict[str, Path] = _BENCH.STREAMS
TARGET_RATIO: float = _BENCH.TARGET_RATIO


def frontier(confidence: np.ndarray, correct: np.ndarray, delta: float) -> float:
    """The largest share of queries served, most confident first, with at most delta x queries wrong."""
    servable = np.isfinite(confidence)  # a query with nothing stored before it is never served
    order = np.argsort(-confidence[servable], kind="stable")
    wrong = np.cumsum(~correct[servable][order])
    allowed = np.nonzero(wrong <= delta * len(correct))[0]
    return 0.0 if len(allowed) == 0 else (allowed[-1] + 1) / len(correct)


def label_oracle(groups: list[str], vecs: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Per query: the vote's confidence and whether its predicted group is the query's own (the first query,
    with nothing stored, is never served)."""
    from evocache.controller.semantic._bench import prior_neighbours

    idx, sims = prior_neighbours(vecs, k=k)
    labels = np.array([hash(g) for g in groups])
    confidence = np.full(len(groups), -np.inf)
    correct = np.zeros(len(groups), dtype=bool)
    for i in range(1, len(groups)):
        valid = idx[i] >= 0
        nearest, s = idx[i][valid], sims[i][valid].astype(np.float64)
        weights = np.exp(20.0 * (s - s[0]))
        votes: dict[int, float] = {}
        for j, w in zip(nearest, weights, strict=True):
            votes[labels[j]] = votes.get(labels[j], 0.0) + w
        best = max(votes, key=votes.__getitem__)
        confidence[i] = 0.5 * votes[best] / weights.sum() + 0.5 * s[0]
        correct[i] = best == labels[i]
    return confidence, correct


LOSS_STEPS = ("as shipped", "known ratio", "no exploration", "unbounded judge")


def losses(streams: list[str], prefixes: list[int], orders: list[int], embed_cache: Path, delta: float = 0.02) -> int:
    """The ``--losses`` table (module docstring): one row per step, prefix length and run kind."""
    from evocache.controller.semantic import SentenceTransformerEmbedder
    from evocache.controller.semantic._bench import best_static, embedded_table, read_rows, replay_prefixes
    from evocache.controller.semantic._pacing import Calibration
    from evocache.controller.semantic._policies import PolicyOptions

    class KnownRatio(Calibration):
        """A calibration that never widens: the model's estimates at face value."""

        @property
        def value(self) -> float:
            return 1.0

        @property
        def bounded(self) -> bool:
            return True

    rows = {name: read_rows(STREAMS[name]) for name in STREAMS}
    table = embedded_table([list(dict.fromkeys(r.prompt for r in stream)) for stream in rows.values()],
                           SentenceTransformerEmbedder(), embed_cache)
    results: dict[tuple[str, int, str], list[tuple[float, float, float, float]]] = {}
    for name in streams:
        other = next(o for o in STREAMS if o != name)
        for order in orders:
            stream = list(rows[name])
            random.Random(order).shuffle(stream)
            stream = stream[: max(prefixes)]
            statics = {n: best_static(stream[:n], table.embed([r.prompt for r in stream[:n]]), [delta])[delta]
                       for n in prefixes}
            for warm in (None, other):
                for step, label in enumerate(LOSS_STEPS):
                    policy = PolicyOptions(explore=0.0 if step >= 2 else 0.05,
                                           prior=_BENCH.held_out_prior(name)).build()
                    if step >= 1:
                        policy.calibration = KnownRatio(prior=policy.calibration.prior)
                    reports = replay_prefixes(stream, table, delta, prefixes, seed=order, policy=policy,
                                              warmup=rows[warm][:3000] if warm else (),
                                              judge_budget=None if step >= 3 else 2.0)
                    for n, evo in zip(prefixes, reports, strict=True):
                        static = statics[n]["hit_rate"]
                        ratio = evo["hit_rate"] / static if static else math.nan  # nothing static serves: n/a
                        kind = "cross" if warm else "prefix"
                        results.setdefault((label, n, kind), []).append(
                            (ratio, evo["error_rate"], evo["exploration_calls"] / n, evo["judge_calls"] / n))
                        print(f"[{label}: {kind} {name} {order} n {n}] hit {evo['hit_rate']:.3f} err "
                              f"{evo['error_rate']:.4f} ratio {ratio:.2f}", file=sys.stderr, flush=True)
    print(f"| step | queries | run | runs | ratio, mean (min-max) | error, max (δ {delta:g}) | explored / query | "
          "judge calls / query |")
    print("|---|---|---|---|---|---|---|---|")
    for (label, n, kind), got in results.items():
        ratios = [g[0] for g in got]
        print(f"| {label} | {n} | {kind} | {len(got)} | {np.mean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{max(g[1] for g in got):.4f} | {np.mean([g[2] for g in got]):.3f} | "
              f"{np.mean([g[3] for g in got]):.2f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--streams", default="banking77,clinc150")
    parser.add_argument("--deltas", default="0.01,0.02,0.05")
    parser.add_argument("--embed-cache", type=Path, default=ROOT / ".evocache" / "embeddings")
    parser.add_argument("--prefixes", default="", help="first N queries, comma-separated (default: whole streams)")
    parser.add_argument("--orders", default="", help="shuffle seeds, comma-separated (default: as shipped)")
    parser.add_argument("--losses", action="store_true",
                        help="what each part of the cache costs short streams at δ 0.02 (module docstring)")
    args = parser.parse_args()
    prefixes = [int(n) for n in args.prefixes.split(",") if n.strip()] or [None]
    orders = [int(n) for n in args.orders.split(",") if n.strip()] or [None]
    if args.losses:  # short streams in the generalisation runs' orders unless told otherwise
        return losses(args.streams.split(","), [1000, 3000] if prefixes == [None] else prefixes,
                      [100, 101, 102] if orders == [None] else orders, args.embed_cache)

    from evocache.controller.semantic import SentenceTransformerEmbedder
    from evocache.controller.semantic._bench import VectorTable, best_static, embed_cached, read_rows

    deltas = [float(d) for d in args.deltas.split(",")]
    embedder = SentenceTransformerEmbedder()
    print("| stream | order | queries | δ | label-oracle frontier | best static (hindsight) | 1.25x static | "
          "share of the frontier |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.streams.split(","):
        shipped = read_rows(STREAMS[name])
        texts = list(dict.fromkeys(r.prompt for r in shipped))
        table = VectorTable(texts, embed_cached(texts, embedder, args.embed_cache), embedder.name)
        for order in orders:
            rows = list(shipped)
            if order is not None:
                random.Random(order).shuffle(rows)
            for n in prefixes:
                part = rows if n is None else rows[:n]
                vecs = table.embed([r.prompt for r in part])
                confidence, correct = label_oracle([r.group for r in part], vecs)
                static = best_static(part, vecs, deltas)
                for delta in deltas:
                    ceiling = frontier(confidence, correct, delta)
                    needed = TARGET_RATIO * static[delta]["hit_rate"]
                    share = f"{needed / ceiling:.0%}" if ceiling else "n/a"
                    print(f"| {name} | {'as shipped' if order is None else order} | {len(part)} | {delta:g} | "
                          f"{ceiling:.3f} | {static[delta]['hit_rate']:.3f} | {needed:.3f} | {share} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
