"""Who the cache fails: rules or tenants whose traffic never hits, tenants whose admissions push others out.

Both read the last ``last`` windows pooled, so one quiet window neither makes nor hides a finding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .._types import Counts, Finding, WindowStats


def never_hits(history: Sequence[WindowStats], *, last: int = 3, min_lookups: int = 100) -> list[Finding]:
    """``never-hits`` findings: each rule (subject ``{"rule": r}``) and each tenant (``{"tenant": t}``) with
    at least ``min_lookups`` lookups and no hit over the last ``last`` windows. The unnamed rule or tenant
    ("": the source has none) is left out. A rule set to bypass never hits by design; the finding says what
    the traffic got, the planner knows which rules bypass. Raises ``ValueError`` for ``last < 1``."""
    if last < 1 or min_lookups < 1:
        raise ValueError(f"need last >= 1 and min_lookups >= 1, got {last=}, {min_lookups=}")
    span = list(history[-last:])
    if not span:
        return []
    total = sum(w.lookups for w in span)
    out = []
    for label, attr in (("rule", "by_rule"), ("tenant", "by_tenant")):
        for name, c in sorted(_pooled([getattr(w, attr) for w in span]).items()):
            if name and c.hits == 0 and c.lookups >= min_lookups:
                out.append(
                    Finding(
                        kind="never-hits",
                        summary=f"{label} {name!r}: {c.lookups} lookups over windows "
                        f"{span[0].index}-{span[-1].index}, no hit",
                        window=span[-1].index,
                        windows=(span[0].index, span[-1].index),
                        subject={label: name},
                        statistic=float(c.lookups),
                        score=c.lookups / total if total else 0.0,
                        detail={
                            "lookups": c.lookups,
                            "requests": c.requests,
                            "hits": 0,
                            "share": c.lookups / total,
                        },
                    )
                )
    return out


def push_out(
    history: Sequence[WindowStats],
    *,
    last: int = 3,
    min_entries: int = 10,
    low_hit: float = 0.2,
    min_drop: float = 0.05,
) -> list[Finding]:
    """``push-out`` findings (subject ``{"tenant": A, "victim": B}``): over the last ``last`` windows A's
    admissions evicted at least ``min_entries`` of B's entries, A's own hit ratio is at most ``low_hit`` (it
    gains little from the room it takes) and B's hit ratio fell by at least ``min_drop`` from the first of
    those windows to the newest. Nothing with fewer than 2 windows. Raises ``ValueError`` for ``last < 2``."""
    if last < 2:
        raise ValueError(f"need last >= 2, got {last=}")
    span = list(history[-last:])
    if len(span) < 2:
        return []
    evicted: dict[tuple[str, str], int] = {}
    for w in span:
        for pair, n in w.pushed_out.items():
            evicted[pair] = evicted.get(pair, 0) + n
    tenants = _pooled([w.by_tenant for w in span])
    out = []
    for (a, b), n in sorted(evicted.items()):
        if a == b or n < min_entries or a not in tenants:
            continue
        own = tenants[a].hit_ratio
        first, newest = _ratio(span[0], b), _ratio(span[-1], b)
        if first is None or newest is None or own > low_hit or first - newest < min_drop:
            continue
        victim_total = sum(v for (x, y), v in evicted.items() if y == b and x != y)
        out.append(
            Finding(
                kind="push-out",
                summary=f"tenant {a!r} evicted {n} of {b!r}'s entries (its own hit ratio {own:.2f}); "
                f"{b!r}'s hit ratio fell {first:.2f} -> {newest:.2f}",
                window=span[-1].index,
                windows=(span[0].index, span[-1].index),
                subject={"tenant": a, "victim": b},
                statistic=float(n),
                score=float(min(1.0, (first - newest) / max(first, 1e-9)) * n / victim_total),
                detail={
                    "evicted": n,
                    "share_of_victim_evictions": n / victim_total,
                    "tenant_hit_ratio": own,
                    "victim_hit_ratio": [first, newest],
                    "per_window": [[w.index, int(w.pushed_out.get((a, b), 0))] for w in span],
                },
            )
        )
    return out


def _pooled(slices: Sequence[Mapping[str, Counts]]) -> dict[str, Counts]:
    out: dict[str, Counts] = {}
    for sl in slices:
        for name, c in sl.items():
            out[name] = out.get(name, Counts(0, 0, 0)) + c
    return out


def _ratio(window: WindowStats, tenant: str) -> float | None:
    c = window.by_tenant.get(tenant)
    return c.hit_ratio if c is not None and c.lookups else None
