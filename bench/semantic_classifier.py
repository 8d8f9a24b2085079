"""The answer classifier against the nearest neighbour's cosine: the share of queries each serves at a
precision.

The analysis behind docs/semantic.md, 'Answer classifier'.

    .venv/bin/python bench/semantic_classifier.py [--streams banking77,clinc150] [--precision 0.98]
        [--json OUT]

Per stream, in order, with the true answer groups as labels (which a cache never has): the first half's
prompts train the model the cache fits per scope (``fit_clusters``: a softmax regression over the MiniLM
embeddings, C = 10), and the second half's prompts are the queries. Each method names a group with a
confidence:

- ``classifier``: the class with the largest share, and that share;
- ``nearest``: the group of the most similar first-half prompt, and its cosine.

Served most confident first, ``served`` is the largest share of the queries whose served part is right at
least ``--precision`` of the time. Also printed: the classes, and the median time of one lookup's shares
(``AnswerClassifier.shares``, one query at a time, as the request path asks; wall-clock on this host, whatever
else runs on it). Embeddings are cached under .evocache/embeddings, as bench/semantic.py does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _bench_semantic() -> ModuleType:
    """bench/semantic.py (a sibling script, not a package module): its streams, one definition."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_semantic", Path(__file__).with_name("semantic.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def served(confidence: np.ndarray, correct: np.ndarray, precision: float) -> float:
    """The largest share of queries served, most confident first, whose served part is right at least
    ``precision`` of the time (0 when no prefix is)."""
    order = np.argsort(-confidence, kind="stable")
    right = np.cumsum(correct[order])
    ok = np.nonzero(right >= precision * np.arange(1, len(order) + 1))[0]
    return 0.0 if len(ok) == 0 else (ok[-1] + 1) / len(order)


def compare(groups: Sequence[str], vecs: np.ndarray, precision: float) -> dict[str, Any]:
    """Train on the first half, query the second: the share each method serves at ``precision``, the classes,
    and the median seconds of one lookup's shares."""
    from evocache.controller.semantic._classify import AnswerClassifier

    half = len(groups) // 2
    train, queries = list(groups[:half]), np.array(groups[half:])
    classifier = AnswerClassifier()
    scope = "stream"
    classifier.fit(scope, vecs[:half], train, {g: (g,) for g in set(train)})
    model = classifier.probabilities(scope, vecs[half])
    assert model is not None
    classes = np.array([members[0] for members in model[0].members])
    shares, seconds = [], []
    for vec in vecs[half:]:
        start = time.perf_counter()
        found = classifier.shares(scope, vec, lambda member: member, lambda member: True)
        seconds.append(time.perf_counter() - start)
        assert found is not None
        shares.append(found)
    best = [max(s, key=s.__getitem__) for s in shares]
    classifier_conf = np.array([s[b] for s, b in zip(shares, best, strict=True)])
    classifier_right = np.array(best) == queries
    sims = vecs[half:] @ vecs[:half].T
    nearest = sims.argmax(axis=1)
    nearest_right = np.array(train)[nearest] == queries
    return {
        "train": half, "queries": len(queries), "classes": len(classes),
        "classifier": served(classifier_conf, classifier_right, precision),
        "nearest": served(sims[np.arange(len(queries)), nearest], nearest_right, precision),
        "shares_median_s": float(np.median(seconds)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--streams", default="banking77,clinc150",
                        help="known stream names or JSONL files of prompt and group rows, comma-separated")
    parser.add_argument("--precision", type=float, default=0.98)
    parser.add_argument("--embed-cache", type=Path, default=ROOT / ".evocache" / "embeddings")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.precision <= 1:
        parser.error(f"--precision must be in (0, 1], got {args.precision}")
    known: dict[str, Path] = _bench_semantic().STREAMS
    streams = {name: known.get(name, Path(name)) for name in args.streams.split(",")}
    unknown = [name for name, path in streams.items() if not path.is_file()]
    if unknown:
        parser.error(f"unknown streams {unknown}: neither a known one ({', '.join(known)}) nor a file")

    from evocache.controller.semantic import SentenceTransformerEmbedder
    from evocache.controller.semantic._bench import VectorTable, embed_cached, read_rows

    embedder = SentenceTransformerEmbedder()
    rows_out = []
    print(f"| stream | train | queries | classes | served at {args.precision:g} precision: classifier | "
          "nearest neighbour's cosine | shares per lookup (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, path in streams.items():
        rows = read_rows(path)
        texts = list(dict.fromkeys(r.prompt for r in rows))
        table = VectorTable(texts, embed_cached(texts, embedder, args.embed_cache), embedder.name)
        found = compare([r.group for r in rows], table.embed([r.prompt for r in rows]), args.precision)
        rows_out.append({"stream": name, "precision": args.precision, **found})
        cost = f"{1000 * found['shares_median_s']:.3f} ms"
        print(f"| {name} | {found['train']} | {found['queries']} | {found['classes']} | "
              f"{found['classifier']:.2f} | {found['nearest']:.2f} | {cost} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows_out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
