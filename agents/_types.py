"""The loop's plain data: requests, what the cache did with them, windows, series and findings.

Everything here is frozen and made of plain values (str, int, float, tuples, mappings of those), so the
LangGraph state, the SQLite store and the JSON report can hold it without pickling.

A ``Request`` (``controller.replay.ReplayRequest``) is one client call as the loop sees it, whatever the
source: a Mooncake trace line (its KV blocks are its ``keys``), an access event pair (one response key), a
semantic stream row (a prompt and its answer group). An ``Outcome`` (``controller.replay.ReplayOutcome``) is
what one policy did with it: how many of its lookups hit. ``WindowStats``
summarises a window of requests and outcomes for diagnosis; ``Series`` carries a signal at a finer step (per
second, per kernel) for the tests that need a time series (Granger causality, change points).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from evocache.controller.replay import ReplayOutcome, ReplayRequest

# One client call and what a policy did with it are the replay's types: the loop reads traces into them and
# the policy simulator (``controller.replay.PolicySimulator``) replays them.
Request = ReplayRequest
Outcome = ReplayOutcome


class Counts(NamedTuple):
    """Requests, keys asked for (``lookups``, bypassed requests included) and hits of one slice of a
    window."""

    requests: int
    lookups: int
    hits: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def __add__(self, other: object) -> Counts:  # type: ignore[override]  # element-wise, not concatenation
        if not isinstance(other, Counts):
            return NotImplemented
        return Counts(self.requests + other.requests, self.lookups + other.lookups, self.hits + other.hits)


def _frozen(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(value))


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One window of traffic under one policy, summarised for diagnosis.

    ``requests`` counts client calls; ``lookups`` the keys they asked for (KV blocks, or one per response
    call), bypassed calls included, and ``hits`` those served from cache; so ``hit_ratio`` is the share of
    demand the cache served, and a policy cannot raise it by bypassing traffic. ``by_rule``,
    ``by_tenant`` and ``by_rule_tenant`` slice the same counts. ``keys``: lookups per key (the key
    distribution the drift tests compare). ``prompt_tokens``, ``output_tokens``, ``latency_ms``: one value per
    request that knows it. ``pushed_out``: ``(evicting tenant, evicted tenant) -> entries``. ``wrong``:
    semantic hits with another answer group.
    """

    index: int
    start: float
    end: float
    policy: str
    requests: int
    lookups: int
    hits: int
    bypassed: int = 0
    wrong: int = 0
    by_rule: Mapping[str, Counts] = field(default_factory=dict)
    by_tenant: Mapping[str, Counts] = field(default_factory=dict)
    by_rule_tenant: Mapping[tuple[str, str], Counts] = field(default_factory=dict)
    keys: Mapping[str, int] = field(default_factory=dict)
    prompt_tokens: tuple[int, ...] = ()
    output_tokens: tuple[int, ...] = ()
    latency_ms: tuple[float, ...] = ()
    pushed_out: Mapping[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("by_rule", "by_tenant", "by_rule_tenant", "keys", "pushed_out"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def window_stats(
    index: int,
    policy: str,
    requests: Sequence[Request],
    outcomes: Sequence[Outcome],
    *,
    start: float | None = None,
    end: float | None = None,
) -> WindowStats:
    """Summarise ``requests`` (in time order) and the ``outcomes`` one policy gave them (same order and
    length). ``start``/``end`` default to the first and last request's ``t``. Raises ``ValueError`` when the
    lengths
    differ."""
    if len(requests) != len(outcomes):
        raise ValueError(f"{len(requests)} requests but {len(outcomes)} outcomes")
    by_rule: dict[str, Counts] = {}
    by_tenant: dict[str, Counts] = {}
    by_pair: dict[tuple[str, str], Counts] = {}
    keys: Counter[str] = Counter()
    pushed: Counter[tuple[str, str]] = Counter()
    lookups = hits = bypassed = wrong = 0
    for req, out in zip(requests, outcomes, strict=True):
        c = Counts(1, len(req.keys), out.hits)
        by_rule[req.rule] = by_rule.get(req.rule, Counts(0, 0, 0)) + c
        by_tenant[req.ns] = by_tenant.get(req.ns, Counts(0, 0, 0)) + c
        pair = (req.rule, req.ns)
        by_pair[pair] = by_pair.get(pair, Counts(0, 0, 0)) + c
        lookups += len(req.keys)
        hits += out.hits
        bypassed += out.bypass
        wrong += out.wrong
        keys.update(req.keys)
        for victim in out.evicted:
            pushed[(req.ns, victim)] += 1
    return WindowStats(
        index=index,
        start=requests[0].t if start is None and requests else (start or 0.0),
        end=requests[-1].t if end is None and requests else (end or 0.0),
        policy=policy,
        requests=len(requests),
        lookups=lookups,
        hits=hits,
        bypassed=bypassed,
        wrong=wrong,
        by_rule=by_rule,
        by_tenant=by_tenant,
        by_rule_tenant=by_pair,
        keys=dict(keys),
        prompt_tokens=tuple(r.prompt_tokens for r in requests if r.prompt_tokens >= 0),
        output_tokens=tuple(r.output_tokens for r in requests if r.output_tokens >= 0),
        latency_ms=tuple(r.latency_ms for r in requests if r.latency_ms >= 0),
        pushed_out=dict(pushed),
    )


@dataclass(frozen=True, slots=True)
class Series:
    """A timestamped signal: ``name`` (``qps``, ``miss_ratio``, ``gpu_util`` ...), ``labels`` (sorted
    ``(key, value)`` pairs: rule, tenant, gpu, kernel), ``t`` (seconds) and ``v``, equally long, ``t`` not
    decreasing. ``unit`` says what ``v`` counts."""

    name: str
    labels: tuple[tuple[str, str], ...]
    t: tuple[float, ...]
    v: tuple[float, ...]
    unit: str = ""

    def __post_init__(self) -> None:
        if len(self.t) != len(self.v):
            raise ValueError(f"series {self.name}: {len(self.t)} times but {len(self.v)} values")
        object.__setattr__(self, "labels", tuple(sorted(self.labels)))

    def label(self, key: str, default: str = "") -> str:
        return dict(self.labels).get(key, default)


def step_series(
    requests: Sequence[Request],
    outcomes: Sequence[Outcome],
    *,
    start: float,
    end: float,
    step_s: float,
    by: Sequence[str] = ("rule", "tenant"),
) -> list[Series]:
    """Per-step series of one stretch of traffic, for the time-series tests: ``qps``, ``miss_ratio`` (of the
    step's lookups; NaN in a step without lookups), ``prompt_tokens`` (mean per request, NaN when unknown) and
    ``long_prompt_share`` (share of requests above the stretch's median prompt length), once overall and once
    per value of each label in ``by`` (``rule``, ``tenant``). Steps are ``[start + i*step_s, ...)``; a request
    at ``end`` falls in the last step."""
    if not (step_s > 0 and math.isfinite(step_s)) or not end >= start:
        raise ValueError(f"need step_s > 0 and end >= start, got step_s={step_s!r}, [{start}, {end}]")
    n = max(1, math.ceil((end - start) / step_s))
    known = sorted(r.prompt_tokens for r in requests if r.prompt_tokens >= 0)
    median = known[len(known) // 2] if known else -1
    groups: dict[tuple[tuple[str, str], ...], list[list[float]]] = {}

    def cells(labels: tuple[tuple[str, str], ...]) -> list[list[float]]:
        # per step: requests, lookups, hits, prompt tokens summed, requests with a known length, long ones
        return groups.setdefault(labels, [[0.0] * 6 for _ in range(n)])

    for req, out in zip(requests, outcomes, strict=True):
        i = min(n - 1, max(0, int((req.t - start) // step_s)))
        slices = [()] + [((k, req.rule if k == "rule" else req.ns),) for k in by]
        for labels in slices:
            c = cells(labels)[i]
            c[0] += 1
            c[1] += len(req.keys)
            c[2] += out.hits
            if req.prompt_tokens >= 0:
                c[3] += req.prompt_tokens
                c[4] += 1
                c[5] += req.prompt_tokens > median
    times = tuple(start + i * step_s for i in range(n))
    out_series: list[Series] = []
    nan = math.nan
    for labels, rows in sorted(groups.items()):
        out_series.append(Series("qps", labels, times, tuple(r[0] / step_s for r in rows), "1/s"))
        out_series.append(
            Series(
                "miss_ratio", labels, times, tuple(1 - r[2] / r[1] if r[1] else nan for r in rows), "ratio"
            )
        )
        out_series.append(
            Series(
                "prompt_tokens", labels, times, tuple(r[3] / r[4] if r[4] else nan for r in rows), "tokens"
            )
        )
        out_series.append(
            Series(
                "long_prompt_share", labels, times, tuple(r[5] / r[4] if r[4] else nan for r in rows), "ratio"
            )
        )
    return out_series


FindingKind = Literal[
    "granger",  # a load signal helps predict the miss ratio
    "key-drift",  # the key distribution moved (entropy beyond its band, Jensen-Shannon divergence)
    "mix-drift",  # the traffic mix moved (rule and tenant slices, prompt-length octaves)
    "change-point",  # the hit ratio changed level
    "knee",  # the hit ratio's knee: more load or less room stops paying
    "output-shift",  # output lengths left their band
    "bimodal-latency",  # two latency modes: cold starts
    "never-hits",  # a rule's (or tenant's) traffic never hits
    "push-out",  # a tenant's admissions evict another tenant's entries
    "not-testable",  # a test could not run on this data (constant series, too few points)
]


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis, typed, with its evidence.

    ``kind`` says what was found; ``subject`` what about (``{"rule": "faq", "tenant": "acme"}``);
    ``window`` the index of the window it is about, ``windows`` the span of windows its test used
    (first, last). ``statistic`` the test statistic, ``p_value`` its p-value (after the multiple-test
    correction where one applies; None for scores without one), ``score`` a 0..1 strength for ranking findings
    (what the planner turns into edits first). ``detail`` plain values that explain it (the lag chosen, the
    band, the modes); ``plot`` the path of a PNG that shows it, when one was drawn. ``summary`` one sentence
    for a person.
    """

    kind: FindingKind
    summary: str
    window: int
    windows: tuple[int, int]
    subject: Mapping[str, str] = field(default_factory=dict)
    statistic: float | None = None
    p_value: float | None = None
    score: float = 0.0
    detail: Mapping[str, Any] = field(default_factory=dict)
    plot: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "subject", _frozen(self.subject))
        object.__setattr__(self, "detail", _frozen(self.detail))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (NaN and infinities become None)."""

        def plain(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, Mapping):
                return {str(k): plain(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return [plain(v) for v in x]
            return x

        return {
            "kind": self.kind,
            "summary": self.summary,
            "window": self.window,
            "windows": list(self.windows),
            "subject": dict(self.subject),
            "statistic": plain(self.statistic),
            "p_value": plain(self.p_value),
            "score": plain(self.score),
            "detail": plain(dict(self.detail)),
            "plot": self.plot,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            kind=data["kind"],
            summary=data["summary"],
            window=int(data["window"]),
            windows=(int(data["windows"][0]), int(data["windows"][1])),
            subject=data.get("subject") or {},
            statistic=data.get("statistic"),
            p_value=data.get("p_value"),
            score=float(data.get("score") or 0),
            detail=data.get("detail") or {},
            plot=data.get("plot"),
        )
