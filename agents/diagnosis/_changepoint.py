"""Where the hit ratio changed level: offline change points (ruptures PELT) over the last windows.

ruptures is offline: each call re-runs it on the last ``last`` windows. The cost is the L2 cost with
``jump=1`` (a breakpoint may sit at any window) and a penalty scaled to the series' own noise (``PENALTY``
times the noise variance times log n, noise read from the first differences' median absolute deviation so
that a level shift does not inflate it). Only breakpoints at or near the newest windows are reported: older
ones were news before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .._types import Finding, WindowStats

PENALTY = 3.0  # times sigma^2 log n: a BIC-like price per breakpoint, a little stricter against noise
NOISE_FLOOR = 1e-3  # the least noise assumed: a noiseless series still needs a real step to break


def noise(values: np.ndarray) -> float:
    """A robust noise level: the median absolute first difference over 0.6745 * sqrt(2) (the sd of white
    noise), at least ``NOISE_FLOOR``."""
    if len(values) < 2:
        return NOISE_FLOOR
    diffs = np.diff(values)
    mad = float(np.median(np.abs(diffs - np.median(diffs))))
    return max(mad / (0.6745 * math.sqrt(2)), NOISE_FLOOR)


def breakpoints(values: Sequence[float], *, min_size: int = 1) -> list[int]:
    """PELT breakpoints of ``values`` (ruptures' convention: each is the index where a new segment starts,
    the list ends with ``len(values)``). Raises ``ValueError`` for fewer than 2 values."""
    import ruptures as rpt

    signal = np.asarray(values, dtype=float)
    if len(signal) < 2:
        raise ValueError(f"need at least 2 values for change points, got {len(signal)}")
    sigma = noise(signal)
    pen = PENALTY * sigma**2 * math.log(len(signal))
    return [int(b) for b in rpt.Pelt(model="l2", min_size=min_size, jump=1).fit(signal).predict(pen=pen)]


def changepoint_findings(
    history: Sequence[WindowStats], *, last: int = 20, near: int = 2, min_windows: int = 6
) -> list[Finding]:
    """``change-point`` findings for the hit ratio over the last ``last`` windows of ``history``: each
    breakpoint whose new segment starts within the newest ``near`` windows, with the mean level before (the
    segment before) and after. Nothing with fewer than ``min_windows`` windows. Raises ``ValueError`` for
    ``near < 1`` or ``last < min_windows``."""
    if near < 1 or last < min_windows or min_windows < 3:
        raise ValueError(f"need near >= 1 and last >= min_windows >= 3, got {near=}, {last=}, {min_windows=}")
    span = list(history[-last:])
    if len(span) < min_windows:
        return []
    values = np.array([w.hit_ratio for w in span])
    bps = breakpoints(values)
    starts = [0, *bps[:-1]]
    out = []
    for i, b in enumerate(bps[:-1]):
        if b < len(span) - near:
            continue
        before = float(values[starts[i] : b].mean())
        after = float(values[b : bps[i + 1]].mean())
        out.append(_finding(span, b, before, after, noise(values), bps))
    return out


def _finding(
    span: list[WindowStats], b: int, before: float, after: float, sigma: float, bps: list[int]
) -> Finding:
    at = span[b]
    delta = after - before
    return Finding(
        kind="change-point",
        summary=f"the hit ratio changed level at window {at.index}: {before:.3f} -> {after:.3f}",
        window=at.index,
        windows=(span[0].index, span[-1].index),
        subject={"signal": "hit_ratio"},
        statistic=delta,
        score=float(min(1.0, abs(delta) / max(before, after, 1e-9))),
        detail={
            "before": before,
            "after": after,
            "noise": sigma,
            "breakpoint": b,
            "breakpoints": [span[x].index if x < len(span) else span[-1].index + 1 for x in bps],
            "values": [float(w.hit_ratio) for w in span],
            "penalty": PENALTY,
        },
    )
