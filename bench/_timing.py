"""Latency figures the serving benches share: quantiles, a side-by-side comparison row, and interleaved rounds.

This machine is shared and noisy, so a comparison never measures one side after the other: ``interleaved`` runs
the sides in rounds whose order rotates, and ``compared`` reports p50 and p99 of both and their ratios.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def latency(samples_s: Sequence[float]) -> dict[str, float]:
    return {"p50_ms": quantile(samples_s, 0.5) * 1e3, "p99_ms": quantile(samples_s, 0.99) * 1e3}


def compared(name: str, path: str, evocache_s: Sequence[float], baseline_s: Sequence[float], baseline: str,
             target: float | None) -> dict[str, Any]:
    """One comparison row: p50 and p99 of both sides in ms, their ratios, and the p50 ratio aimed at (None: the
    baseline is shown for scale, with no target)."""
    ours, theirs = latency(evocache_s), latency(baseline_s)
    return {"comparison": name, "path": path, "baseline": baseline, "samples": len(evocache_s),
            "baseline_samples": len(baseline_s),
            "evocache_p50_ms": ours["p50_ms"], "evocache_p99_ms": ours["p99_ms"],
            "baseline_p50_ms": theirs["p50_ms"], "baseline_p99_ms": theirs["p99_ms"],
            "ratio_p50": ours["p50_ms"] / theirs["p50_ms"], "ratio_p99": ours["p99_ms"] / theirs["p99_ms"],
            "target_p50_ratio": target}


def interleaved(sides: Mapping[str, Callable[[], object]], rounds: int,
                per_round: int | Mapping[str, int]) -> dict[str, list[float]]:
    """Seconds per call of each side over ``rounds`` rounds of ``per_round`` calls (one count for all, or one
    per side), the sides' order rotating from round to round, so a noisy spell of the machine falls on all."""
    names = list(sides)
    counts = per_round if isinstance(per_round, Mapping) else dict.fromkeys(names, per_round)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            call = sides[name]
            for _ in range(counts[name]):
                t0 = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - t0)
    return samples
