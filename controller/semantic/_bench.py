"""Replays behind ``evocache bench semantic``: a labelled prompt stream or a pair set through ``SemanticCache``.

Stream (``{"prompt", "group"}`` per line, in arrival order): each prompt is looked up; a served entry is a hit,
wrong when the entry's group differs; anything else (a miss or an exploration) runs "the model", whose answer is
the prompt's group, inserts it, and lets the judge (group equality) compare it with the candidate's answer. So
the groups reach the cache only through the judge, never the decision. Exact duplicates of a stored prompt are
exact hits: they count as hits (and as errors if the stored prompt's group differs), in ``hit_rate`` and in the
static baselines alike; ``exact_hits`` reports how many.

``best_static`` is the static threshold that, replayed the same way, has the highest hit rate with error rate
<= delta, chosen in hindsight over a grid: the strongest static baseline. Its replay uses exact prior-neighbour
lists (numpy), not the index, so a sweep over 100 thresholds takes seconds. ``static_at`` replays one given
threshold (one chosen on another stream) whatever its error.

Pairs (``{"a", "b", "same_answer", "category"}``): the pairs are replayed, in an order shuffled by the seed, as
a stream of lookups ``a, b`` in one scope (an entry of one pair is a neighbour of the others, as in a real
cache); ``a`` and ``b`` share an answer exactly when ``same_answer``, and a text written for several pairs has
one answer (``pair_answers``). The per-category figures count lookups of ``b``: hits, exact hits, and traps
served (a wrong answer served for the b of a pair whose b needs another answer than its a).
``pair_rows`` gives the same lookups as a labelled stream, for ``replay_stream`` and ``best_static``.

Embeddings can be cached on disk (``.npy`` keyed by the sha256 of the embedder name and the texts) so repeated
runs skip the model (``_vectors``, which the policy loop's replay uses too).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceError
from ._cache import SemanticCache, SemanticStats
from ._config import DEFAULT_JUDGE_BUDGET
from ._index import Scope
from ._policies import DecisionPolicy, PolicyOptions
from ._prior import SHIPPED_PRIOR  # ``prior=``: the error model's prior file of every replay (None: none)
from ._vectors import VectorTable, embed_cached, embedded_table

__all__ = [
    "PairRow",
    "StreamRow",
    "VectorTable",
    "best_static",
    "embed_cached",
    "embedded_table",
    "pair_rows",
    "read_rows",
    "replay_pairs",
    "replay_prefixes",
    "replay_stream",
    "static_at",
    "static_replay",
]

STATIC_GRID = tuple(round(0.5 + 0.005 * i, 3) for i in range(100))  # 0.500 .. 0.995
COARSE_GRID = tuple(round(0.5 + 0.02 * i, 2) for i in range(25))  # 0.50 .. 0.98
_SCOPE = Scope("bench", "semantic")


@dataclass(frozen=True, slots=True)
class StreamRow:
    prompt: str
    group: str


@dataclass(frozen=True, slots=True)
class PairRow:
    a: str
    b: str
    same_answer: bool
    category: str


def read_rows(path: str | Path) -> list[StreamRow] | list[PairRow]:
    """The stream or pair set in ``path`` (told apart by the first line's keys). ``TraceError`` names the file
    and line of the first malformed line, and the field at fault (``missing field 'category'``, ``field
    'same_answer' must be a boolean, got "yes"``); an empty file is a ``TraceError`` too. ``OSError`` if
    unreadable."""
    rows: list[Any] = []
    kind = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(str(path), number, f"not JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise TraceError(str(path), number, "expected a JSON object")
            if kind is None:
                kind = PairRow if "a" in obj else StreamRow
            rows.append(_row(kind, obj, str(path), number))
    if not rows:
        raise TraceError(str(path), 1, 'no rows: expected {"prompt", "group"} or {"a", "b", ...} lines')
    return rows


def _row(kind: type, obj: dict[str, Any], path: str, number: int) -> StreamRow | PairRow:
    def field(name: str, types: tuple[type, ...], what: str) -> Any:
        if name not in obj:
            raise TraceError(path, number, f"missing field {name!r}")
        value = obj[name]
        if type(value) not in types:  # exact types: JSON's true is no group and no text
            raise TraceError(path, number, f"field {name!r} must be {what}, got {_show(value)}")
        return value

    if kind is StreamRow:
        return StreamRow(field("prompt", (str,), "a string"), str(field("group", (str, int), "a string or an int")))
    return PairRow(field("a", (str,), "a string"), field("b", (str,), "a string"),
                   field("same_answer", (bool,), "a boolean"), field("category", (str,), "a string"))


def _show(value: Any) -> str:
    """A value as the file spells it (JSON), cut to 40 characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


# --- the stream --------------------------------------------------------------------------------------------


def replay_stream(
    rows: Sequence[StreamRow],
    table: VectorTable,
    delta: float,
    *,
    seed: int = 0,
    warmup: Sequence[StreamRow] = (),
    mode: str = "bounded",
    explore: float = 0.05,
    threshold: float | None = None,
    classify: bool = True,
    prior: str | Path | None = SHIPPED_PRIOR,
    judge_budget: float | None = DEFAULT_JUDGE_BUDGET,
) -> dict[str, Any]:
    """Replay ``rows`` through a fresh ``SemanticCache`` bounded by ``delta``; the evocache part of the report.
    ``classify``: the cache's answer classifier on (``SemanticCache(classify=)``). ``warmup`` rows are replayed
    first in a scope of their own (``_warm_up``), so ``rows`` are a new tenant of a cache that learnt there; the
    counters (explorations, judge calls, exact hits) are those of ``rows`` alone."""
    return replay_prefixes(rows, table, delta, [len(rows)], seed=seed, warmup=warmup, mode=mode, explore=explore,
                           threshold=threshold, classify=classify, prior=prior, judge_budget=judge_budget)[0]


def replay_prefixes(
    rows: Sequence[StreamRow],
    table: VectorTable,
    delta: float,
    lengths: Sequence[int],
    *,
    seed: int = 0,
    warmup: Sequence[StreamRow] = (),
    mode: str = "bounded",
    explore: float = 0.05,
    threshold: float | None = None,
    classify: bool = True,
    prior: str | Path | None = SHIPPED_PRIOR,
    judge_budget: float | None = DEFAULT_JUDGE_BUDGET,
    policy: DecisionPolicy | None = None,
) -> list[dict[str, Any]]:
    """``replay_stream``'s report of each prefix ``rows[:n]``, n in ``lengths`` (each in 1 .. len(rows)), from one
    replay of the longest: a cache decides each lookup from the ones before it, so the first n lookups of a
    longer stream are the stream of n lookups, and their figures are read as the replay passes n. ``policy``: a
    fresh policy to replay instead of the one ``mode``, ``explore``, ``threshold`` and ``prior`` build (an
    ablation: ``bench/semantic_ceiling.py --losses``)."""
    if not all(1 <= n <= len(rows) for n in lengths):
        raise ValueError(f"prefix lengths must be in 1 .. {len(rows)}, got {list(lengths)}")
    if policy is None:
        policy = PolicyOptions(mode=mode, explore=explore, threshold=threshold, prior=prior).build()
    cache = SemanticCache(table, policy=policy, rng=random.Random(seed), classify=classify,
                          judge_budget=judge_budget)
    before = _warm_up(cache, warmup, delta)
    wanted = set(lengths)
    at: dict[int, dict[str, Any]] = {}
    hits = wrong = 0
    for i, row in enumerate(rows[: max(wanted)]):
        decision, entry = cache.lookup(_SCOPE, row.prompt, max_error=delta)
        if entry is not None:
            hits += 1
            wrong += cache.answer_ref(entry) != row.group
        else:
            cache.insert(_SCOPE, f"e{i}", row.prompt, row.group)
            cache.judge_miss(_SCOPE, row.prompt, row.group, decision)
        if i + 1 in wanted:
            stats = cache.stats()
            at[i + 1] = {
                "hit_rate": hits / (i + 1),
                "error_rate": wrong / (i + 1),
                "exploration_calls": stats.explored - before.explored,
                "judge_calls": stats.judge_calls - before.judge_calls,
                "hits": hits,
                "wrong": wrong,
                "exact_hits": stats.exact_hits - before.exact_hits,
                "explored_wrong": stats.explored_wrong - before.explored_wrong,
                "final_cutoff": stats.cutoff,
                "calibration": stats.calibration,
                "calibration_bounded": stats.calibration_bounded,
            }
    return [at[n] for n in lengths]


def _warm_up(cache: SemanticCache, rows: Sequence[StreamRow], delta: float) -> SemanticStats:
    """Replay ``rows`` (a labelled stream) in the scope ``bench/warmup``: the error model and its calibration,
    shared by a rule's scopes, learn there; entries never cross scopes. The cache's counters after it."""
    warm = Scope("bench", "warmup")
    for i, row in enumerate(rows):
        decision, entry = cache.lookup(warm, row.prompt, max_error=delta)
        if entry is None:
            cache.insert(warm, f"w{i}", row.prompt, row.group)
            cache.judge_miss(warm, row.prompt, row.group, decision)
    return cache.stats()


def oracle_hit_rate(rows: Sequence[StreamRow]) -> float:
    """Share of queries whose group was already cached (seen earlier: its first query was a miss, inserted)."""
    seen: set[str] = set()
    hits = 0
    for row in rows:
        hits += row.group in seen
        seen.add(row.group)
    return hits / len(rows)


# --- the static baseline -----------------------------------------------------------------------------------


def prior_neighbours(vecs: np.ndarray, k: int = 32, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """For each row i, the ``k`` most similar rows j < i, best first: ``(indices, similarities)``, padded
    with -1 / -inf. Exact (blocked matrix products)."""
    n = vecs.shape[0]
    idx = np.full((n, k), -1, dtype=np.int64)
    sims = np.full((n, k), -np.inf, dtype=np.float32)
    for start in range(0, n, block):
        stop = min(n, start + block)
        s = vecs[start:stop] @ vecs[:stop].T
        s[np.arange(stop)[None, :] >= np.arange(start, stop)[:, None]] = -np.inf
        kk = min(k, stop)
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        ps = np.take_along_axis(s, part, axis=1)
        order = np.argsort(-ps, axis=1, kind="stable")
        idx[start:stop, :kk] = np.take_along_axis(part, order, axis=1)
        sims[start:stop, :kk] = np.take_along_axis(ps, order, axis=1)
    idx[~np.isfinite(sims)] = -1
    return idx, sims


def static_replay(
    rows: Sequence[StreamRow], vecs: np.ndarray, threshold: float, prior: tuple[list[list[int]], list[list[float]]]
) -> tuple[int, int]:
    """``(hits, wrong)`` of a static cache at ``threshold``: exact match first, then the nearest stored entry
    if its similarity >= threshold, else insert. Same semantics as a ``SemanticCache`` with a ``StaticPolicy``.
    ``prior`` is ``prior_neighbours`` as lists (``.tolist()``: the loop below reads them row by row)."""
    idx, sims = prior
    stored = [False] * len(rows)
    exact: dict[str, int] = {}
    hits = wrong = 0
    for i, row in enumerate(rows):
        found = exact.get(row.prompt, -1)
        if found < 0:
            exhausted = True
            for j, s in zip(idx[i], sims[i], strict=True):
                if j < 0 or s < threshold:
                    exhausted = False
                    break
                if stored[j]:
                    found, exhausted = j, False
                    break
            if exhausted:  # all k prior neighbours pass and none is stored: search the stored set exactly
                held = np.flatnonzero(np.asarray(stored[:i]))
                if held.size:
                    s = vecs[held] @ vecs[i]
                    best = int(np.argmax(s))
                    found = int(held[best]) if s[best] >= threshold else -1
        if found >= 0:
            hits += 1
            wrong += rows[found].group != row.group
        else:
            stored[i] = True
            exact.setdefault(row.prompt, i)
    return hits, wrong


def best_static(
    rows: Sequence[StreamRow], vecs: np.ndarray, deltas: Sequence[float], grid: Sequence[float] | None = None
) -> dict[float, dict[str, Any]]:
    """Per delta, the threshold with the highest hit rate whose error rate is <= delta (ties: the higher
    threshold), with hit and error rate. ``threshold`` None (rates 0) when none meets it.

    With ``grid`` every threshold in it is replayed. Without, a 0.02 grid over [0.50, 0.99] is replayed, then
    the 0.005 steps within 0.02 of each delta's best (error and hit rate both fall as the threshold rises, so
    the best lies next to the coarse best); about 40 replays instead of 100.
    """
    idx, sims = prior_neighbours(vecs)
    prior = (idx.tolist(), sims.tolist())
    n = len(rows)
    curve: dict[float, tuple[int, int]] = {}

    def run(thresholds: Sequence[float]) -> None:
        for t in thresholds:
            if t not in curve:
                curve[t] = static_replay(rows, vecs, t, prior)

    def pick(delta: float) -> dict[str, Any]:
        best: dict[str, Any] = {"threshold": None, "hit_rate": 0.0, "error_rate": 0.0}
        for t, (hits, wrong) in sorted(curve.items()):
            if wrong / n <= delta and hits / n >= best["hit_rate"]:
                best = {"threshold": t, "hit_rate": hits / n, "error_rate": wrong / n}
        return best

    if grid is not None:
        run(grid)
        return {delta: pick(delta) for delta in deltas}
    run(COARSE_GRID)
    for delta in deltas:
        coarse = pick(delta)["threshold"]
        centre = COARSE_GRID[0] if coarse is None else coarse
        run([t for t in STATIC_GRID if abs(t - centre) <= 0.02 + 1e-9])
    return {delta: pick(delta) for delta in deltas}


def static_at(rows: Sequence[StreamRow], vecs: np.ndarray, threshold: float | None) -> dict[str, Any]:
    """Hit and error rate of the static cache at ``threshold`` on ``rows``, as ``best_static`` reports them:
    a threshold chosen elsewhere (another stream's best), replayed here, whatever its error. ``None`` (no
    threshold met the bound where it was chosen) serves nothing."""
    if threshold is None:
        return {"threshold": None, "hit_rate": 0.0, "error_rate": 0.0}
    idx, sims = prior_neighbours(vecs)
    hits, wrong = static_replay(rows, vecs, threshold, (idx.tolist(), sims.tolist()))
    return {"threshold": threshold, "hit_rate": hits / len(rows), "error_rate": wrong / len(rows)}


# --- pairs ---------------------------------------------------------------------------------------------------


def pair_answers(pairs: Sequence[PairRow]) -> dict[str, str]:
    """The answer of each text in ``pairs``: texts linked by ``same_answer`` pairs share one (transitively), and
    so do identical texts wherever they occur (a prompt asked again has its own answer again, whichever pair it
    was written for). ``ValueError`` if a pair marked different ends up with one answer: the set contradicts
    itself."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        ra, rb = find(pair.a), find(pair.b)
        if pair.same_answer and ra != rb:
            parent[rb] = ra
    for pair in pairs:
        if not pair.same_answer and find(pair.a) == find(pair.b):
            raise ValueError(f"pairs contradict: {pair.a!r} and {pair.b!r} are linked by same_answer pairs")
    roots: dict[str, str] = {}
    return {text: roots.setdefault(find(text), f"answer{len(roots)}") for text in parent}


def pair_stream(pairs: Sequence[PairRow], seed: int) -> list[tuple[int, str, str, bool]]:
    """The pairs as lookups ``(pair index, text, answer, is_b)``, pairs in an order shuffled by ``seed``;
    answers from ``pair_answers``."""
    answers = pair_answers(pairs)
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        pair = pairs[i]
        out.append((i, pair.a, answers[pair.a], False))
        out.append((i, pair.b, answers[pair.b], True))
    return out


def pair_rows(pairs: Sequence[PairRow], seed: int) -> list[StreamRow]:
    """The pairs as a labelled stream (``a`` then ``b`` of each pair, pairs in the order ``pair_stream`` gives
    ``seed``; answers from ``pair_answers``), for ``replay_stream`` and ``best_static``: the pairs' hit rate
    against a static threshold, where ``replay_pairs`` counts traps per category."""
    return [StreamRow(text, answer) for _, text, answer, _ in pair_stream(pairs, seed)]


def replay_pairs(
    pairs: Sequence[PairRow],
    table: VectorTable,
    delta: float,
    *,
    seed: int = 0,
    warmup: Sequence[StreamRow] = (),
    mode: str = "bounded",
    explore: float = 0.05,
    threshold: float | None = None,
    classify: bool = True,
    prior: str | Path | None = SHIPPED_PRIOR,
    judge_budget: float | None = DEFAULT_JUDGE_BUDGET,
) -> dict[str, Any]:
    """Per category of ``b``: pairs, hits (``exact_hits`` of them: the same text stored before, from another
    pair), wrong answers served, and for trap categories ``traps_served``: b lookups served an answer that is
    not b's (an exact hit is b's own answer, see ``pair_answers``). ``warmup`` rows (a labelled stream) are
    replayed first in their own scope, so the error model starts from what it learnt there (entries never
    cross)."""
    cache = SemanticCache(
        table, policy=PolicyOptions(mode=mode, explore=explore, threshold=threshold, prior=prior).build(),
        rng=random.Random(seed), classify=classify, judge_budget=judge_budget,
    )
    _warm_up(cache, warmup, delta)
    per: dict[str, Counter[str]] = {}
    lookups = wrong_served = 0
    for n, (i, text, answer, is_b) in enumerate(pair_stream(pairs, seed)):
        decision, entry = cache.lookup(_SCOPE, text, max_error=delta)
        served = entry is not None
        lookups += 1
        wrong_served += served and cache.answer_ref(entry) != answer
        if is_b:
            counts = per.setdefault(pairs[i].category, Counter())
            counts["pairs"] += 1
            counts["hits"] += served
            wrong = served and cache.answer_ref(entry) != answer
            counts["exact_hits"] += served and decision.token is None  # only an exact match goes unnumbered
            counts["traps_served"] += wrong and not pairs[i].same_answer
            counts["wrong"] += wrong
        if not served:
            cache.insert(_SCOPE, f"p{n}", text, answer)
            cache.judge_miss(_SCOPE, text, answer, decision)
    categories = {}
    for name, c in sorted(per.items()):
        traps = not any(p.same_answer for p in pairs if p.category == name)
        categories[name] = {
            "pairs": c["pairs"],
            "hits": c["hits"],
            "hit_rate": c["hits"] / c["pairs"],
            "exact_hits": c["exact_hits"],
            "traps_served": c["traps_served"],
            "trap_rate": c["traps_served"] / c["pairs"] if traps else None,
            "wrong": c["wrong"],
        }
    stats = cache.stats()
    # The pairs scope's own error per lookup (a and b lookups): the quantity the bound is on.
    return {"categories": categories, "exploration_calls": stats.explored, "judge_calls": stats.judge_calls,
            "lookups": lookups, "error_rate": wrong_served / lookups if lookups else 0.0}
