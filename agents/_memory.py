"""What the loop remembers between windows, as plain data.

The loop's memory is part of the graph's state (``LoopState["memory"]``): JSON values only (str, int, float,
bool, None, lists, dicts with str keys), so the SQLite checkpointer keeps it with every pass and a review
resumed from another process, which opens the same checkpoint file and thread, sees the same history the
waiting pass saw. A pass takes the memory the last one left as its input and hands back the next.

``Memory`` holds:

- ``windows``: the newest windows served (``WindowRecord.to_dict``; the newest 60, or more while a canary
  needs them): their requests, outcomes and arms (for the newest few only, what replay needs), the schedule
  step as policy refs, their summaries and findings; each knows its index;
- ``served``: how many windows were served (the next window's index);
- ``series``: the per-step series the loop joins across windows (NaN written as None);
- ``canary_started``: proposal id -> the window its canary started at, while it is out;
- ``promoted_at``: proposal id -> [canary start, promotion window], until its windows are forgotten;
- ``top_version``: the highest version the loop has made;
- ``kept_model``: the newest kept retraining (``RetrainResult.to_dict`` with its window), until proposed;
- ``last_retrain``: the newest retraining, kept or not (what the planner's ``retrain`` tool says).

So it stays bounded however long the loop runs. What the report lists (every window's row, the breaches, the
retrainings) the driver keeps from each pass's end state, outside the memory.

The typed objects the nodes work on (``WindowRecord``, ``Series``) are made from it and back here, by
``Records``, which is also the one way the memory grows by a window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from evocache.dsl import Policy

from ._config import LoopConfig
from ._evidence import Step
from ._types import Counts, Finding, Outcome, Request, Series, WindowStats, step_series, window_stats

HISTORY = 60
"""Windows whose key counts the loop keeps (the drift tests read the newest 30)."""


class Memory(TypedDict):
    windows: list[dict[str, Any]]
    served: int
    series: list[dict[str, Any]]
    canary_started: dict[str, int]
    promoted_at: dict[str, list[int]]
    top_version: int
    kept_model: dict[str, Any] | None
    last_retrain: dict[str, Any] | None


def empty_memory() -> Memory:
    return Memory(
        windows=[],
        served=0,
        series=[],
        canary_started={},
        promoted_at={},
        top_version=0,
        kept_model=None,
        last_retrain=None,
    )


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """A window as it was served: its requests, outcomes, the schedule step, which requests ran the canary,
    its summary, its findings and the mean of each other signal over its span."""

    index: int
    requests: Sequence[Request]
    outcomes: Sequence[Outcome]
    step: Step
    canary_arm: Sequence[bool]
    stats: WindowStats
    findings: Sequence[Finding] = ()
    signals: Mapping[str, float] = field(default_factory=dict)

    def forgotten(self, *, requests: bool, keys: bool) -> WindowRecord:
        """This record without its requests (outcomes, arms) and/or its key counts."""
        rec = self
        if requests and rec.requests:
            rec = replace(rec, requests=(), outcomes=(), canary_arm=())
        if keys and rec.stats.keys:
            rec = replace(rec, stats=replace(rec.stats, keys={}))
        return rec

    def to_dict(self) -> dict[str, Any]:
        base, canary, fraction = self.step
        return {
            "index": self.index,
            "requests": [_request(r) for r in self.requests],
            "outcomes": [[o.lookups, o.hits, o.bypass, o.wrong, o.semantic, o.tier, list(o.evicted)]
                         for o in self.outcomes],
            "step": {"policy": str(base.ref), "canary": None if canary is None else str(canary.ref),
                     "fraction": fraction},
            "canary_arm": list(self.canary_arm),
            "stats": _stats(self.stats),
            "findings": [f.to_dict() for f in self.findings],
            "signals": dict(self.signals),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], load: Callable[[str], Policy]) -> WindowRecord:
        """The record ``to_dict`` wrote; ``load`` gives the policy of a ref (the policy store's ``load``)."""
        step = data["step"]
        return cls(
            index=int(data["index"]),
            requests=tuple(_request_from(r) for r in data["requests"]),
            outcomes=tuple(Outcome(*o[:6], tuple(o[6])) for o in data["outcomes"]),
            step=(load(step["policy"]), None if step["canary"] is None else load(step["canary"]),
                  float(step["fraction"])),
            canary_arm=tuple(bool(a) for a in data["canary_arm"]),
            stats=_stats_from(data["stats"]),
            findings=tuple(Finding.from_dict(f) for f in data["findings"]),
            signals=dict(data["signals"]),
        )


class Records:
    """The memory's typed view, and the one way it grows.

    ``of`` makes a memory's plain windows into ``WindowRecord``s, ``series`` its series into ``Series``, each
    once per process: a record is made again only when its plain window is another object (a pass resumed
    from a checkpoint holds its own copies). ``policy`` loads a ref once through ``load`` (the policy
    store's). ``remember`` adds a served window and forgets what no reader needs any more, so the memory stays
    bounded however long the loop runs; ``with_findings`` puts a pass's findings on the newest window. It
    holds no memory of its own: every method takes the ``Memory``, and the ones that change it return the new
    one."""

    def __init__(self, load: Callable[[str], Policy], config: LoopConfig) -> None:
        self._load = load
        self.config = config
        self._policies: dict[str, Policy] = {}
        self._records: dict[int, tuple[dict[str, Any], WindowRecord]] = {}
        self._series: tuple[list[dict[str, Any]], list[Series]] | None = None

    def policy(self, ref: str) -> Policy:
        policy = self._policies.get(ref)
        if policy is None:
            policy = self._policies[ref] = self._load(ref)
        return policy

    def of(self, memory: Memory) -> list[WindowRecord]:
        """The memory's windows as typed records, oldest first."""
        return [self._record(plain) for plain in memory["windows"]]

    def series(self, memory: Memory) -> list[Series]:
        plain = memory["series"]
        if self._series is None or self._series[0] is not plain:
            self._series = (plain, [series_from_dict(s) for s in plain])
        return self._series[1]

    def remember(
        self,
        memory: Memory,
        requests: Sequence[Request],
        outcomes: list[Outcome],
        step: Step,
        canary_arm: list[bool],
        signals: Sequence[Series] = (),
    ) -> tuple[Memory, WindowRecord]:
        """The memory with one more served window, and its record: the window with the other ``signals``
        read over its span (GPU, host, profiler and Nsight Compute series: kept with the cache's own series
        for diagnosis, and their means in the window's record). Only the newest windows keep their requests
        (what replay needs); older ones keep their summary, and only the newest ``HISTORY`` windows their key
        counts."""
        windows = list(memory["windows"])
        index = memory["served"]
        stats = window_stats(index, str(step[0].ref), requests, outcomes)
        means = {_series_name(s): float(sum(s.v) / len(s.v)) for s in signals if s.v}
        rec = WindowRecord(
            index, tuple(requests), tuple(outcomes), step, tuple(canary_arm), stats, signals=means
        )
        windows.append(self._keep(rec))
        series = memory["series"]
        if requests:
            first, last = min(r.t for r in requests), max(r.t for r in requests)
            step_s = self.config.step_s or max(last - first, 1e-6) / 20
            own = step_series(requests, outcomes, start=first, end=last, step_s=step_s)
            merged = _merge_series([*self.series(memory), *own, *signals])
            series = [series_to_dict(s) for s in merged]
            self._series = (series, merged)
        oldest = self._forget(windows, step[0].guardrails.rollout.max_windows)
        # a promotion's realised gain replays from ``warmup`` windows before its canary: kept while those are
        promoted = {
            p: at for p, at in memory["promoted_at"].items() if max(0, at[0] - self.config.warmup) >= oldest
        }
        update = {"windows": windows, "series": series, "served": index + 1, "promoted_at": promoted}
        return {**memory, **update}, rec

    def with_findings(self, memory: Memory, findings: Sequence[Finding]) -> Memory:
        """The memory with ``findings`` on its newest window."""
        windows = list(memory["windows"])
        windows[-1] = self._keep(replace(self._record(windows[-1]), findings=tuple(findings)))
        return {**memory, "windows": windows}

    def _record(self, plain: dict[str, Any]) -> WindowRecord:
        cached = self._records.get(plain["index"])
        if cached is not None and cached[0] is plain:
            return cached[1]
        rec = WindowRecord.from_dict(plain, self.policy)
        self._records[rec.index] = (plain, rec)
        return rec

    def _keep(self, rec: WindowRecord) -> dict[str, Any]:
        plain = rec.to_dict()
        self._records[rec.index] = (plain, rec)
        return plain

    def _forget(self, windows: list[dict[str, Any]], canary_windows: int) -> int:
        """Drop the requests of the windows older than replay reads (a canary's, a realised gain's, a
        judgement's) and the windows older than diagnosis reads, in place; the oldest index kept."""
        cfg = self.config
        keep = cfg.warmup + max(cfg.measure, cfg.realise) + canary_windows + 2
        if len(windows) > keep and windows[-keep - 1]["requests"]:
            rec = self._record(windows[-keep - 1])
            windows[-keep - 1] = self._keep(rec.forgotten(requests=True, keys=False))
        del windows[: -max(HISTORY, keep + 1)]
        oldest = windows[0]["index"]
        for index in [i for i in self._records if i < oldest]:
            del self._records[index]
        return oldest


def history(records: Sequence[WindowRecord]) -> list[WindowStats]:
    """The newest ``HISTORY`` windows' summaries, oldest first: what diagnosis reads."""
    return [w.stats for w in records[-HISTORY:]]


def span(records: Sequence[WindowRecord], last: int, count: int) -> list[WindowRecord]:
    """The ``count`` windows up to the one of index ``last``."""
    return [w for w in records if last - count < w.index <= last]


def _series_name(s: Series) -> str:
    return s.name + "".join(f"[{k}={v}]" for k, v in s.labels)


def _merge_series(series: Sequence[Series], keep: int = 400) -> list[Series]:
    """Series of one name and labels joined in time order, the newest ``keep`` points of each."""
    joined: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[list[float], list[float], str]] = {}
    for s in series:
        t, v, _ = joined.setdefault((s.name, s.labels), ([], [], s.unit))
        t.extend(s.t)
        v.extend(s.v)
    return [
        Series(name, labels, tuple(t[-keep:]), tuple(v[-keep:]), unit)
        for (name, labels), (t, v, unit) in joined.items()
    ]


_REQUEST_FIELDS = ("t", "kind", "keys", "size", "ns", "rule", "prompt_tokens", "output_tokens", "latency_ms",
                   "prompt", "group", "phase")


def _request(r: Request) -> list[Any]:
    return [r.t, r.kind, list(r.keys), r.size, r.ns, r.rule, r.prompt_tokens, r.output_tokens, r.latency_ms,
            r.prompt, r.group, r.phase]


def _request_from(row: Sequence[Any]) -> Request:
    values = dict(zip(_REQUEST_FIELDS, row, strict=True))
    values["keys"] = tuple(values["keys"])
    return Request(**values)


def _counts(slices: Mapping[Any, Counts]) -> list[list[Any]]:
    return [[*(key if isinstance(key, tuple) else (key,)), *c] for key, c in slices.items()]


def _stats(s: WindowStats) -> dict[str, Any]:
    return {
        "index": s.index, "start": s.start, "end": s.end, "policy": s.policy, "requests": s.requests,
        "lookups": s.lookups, "hits": s.hits, "bypassed": s.bypassed, "wrong": s.wrong,
        "by_rule": _counts(s.by_rule), "by_tenant": _counts(s.by_tenant),
        "by_rule_tenant": _counts(s.by_rule_tenant), "keys": dict(s.keys),
        "prompt_tokens": list(s.prompt_tokens), "output_tokens": list(s.output_tokens),
        "latency_ms": list(s.latency_ms), "pushed_out": [[a, b, n] for (a, b), n in s.pushed_out.items()],
    }


def _stats_from(d: Mapping[str, Any]) -> WindowStats:
    return WindowStats(
        index=d["index"], start=d["start"], end=d["end"], policy=d["policy"], requests=d["requests"],
        lookups=d["lookups"], hits=d["hits"], bypassed=d["bypassed"], wrong=d["wrong"],
        by_rule={row[0]: Counts(*row[1:]) for row in d["by_rule"]},
        by_tenant={row[0]: Counts(*row[1:]) for row in d["by_tenant"]},
        by_rule_tenant={(row[0], row[1]): Counts(*row[2:]) for row in d["by_rule_tenant"]},
        keys=dict(d["keys"]),
        prompt_tokens=tuple(d["prompt_tokens"]), output_tokens=tuple(d["output_tokens"]),
        latency_ms=tuple(d["latency_ms"]),
        pushed_out={(a, b): n for a, b, n in d["pushed_out"]},
    )


def series_to_dict(s: Series) -> dict[str, Any]:
    """A series as plain values: NaN (a step without lookups) is written as None."""
    return {"name": s.name, "labels": [list(kv) for kv in s.labels], "t": list(s.t),
            "v": [None if math.isnan(v) else v for v in s.v], "unit": s.unit}


def series_from_dict(d: Mapping[str, Any]) -> Series:
    return Series(d["name"], tuple((k, v) for k, v in d["labels"]), tuple(d["t"]),
                  tuple(math.nan if v is None else v for v in d["v"]), d["unit"])
