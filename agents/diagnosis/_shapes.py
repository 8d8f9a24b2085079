"""The shape of a window's distributions: output lengths leaving their band, latency with two modes.

- ``output_shift``: the newest window's p95 of output tokens against the band of the past windows' p95s
  (mean +- ``K_SD`` sd, never narrower than their min..max widened by ``REL_MARGIN`` of the mean): a model
  or a prompt change that makes answers longer changes what a cached response is worth.
- ``bimodal_latency``: a Gaussian KDE of log latency; two modes with a valley at most ``valley_ratio`` of
  the smaller peak are fast calls and cold starts (a model loading, a KV prefix fetched from a lower tier).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .._types import Finding, WindowStats

K_SD = 3.0
REL_MARGIN = 0.1
MIN_VALUES = 20  # a window's p95 from fewer values is one or two requests' say
MIN_LATENCIES = 50
GRID = 512


def output_shift(history: Sequence[WindowStats], *, min_past: int = 3) -> Finding | None:
    """An ``output-shift`` finding when the newest window's output-token p95 is outside the band of the
    past windows' p95s (windows with fewer than ``MIN_VALUES`` known lengths are left out), or None; None
    too with fewer than ``min_past`` past windows to judge by."""
    if not history or len(history[-1].output_tokens) < MIN_VALUES:
        return None
    past = [
        (w.index, float(np.percentile(w.output_tokens, 95)))
        for w in history[:-1]
        if len(w.output_tokens) >= MIN_VALUES
    ]
    if len(past) < max(1, min_past):
        return None
    p95s = np.array([v for _, v in past])
    mean, sd = float(p95s.mean()), float(p95s.std(ddof=1))
    # integer token counts often give equal p95s (sd 0): never narrower than min..max widened by REL_MARGIN
    margin = max(REL_MARGIN * abs(mean), 1.0)
    lower = min(mean - K_SD * sd, float(p95s.min()) - margin)
    upper = max(mean + K_SD * sd, float(p95s.max()) + margin)
    newest = history[-1]
    value = float(np.percentile(newest.output_tokens, 95))
    if lower <= value <= upper:
        return None
    edge = upper if value > upper else lower
    return Finding(
        kind="output-shift",
        summary=f"window {newest.index}: output p95 {value:.0f} tokens, outside the past band "
        f"[{lower:.0f}, {upper:.0f}]",
        window=newest.index,
        windows=(past[0][0], newest.index),
        subject={"signal": "output_tokens"},
        statistic=value,
        score=float(min(1.0, abs(value - edge) / max(abs(mean), 1.0))),
        detail={
            "p95": value,
            "band": [lower, upper],
            "mean": mean,
            "sd": sd,
            "past": [[i, v] for i, v in past],
            "direction": "up" if value > upper else "down",
        },
    )


def bimodal_latency(
    window: WindowStats, *, valley_ratio: float = 0.5, windows: tuple[int, int] | None = None
) -> Finding | None:
    """A ``bimodal-latency`` finding for ``window``'s latencies (positive ones, at least ``MIN_LATENCIES``)
    when their log-KDE has two modes with a valley at most ``valley_ratio`` of the smaller peak; None
    otherwise. Reports both modes and the valley in ms and the share of calls in the slow mode."""
    if not 0 < valley_ratio < 1:
        raise ValueError(f"valley_ratio must be in (0, 1), got {valley_ratio!r}")
    lat = np.array([v for v in window.latency_ms if v > 0 and math.isfinite(v)])
    if len(lat) < MIN_LATENCIES:
        return None
    logs = np.log(lat)
    if np.ptp(logs) <= 1e-9:
        return None
    grid, density = log_kde(logs)
    peaks = [i for i in range(1, GRID - 1) if density[i - 1] < density[i] >= density[i + 1]]
    if len(peaks) < 2:
        return None
    a, b = sorted(sorted(peaks, key=lambda i: density[i])[-2:])
    v = a + int(np.argmin(density[a : b + 1]))
    smaller = min(density[a], density[b])
    ratio = float(density[v] / smaller)
    if ratio > valley_ratio:
        return None
    slow = float((logs > grid[v]).mean())
    fast_ms, slow_ms, valley_ms = (float(math.exp(grid[i])) for i in (a, b, v))
    return Finding(
        kind="bimodal-latency",
        summary=f"window {window.index}: latency has two modes, {fast_ms:.3g} ms and {slow_ms:.3g} ms; "
        f"{slow:.0%} of calls are in the slow one (cold starts)",
        window=window.index,
        windows=windows or (window.index, window.index),
        subject={"signal": "latency_ms"},
        statistic=ratio,
        score=float(min(1.0, (1.0 - ratio) * min(1.0, 4 * slow))),
        detail={
            "modes_ms": [fast_ms, slow_ms],
            "valley_ms": valley_ms,
            "valley_ratio": ratio,
            "slow_share": slow,
            "n": len(lat),
            "threshold": valley_ratio,
        },
    )


def log_kde(logs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The grid (log ms, ``GRID`` points, the data's range padded by 3 bandwidths) and the KDE on it."""
    from scipy.stats import gaussian_kde

    kde = gaussian_kde(logs)
    pad = 3 * float(np.sqrt(kde.covariance[0, 0]))
    grid = np.linspace(logs.min() - pad, logs.max() + pad, GRID)
    return grid, kde(grid)
