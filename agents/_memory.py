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

The typed objects the nodes work on (``WindowRecord``, ``Series``) are made from it and back here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from evocache.dsl import Policy

from ._evidence import Step
from ._types import Counts, Finding, Outcome, Request, Series, WindowStats


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
