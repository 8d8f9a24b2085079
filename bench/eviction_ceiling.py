"""What the learned eviction policy can and cannot predict on a KV-block trace: the analysis behind
docs/eviction.md, "What it can predict".

    .venv/bin/python bench/eviction_ceiling.py [--trace FILE] [--sizes 0.01,0.05,0.1] [--slices-at 0.05]
        [--slice 20000] [--retrain-every N] [--output-lengths] [--json OUT]

Per size (a fraction of the trace's distinct blocks, unit sizes), four replays: LRU; Belady; the learned
policy with its defaults, which decides exactly as ``make_eviction_policy("learned")`` does and is only
watched (every training sample's features and horizon are kept, and after every retraining the model's ROC
AUC on the samples it had not seen, ``LearnedStats.auc``); and the *oracle classifier*: the learned policy's
structure (averse leaves first, least recently used within each class) with the model replaced by the true
label, averse iff the accessed block is not accessed again within ``horizon x held`` accesses
(docs/eviction.md, "Labels"). "Gap" is (policy - LRU) / (Belady - LRU).

At ``--slices-at``, per slice of ``--slice`` accesses (a remainder shorter than half a slice joins the last
one), on the learned policy's own samples and labels:

- ``reuse``: the share of accesses whose block returns within the horizon (the label's positive rate);
- the ROC AUC of each single feature (``_features.FEATURES``; NaN, a missing value, ranks lowest; "-" for a
  feature constant in the slice): above 0.5 a larger value means likelier reuse, below 0.5 a smaller one;
  and the feature that ranks best either way (the larger of AUC and 1 - AUC);
- ``head``: the AUC of a *head oracle*, 1 when the first block of the access's request (its document) begins
  a request again within the horizon;
- ``rate``: the AUC of each document's true lifetime request rate (its requests - 1 over the accesses from
  its first request to its last, future included; 0 for a document requested once).

Of the trace alone: the median distance, in accesses, from a block's first access to its second; the median
coefficient of variation of the gaps between a document's requests (documents with at least 4); the
quartiles of ``head_requests`` at the accesses; and, when the trace gives output lengths (Mooncake), the
share of new blocks (a block's first access) ever accessed again, by the request's output length, and for
short answers (under 60 tokens) by the length of the request's new part (``req_new``).

Deterministic. On bench/data/mooncake_synthetic_trace.jsonl it takes a few minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from evocache.controller.eviction import (
    EVICTION_POLICIES,
    BuildContext,
    EntryInfo,
    LearnedModel,
    LearnedPolicy,
    LearnedTraining,
)
from evocache.controller.eviction._features import FEATURES
from evocache.controller.eviction._history import auc
from evocache.controller.eviction._learned_classify import AVERSE, FRIENDLY
from evocache.controller.replay import Access, belady_unit, read_trace, replay, working_set

OUTPUT_BUCKETS = ((0, 20), (20, 40), (40, 60), (60, 200), (200, math.inf))
"""Output lengths in tokens, [low, high), of the new-block table."""
NEW_PART_BUCKETS = ((1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, math.inf))
"""Lengths in blocks of a short answer's new part, [low, high)."""
SHORT_ANSWER = 60
"""Output tokens under which a request is a short answer."""


class WatchedLearned(LearnedPolicy):
    """The learned policy, deciding as it does, keeping each training sample's features and horizon (one per
    access, in access order) and the model's AUC after each retraining."""

    name = "watched-learned"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.rows: list[np.ndarray] = []
        self.horizons: list[float] = []
        self.aucs: list[float] = []

    def _learn(self, key: Hashable, info: EntryInfo | None, slot: int, tick: int, horizon: float) -> None:
        super()._learn(key, info, slot, tick, horizon)
        j = (self._samples.next_id - 1) % self._samples.ring
        self.rows.append(self._samples.rows[j].copy())
        self.horizons.append(horizon)

    def _judge(self, model: LearnedModel | None, rows: np.ndarray, reused: np.ndarray, first: int) -> None:
        super()._judge(model, rows, reused, first)
        if model is not None:
            self.aucs.append(self._auc)


class OracleClassifier(LearnedPolicy):
    """The learned policy's structure with a perfect classifier: the block accessed at access ``tick`` (the
    replay announces every access, so ``tick - 1`` is its index in the trace) is averse iff its next access is
    more than ``horizon`` accesses away (``next_access``: the index of each access's next one, inf for none).
    It never trains, and its classes decide from the first access."""

    name = "oracle-classifier"

    def __init__(self, *, next_access: np.ndarray, **options: Any) -> None:
        super().__init__(**options)
        self._next_access = next_access

    def _learn(self, key: Hashable, info: EntryInfo | None, slot: int, tick: int, horizon: float) -> None:
        i = tick - 1
        self._classified = (key, AVERSE if self._next_access[i] - i > horizon else FRIENDLY)

    def victim(self, ns: str | None = None) -> Hashable:
        return self._victim(None, ns)  # type: ignore[arg-type]  # the classify structure reads no model


class TraceIndex(NamedTuple):
    """The trace as arrays: per access the next access's index (inf: none), whether it is the block's first
    access, its request's row in the per-request arrays; per request its start, its head's row, its output
    length and its new part's length; per head its request starts (in order). A NamedTuple, not a dataclass:
    tests load this script by path, outside ``sys.modules``, where a dataclass cannot resolve its
    annotations."""

    next_access: np.ndarray
    first_access: np.ndarray
    request_of: np.ndarray
    starts: np.ndarray
    head_of: np.ndarray
    req_out: np.ndarray
    req_new: np.ndarray
    head_starts: list[np.ndarray]


def index(trace: Sequence[Access]) -> TraceIndex:
    n = len(trace)
    ids: dict[Hashable, int] = {}
    keys = np.array([ids.setdefault((a.ns, a.key) if a.ns else a.key, len(ids)) for a in trace])
    order = np.lexsort((np.arange(n), keys))
    same = keys[order[1:]] == keys[order[:-1]]
    next_access = np.full(n, np.inf)
    next_access[order[:-1][same]] = order[1:][same]
    first_access = np.ones(n, dtype=bool)
    first_access[order[1:][same]] = False
    req = np.array([a.req for a in trace])
    if (req < 0).any():
        raise ValueError("the trace must be a KV-block trace: every access with a request number (Mooncake)")
    boundary = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
    request_of = np.cumsum(np.r_[True, req[1:] != req[:-1]]) - 1
    head_of = np.unique(keys[boundary], return_inverse=True)[1]
    req_out = np.array([trace[s].req_out for s in boundary])
    ends = np.r_[boundary[1:], n]
    new_at = np.where(first_access, np.arange(n), n)
    first_new = np.minimum.reduceat(new_at, boundary)
    req_new = np.where(first_new < ends, ends - first_new, 0)
    by_head = np.argsort(head_of, kind="stable")
    splits = np.flatnonzero(np.diff(head_of[by_head])) + 1
    head_starts = [boundary[rows] for rows in np.split(by_head, splits)]
    return TraceIndex(next_access, first_access, request_of, boundary, head_of, req_out, req_new, head_starts)


def gap(policy: float, lru: float, belady: float) -> float | None:
    return (policy - lru) / (belady - lru) if belady > lru else None


def slices(n: int, length: int) -> list[tuple[int, int]]:
    bounds = list(range(0, n, length)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < length / 2:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    if np.all(scores == scores[0]) or labels.all() or not labels.any():
        return None
    return auc(scores, labels)


def slice_rows(ix: TraceIndex, rows: np.ndarray, horizons: np.ndarray, length: int) -> list[dict[str, Any]]:
    n = len(horizons)
    positions = np.arange(n)
    labels = ix.next_access - positions <= horizons
    head = ix.head_of[ix.request_of]
    # The next request of each access's document after the access's own request (a head's requests in order).
    next_start = np.full(len(ix.starts), np.inf)
    for starts_of_head in ix.head_starts:
        if len(starts_of_head) > 1:
            next_start[np.searchsorted(ix.starts, starts_of_head[:-1])] = starts_of_head[1:]
    head_oracle = (next_start[ix.request_of] - positions <= horizons).astype(float)
    rates = np.array([(len(s) - 1) / max(s[-1] - s[0], 1) for s in ix.head_starts])
    rate = rates[head]
    features = np.where(np.isnan(rows), -np.inf, rows)
    out = []
    for lo, hi in slices(n, length):
        y = labels[lo:hi]
        aucs = {name: _auc(features[lo:hi, f], y) for f, name in enumerate(FEATURES)}
        ranked = {name: max(a, 1 - a) for name, a in aucs.items() if a is not None}
        best = max(ranked, key=ranked.__getitem__) if ranked else None
        out.append({
            "start": lo, "end": hi, "reuse": float(y.mean()), "auc": aucs,
            "best": None if best is None else {"feature": best, "auc": ranked[best]},
            "head": _auc(head_oracle[lo:hi], y), "rate": _auc(rate[lo:hi], y),
        })
    return out


def documents(ix: TraceIndex, head_requests: np.ndarray) -> dict[str, Any]:
    cvs = [float(np.std(g) / np.mean(g)) for g in (np.diff(s) for s in ix.head_starts if len(s) >= 4)]
    return {
        "documents": len(ix.head_starts),
        "documents_with_4_requests": len(cvs),
        "median_gap_cv": float(np.median(cvs)) if cvs else None,
        "head_requests_quartiles": [float(q) for q in np.nanpercentile(head_requests, (25, 50, 75))],
    }


def new_blocks(ix: TraceIndex) -> dict[str, list[dict[str, Any]]] | None:
    if (ix.req_out < 0).all():
        return None
    new = ix.first_access
    returns = np.isfinite(ix.next_access)
    out_len = ix.req_out[ix.request_of]
    new_part = ix.req_new[ix.request_of]

    def table(values: np.ndarray, chosen: np.ndarray, buckets: tuple[tuple[float, float], ...]) -> list[dict]:
        rows = []
        for lo, hi in buckets:
            blocks = chosen & (values >= lo) & (values < hi)
            rows.append({"low": lo, "high": None if hi == math.inf else hi, "blocks": int(blocks.sum()),
                         "returning": float(returns[blocks].mean()) if blocks.any() else None})
        return rows

    return {"by_output_length": table(out_len, new, OUTPUT_BUCKETS),
            "short_answer_by_new_part": table(new_part, new & (out_len < SHORT_ANSWER), NEW_PART_BUCKETS)}


def second_access_distance(ix: TraceIndex) -> float | None:
    firsts = np.flatnonzero(ix.first_access & np.isfinite(ix.next_access))
    return float(np.median(ix.next_access[firsts] - firsts)) if len(firsts) else None


def run(trace: list[Access], sizes: list[float], slices_at: float, length: int, training: LearnedTraining,
        output_lengths: bool) -> dict[str, Any]:
    ix = index(trace)
    policies = {**EVICTION_POLICIES, WatchedLearned.name: WatchedLearned,
                OracleClassifier.name: OracleClassifier}
    replayed = trace if output_lengths else [a._replace(req_out=-1) for a in trace]
    objects = working_set(trace).objects
    result: dict[str, Any] = {"accesses": len(trace), "objects": objects,
                              "output_lengths": output_lengths, "sizes": []}
    for size in sizes:
        capacity = max(1, int(size * objects))
        watched: list[WatchedLearned] = []

        def build(name: str, **kw: Any) -> Any:
            def factory(*, clock: Any, rng: Any) -> Any:
                policy = BuildContext(policies, capacity=capacity, clock=clock, rng=rng).build(name, **kw)
                if isinstance(policy, WatchedLearned):
                    watched.append(policy)
                return policy
            return factory

        lru = replay(replayed, "lru", capacity_objects=capacity).hit_ratio
        best = belady_unit(replayed, capacity).hit_ratio
        learned = replay(replayed, build(WatchedLearned.name, training=training),
                         capacity_objects=capacity).hit_ratio
        oracle = replay(replayed, build(OracleClassifier.name, training=training, next_access=ix.next_access),
                        capacity_objects=capacity).hit_ratio
        policy = watched[0]
        aucs = [a for a in policy.aucs if not math.isnan(a)]
        result["sizes"].append({
            "size": size, "capacity": capacity, "lru": lru, "belady": best, "learned": learned,
            "oracle": oracle,
            "learned_gap": gap(learned, lru, best), "oracle_gap": gap(oracle, lru, best),
            "model_auc": aucs,
        })
        if size == slices_at:
            rows, horizons = np.array(policy.rows), np.array(policy.horizons)
            result["slices"] = {"size": size, "slice": length, "rows": slice_rows(ix, rows, horizons, length)}
            result["documents"] = documents(ix, rows[:, FEATURES.index("head_requests")])
        print(_size_line(result["sizes"][-1]), flush=True)
    result["second_access_distance"] = second_access_distance(ix)
    result["new_blocks"] = new_blocks(ix)
    return result


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} %"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _size_line(row: dict[str, Any]) -> str:
    aucs = row["model_auc"]
    model = "-"
    if aucs:
        median = float(np.median(aucs))
        model = f"{min(aucs):.2f}-{max(aucs):.2f}, median {median:.2f} over {len(aucs)} trainings"
    return (f"size {row['size']:g} (capacity {row['capacity']}): "
            f"lru {row['lru']:.4f} belady {row['belady']:.4f} "
            f"learned {row['learned']:.4f} ({_pct(row['learned_gap'])} of the gap, model AUC {model}) "
            f"oracle classifier {row['oracle']:.4f} ({_pct(row['oracle_gap'])} of the gap)")


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['accesses']} accesses, {result['objects']} distinct blocks; median distance from a "
             f"block's first access to its second: {_num(result['second_access_distance'], 0)} accesses"]
    sliced = result["slices"]
    lines += ["", f"per slice of {sliced['slice']} accesses, at size {sliced['size']:g}: reuse within the "
              "horizon, the ROC AUC of each feature, of the head oracle and of the documents' lifetime rate",
              "| feature | " + " | ".join(f"{r['start']}-{r['end']}" for r in sliced["rows"]) + " |",
              "|---" * (len(sliced["rows"]) + 1) + "|",
              "| reuse | " + " | ".join(f"{100 * r['reuse']:.1f} %" for r in sliced["rows"]) + " |"]
    for name in (*FEATURES, "head", "rate"):
        cells = [r["auc"][name] if name in r["auc"] else r[name] for r in sliced["rows"]]
        lines.append(f"| {name} | " + " | ".join(_num(c) for c in cells) + " |")
    best = ["-" if r["best"] is None else f"{r['best']['feature']} {r['best']['auc']:.2f}"
            for r in sliced["rows"]]
    lines.append("| best single feature, either direction | " + " | ".join(best) + " |")
    docs = result["documents"]
    lines += ["", f"{docs['documents']} documents; median coefficient of variation of the gaps between a "
              f"document's requests: {_num(docs['median_gap_cv'])} "
              f"({docs['documents_with_4_requests']} documents with at least 4 requests); "
              "head_requests at the accesses, quartiles: "
              + " / ".join(f"{q:g}" for q in docs["head_requests_quartiles"])]
    tables = result["new_blocks"]
    if tables is not None:
        short = (f"new blocks of short answers (< {SHORT_ANSWER} tokens) ever accessed again, by the "
                 "length of the request's new part")
        for title, rows, unit in (
            ("new blocks ever accessed again, by output length", tables["by_output_length"], "tokens"),
            (short, tables["short_answer_by_new_part"], "blocks"),
        ):
            lines += ["", title]
            for r in rows:
                if r["high"] is None:
                    span = f">= {r['low']:g}"
                elif r["high"] == r["low"] + 1:
                    span = f"{r['low']:g}"
                else:
                    span = f"{r['low']:g}-{r['high'] - 1:g}"
                share = "-" if r["returning"] is None else f"{100 * r['returning']:.0f} %"
                lines.append(f"  {unit} {span}: {share} of {r['blocks']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="bench/data/mooncake_synthetic_trace.jsonl")
    parser.add_argument("--sizes", default="0.01,0.05,0.1", help="fractions of the distinct blocks")
    parser.add_argument("--slices-at", type=float, default=0.05,
                        help="the size (one of --sizes) of the slices")
    parser.add_argument("--slice", type=int, default=20_000, help="accesses per slice")
    parser.add_argument("--retrain-every", type=int, default=LearnedTraining().retrain_every,
                        help="the learned policy's retraining period, in accesses")
    parser.add_argument("--output-lengths", action="store_true",
                        help="tell the policies each request's output length at its completion")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT",
                        help="also write the figures as JSON")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.slices_at not in sizes:
        parser.error(f"--slices-at {args.slices_at:g} must be one of --sizes {args.sizes}")
    if args.slice < 1:
        parser.error(f"--slice must be >= 1, got {args.slice}")
    trace = list(read_trace(args.trace, output_lengths=True))
    result = run(trace, sizes, args.slices_at, args.slice, LearnedTraining(retrain_every=args.retrain_every),
                 args.output_lengths)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps({"trace": args.trace, **result}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
