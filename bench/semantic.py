"""The semantic-caching figures of issue 4 (error bound, hit rate against the best static threshold, fow traps).

    .venv/bin/python bench/semantic.py [--streams banking77,clinc150] [--deltas 0.01,0.02,0.05]
                                       [--seeds 0,1,2] [--shuffled 1] [--pairs-seeds 0] [--out DIR]
                                       [--embed-cache DIR]

(a) For each stream (examples/data/banking77_train.jsonl, bench/data/clinc150_train.jsonl), each delta and each
    seed: evocache's hit rate, error rate, exploration and judge calls, against the best static threshold
    meeting the same delta on the same stream, chosen in hindsight. ``--shuffled N`` adds N runs per
    (stream, delta) on the stream shuffled by seeds 100, 101, ... (another arrival order; its own hindsight
    static threshold). A row fails the target when error > delta or hit rate < 1.25x the static one.
(b) fow traps (bench/data/fow_traps.jsonl) at delta 0.02: b served and traps served per category, the error
    model warmed on the Banking77 stream (``--warmup``), and the static thresholds next to it, for the first of
    ``--pairs-seeds`` (pair orders); with more seeds, one line of traps served per seed, cold and warm.

Every row is computed by the same code `evocache bench semantic` runs (``controller/semantic/_bench.py``); the
embeddings are computed once per text set and kept under ``--embed-cache`` (default ``.evocache/embeddings``).
Results go to ``--out`` (JSON per part, and ``semantic.md``, the table for the README).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STREAMS = {
    "banking77": ROOT / "examples" / "data" / "banking77_train.jsonl",
    "clinc150": ROOT / "bench" / "data" / "clinc150_train.jsonl",
}
PAIRS = ROOT / "bench" / "data" / "fow_traps.jsonl"
TARGET_RATIO = 1.25


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--streams", default="banking77,clinc150")
    parser.add_argument("--deltas", default="0.01,0.02,0.05")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--shuffled", type=int, default=1, help="extra runs per (stream, delta) on shuffled orders")
    parser.add_argument("--pairs-delta", type=float, default=0.02)
    parser.add_argument("--pairs-seeds", default="0",
                        help="pair orders to replay (the first one's table is printed in full; each seed gets a line)")
    parser.add_argument("--no-pairs", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / ".evocache" / "bench-semantic")
    parser.add_argument("--embed-cache", type=Path, default=ROOT / ".evocache" / "embeddings")
    args = parser.parse_args()

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

    args.out.mkdir(parents=True, exist_ok=True)
    deltas = [float(d) for d in args.deltas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    embedder = SentenceTransformerEmbedder()
    rows_out = []
    for name in args.streams.split(","):
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
                evo = replay_stream(stream, table, delta, seed=seed)
                static = statics[order][delta]
                ratio = evo["hit_rate"] / static["hit_rate"] if static["hit_rate"] else None
                row = {"stream": name, "order": order, "seed": seed, "delta": delta, "n": len(stream),
                       "oracle_hit_rate": oracle_hit_rate(stream), "evocache": evo, "best_static": static,
                       "ratio": ratio,
                       "meets": evo["error_rate"] <= delta and ratio is not None and ratio >= TARGET_RATIO}
                rows_out.append(row)
                print(f"[{name} {order} seed {seed} delta {delta}] hit {evo['hit_rate']:.4f} err "
                      f"{evo['error_rate']:.4f} | static {static['threshold']} hit {static['hit_rate']:.4f} err "
                      f"{static['error_rate']:.4f} | ratio {ratio:.2f} | {time.perf_counter() - t0:.0f}s",
                      file=sys.stderr, flush=True)
                (args.out / "streams.json").write_text(json.dumps(rows_out, indent=2) + "\n")

    pairs_report = None
    if not args.no_pairs:
        pairs = read_rows(PAIRS)
        warm = read_rows(STREAMS["banking77"])
        texts = list(dict.fromkeys([t for p in pairs for t in (p.a, p.b)] + [r.prompt for r in warm]))
        table = VectorTable(texts, embed_cached(texts, embedder, args.embed_cache), embedder.name)
        pair_seeds = [int(s) for s in args.pairs_seeds.split(",")]
        by_seed = {seed: {"warm": replay_pairs(pairs, table, args.pairs_delta, seed=seed, warmup=warm),
                          "cold": replay_pairs(pairs, table, args.pairs_delta, seed=seed)} for seed in pair_seeds}
        pairs_report = {
            "delta": args.pairs_delta,
            "seed": pair_seeds[0],
            "warm": by_seed[pair_seeds[0]]["warm"],
            "cold": by_seed[pair_seeds[0]]["cold"],
            "seeds": {str(seed): runs for seed, runs in by_seed.items()},
            "static": {f"{t:g}": replay_pairs(pairs, table, args.pairs_delta, mode="static", threshold=t)["categories"]
                       for t in (0.8, 0.85, 0.9, 0.95)},
        }
        (args.out / "pairs.json").write_text(json.dumps(pairs_report, indent=2) + "\n")

    (args.out / "semantic.md").write_text(_markdown(rows_out, pairs_report))
    print((args.out / "semantic.md").read_text())
    return 0


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
