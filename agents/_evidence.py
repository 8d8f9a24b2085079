"""Replay evidence: what a candidate policy would have done with the recent windows, against the policy in
force.

Both arms replay the same requests from the same cold cache: ``warmup`` windows fill it, then the ``measure``
windows are counted. The gain is the candidate's hit ratio (hits over keys asked for) minus the base's, with a
paired bootstrap interval over requests (each resample draws requests, and both arms' counts for them), so a
gain that a few requests make is seen as such. The same replay gives the realised gain of a promoted change
afterwards: the schedule that happened against the one without the change, over the windows since.

Model time is the cost of what the cache did not serve, and model money its price: a request's reported cost
(the access event's ``cost``) times the share of its keys that missed. Model time: for a request whose source gives its model latency,
that latency times the share of its keys that missed; otherwise ``ms_per_key`` per missed key (a KV block's
prefill, a response's generation). Lookup time counts ``lookup_ms`` per lookup made and ``semantic_ms`` per
semantic lookup (an embedding and a search).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evocache.dsl import Policy

from ._types import Outcome, Request
from evocache.controller.replay import PolicySimulator

Step = tuple[Policy, Policy | None, float]
"""One window of a schedule: the policy in force, the canary (or None) and its fraction."""


@dataclass(frozen=True, slots=True)
class Costs:
    """What a lookup, a semantic lookup and a missed key cost, for the time estimates (milliseconds)."""

    lookup_ms: float = 0.05
    semantic_ms: float = 4.0
    ms_per_key: float = 25.0


def replay_schedule(
    windows: Sequence[Sequence[Request]],
    schedule: Sequence[Step],
    capacity: int,
    *,
    vectors: Any = None,
    seed: int = 0,
    models: Path | None = None,
) -> list[list[Outcome]]:
    """Replay ``windows`` from a cold cache, window i under ``schedule[i]``; the outcomes of each window.
    ``models``: where the trained eviction models the policies name are (``PolicySimulator``)."""
    if len(windows) != len(schedule):
        raise ValueError(f"{len(windows)} windows but a schedule of {len(schedule)}")
    if not windows:
        return []
    sim = PolicySimulator(schedule[0][0], capacity, seed=seed, vectors=vectors, models=models)
    out: list[list[Outcome]] = []
    for reqs, (base, canary, fraction) in zip(windows, schedule, strict=True):
        if base is not sim.policy and base != sim.policy:
            sim.use(base)
        out.append(sim.run(reqs, canary=canary, fraction=fraction))
    return out


@dataclass(frozen=True, slots=True)
class ArmMetrics:
    """One arm over its requests: how many, the hit ratio (hits over keys asked for), the byte hit ratio,
    wrong answers per request, the lookup and model time per request (estimates, see the module docstring),
    and ``model_cost``: the money per request spent on what the cache did not serve, at each request's reported
    cost (requests whose engine reported none count nothing)."""

    requests: int
    hit_ratio: float
    byte_hit_ratio: float
    wrong_rate: float
    lookup_ms: float
    model_ms: float
    model_cost: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArmMetrics:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Comparison:
    """Two arms replayed over the same requests: each arm's metrics, the candidate's hit-ratio ``gain`` over
    the base with its paired bootstrap interval ``ci`` (low, high), the change of the wrong-answer rate and
    the requests counted."""

    base: ArmMetrics
    candidate: ArmMetrics
    gain: float
    ci: tuple[float, float]
    wrong_change: float
    requests: int

    def to_dict(self) -> dict[str, Any]:
        """The comparison as plain values (what ``Evidence.from_replay`` stores)."""
        return {
            "base": self.base.to_dict(),
            "candidate": self.candidate.to_dict(),
            "gain": self.gain,
            "ci": list(self.ci),
            "wrong_change": self.wrong_change,
            "requests": self.requests,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        low, high = data["ci"]
        return cls(
            ArmMetrics.from_dict(data["base"]),
            ArmMetrics.from_dict(data["candidate"]),
            data["gain"],
            (low, high),
            data["wrong_change"],
            data["requests"],
        )


def arm_metrics(
    requests: Sequence[Request], outcomes: Sequence[Outcome], costs: Costs = Costs()
) -> ArmMetrics:
    """One arm over ``requests`` (``ArmMetrics``)."""
    keys = hits = wrong = requested = served = semantic = 0
    lookups = 0
    model_ms = model_cost = 0.0
    for req, out in zip(requests, outcomes, strict=True):
        n = len(req.keys)
        keys += n
        hits += out.hits
        wrong += out.wrong
        lookups += out.lookups
        semantic += out.semantic or (req.kind == "semantic" and out.lookups > 0 and not out.hits)
        requested += n * req.size
        served += out.hits * req.size
        missed = (n - out.hits) / n if n else 0.0
        model_ms += missed * (req.latency_ms if req.latency_ms >= 0 else costs.ms_per_key * n)
        if req.cost > 0:
            model_cost += missed * req.cost
    count = len(requests)
    return ArmMetrics(
        requests=count,
        hit_ratio=hits / keys if keys else 0.0,
        byte_hit_ratio=served / requested if requested else 0.0,
        wrong_rate=wrong / count if count else 0.0,
        lookup_ms=(lookups * costs.lookup_ms + semantic * costs.semantic_ms) / max(count, 1),
        model_ms=model_ms / max(count, 1),
        model_cost=model_cost / max(count, 1),
    )


def bootstrap_gain(
    requests: Sequence[Request],
    base: Sequence[Outcome],
    cand: Sequence[Outcome],
    *,
    resamples: int = 400,
    seed: int = 0,
    level: float = 0.9,
) -> tuple[float, float, float]:
    """The candidate's hit-ratio gain over the base and its paired bootstrap interval ``(gain, low,
    high)``."""
    keys = np.array([len(r.keys) for r in requests], dtype=np.float64)
    hb = np.array([o.hits for o in base], dtype=np.float64)
    hc = np.array([o.hits for o in cand], dtype=np.float64)
    total = keys.sum()
    if not len(keys) or total == 0:
        return 0.0, 0.0, 0.0
    gain = float((hc.sum() - hb.sum()) / total)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(keys), size=(resamples, len(keys)))
    k = keys[idx].sum(axis=1)
    diffs = (hc[idx].sum(axis=1) - hb[idx].sum(axis=1)) / np.maximum(k, 1)
    tail = (1 - level) / 2
    low, high = np.quantile(diffs, [tail, 1 - tail])
    return gain, float(low), float(high)


def compare(
    windows: Sequence[Sequence[Request]],
    base: Sequence[Step],
    cand: Sequence[Step],
    *,
    measure: int,
    capacity: int,
    vectors: Any = None,
    seed: int = 0,
    costs: Costs = Costs(),
    models: Path | None = None,
) -> Comparison:
    """Replay ``windows`` under two schedules and compare them over the last ``measure`` windows."""
    if not 1 <= measure <= len(windows):
        raise ValueError(f"measure must be in 1..{len(windows)}, got {measure}")
    b = replay_schedule(windows, base, capacity, vectors=vectors, seed=seed, models=models)
    c = replay_schedule(windows, cand, capacity, vectors=vectors, seed=seed, models=models)
    reqs = [r for w in windows[-measure:] for r in w]
    bo = [o for w in b[-measure:] for o in w]
    co = [o for w in c[-measure:] for o in w]
    gain, low, high = bootstrap_gain(reqs, bo, co, seed=seed)
    base_m, cand_m = arm_metrics(reqs, bo, costs), arm_metrics(reqs, co, costs)
    return Comparison(base_m, cand_m, gain, (low, high), cand_m.wrong_rate - base_m.wrong_rate, len(reqs))


def arm_difference(
    a: tuple[Sequence[Request], Sequence[Outcome]],
    b: tuple[Sequence[Request], Sequence[Outcome]],
    *,
    resamples: int = 400,
    seed: int = 0,
    level: float = 0.9,
) -> tuple[float, float, float]:
    """Hit ratio of arm ``a`` minus arm ``b`` (two sets of requests, as a canary and its base serve them) with
    a bootstrap interval ``(difference, low, high)``: each arm's requests are resampled on their own."""
    rng = np.random.default_rng(seed)

    def ratios(reqs: Sequence[Request], outs: Sequence[Outcome]) -> tuple[float, np.ndarray]:
        keys = np.array([len(r.keys) for r in reqs], dtype=np.float64)
        hits = np.array([o.hits for o in outs], dtype=np.float64)
        if not len(keys) or keys.sum() == 0:
            return 0.0, np.zeros(resamples)
        idx = rng.integers(0, len(keys), size=(resamples, len(keys)))
        return float(hits.sum() / keys.sum()), hits[idx].sum(axis=1) / np.maximum(keys[idx].sum(axis=1), 1)

    ra, sa = ratios(*a)
    rb, sb = ratios(*b)
    tail = (1 - level) / 2
    low, high = np.quantile(sa - sb, [tail, 1 - tail])
    return ra - rb, float(low), float(high)


@dataclass(frozen=True, slots=True)
class Judgement:
    """A candidate judged against the policy in force: the ``comparison``, which ``view`` it comes from
    (``lasting``: the candidate in force over every window; ``switch``: taking over for the measured windows
    only), the ``windows`` measured (first, last) and when it was evaluated."""

    comparison: Comparison
    view: str
    windows: tuple[int, int]
    evaluated_at: float

    def to_dict(self) -> dict[str, Any]:
        """Plain values: the comparison's, with the view, the windows and the time (``Evidence.from_replay``
        keeps the plain scalars as its detail)."""
        return {
            **self.comparison.to_dict(),
            "view": self.view,
            "windows": list(self.windows),
            "evaluated_at": self.evaluated_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Judgement:
        """The judgement ``to_dict`` wrote."""
        first, last = data["windows"]
        return cls(Comparison.from_dict(data), data["view"], (first, last), data["evaluated_at"])
