"""What the cache did over a span of time, per rule and tenant, from its access events (``evocache stats``).

``call_stats`` folds events (``read_events``' calls) into one ``CallStats`` row per (rule, namespace): calls,
hits (of them semantic), misses, bypasses, and what the hits and the engine's own reuse saved in tokens and in
money (``saved_tokens``, ``saved_cost``). SLO breaker transitions are not calls and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ._events import AccessEvent

CALL_OUTCOMES = ("hit", "miss", "bypass")


@dataclass
class CallStats:
    rule: str
    ns: str
    calls: int = 0
    hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    bypasses: int = 0
    tokens_saved: int = 0
    cost_saved: float = 0.0
    first: float = field(default=float("inf"))
    last: float = field(default=float("-inf"))

    @property
    def hit_ratio(self) -> float:
        """Hits over the calls that looked up (hits and misses); 0 when none did."""
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def add(self, event: AccessEvent) -> None:
        self.calls += 1
        if event.outcome == "hit":
            self.hits += 1
            self.semantic_hits += event.reason == "semantic"
        elif event.outcome == "miss":
            self.misses += 1
        else:
            self.bypasses += 1
        self.tokens_saved += event.saved_tokens
        self.cost_saved += event.saved_cost
        self.first = min(self.first, event.t)
        self.last = max(self.last, event.t)

    def as_dict(self) -> dict[str, object]:
        return {"rule": self.rule, "ns": self.ns, "calls": self.calls, "hits": self.hits,
                "semantic_hits": self.semantic_hits, "misses": self.misses, "bypasses": self.bypasses,
                "hit_ratio": round(self.hit_ratio, 6), "tokens_saved": self.tokens_saved,
                "cost_saved": self.cost_saved}


def call_stats(events: Iterable[AccessEvent], since: float | None = None,
               until: float | None = None) -> list[CallStats]:
    """One row per (rule, namespace) of the calls decided in ``[since, until)`` (either end open when None),
    ordered by rule then namespace."""
    rows: dict[tuple[str, str], CallStats] = {}
    for event in events:
        if event.outcome not in CALL_OUTCOMES:
            continue
        if (since is not None and event.t < since) or (until is not None and event.t >= until):
            continue
        row = rows.get((event.rule, event.ns))
        if row is None:
            row = rows[(event.rule, event.ns)] = CallStats(event.rule, event.ns)
        row.add(event)
    return [rows[k] for k in sorted(rows)]


def total(rows: Iterable[CallStats]) -> CallStats:
    """Every row's calls together (rule and namespace ``*``)."""
    whole = CallStats("*", "*")
    for row in rows:
        whole.calls += row.calls
        whole.hits += row.hits
        whole.semantic_hits += row.semantic_hits
        whole.misses += row.misses
        whole.bypasses += row.bypasses
        whole.tokens_saved += row.tokens_saved
        whole.cost_saved += row.cost_saved
        whole.first = min(whole.first, row.first)
        whole.last = max(whole.last, row.last)
    return whole
