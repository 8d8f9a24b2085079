"""The knee of a hit-ratio curve: where more of x (cache capacity, load) stops paying as it did.

On a curve with x ascending the slope between neighbours is compared point by point; the knee is the point
where the slope falls most (the most negative second difference, measured on the curve scaled to the unit
square so that units do not matter) among the points where the slope after is at most ``SHARP`` times the
slope before (a bend, where a smooth concave curve's early, gentle turns do not count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .._types import Finding

SHARP = 0.5  # the slope after the knee must be at most half the slope before: a bend, not a wobble


def knee(
    points: Sequence[tuple[float, float]],
    *,
    window: int = -1,
    windows: tuple[int, int] = (-1, -1),
    subject: Mapping[str, str] | None = None,
) -> Finding | None:
    """A ``knee`` finding for the curve ``points`` ((x, hit ratio), x strictly ascending), or None when it
    has no sharp bend (a straight line, a convex curve, fewer than 3 points). ``window``, ``windows`` and
    ``subject`` label it (a replayed curve belongs to no window: -1). Raises ``ValueError`` for x not
    strictly ascending or a value that is not finite."""
    pts = np.asarray(points, dtype=float).reshape(-1, 2) if len(points) else np.zeros((0, 2))
    if not np.isfinite(pts).all():
        raise ValueError("knee: every x and y must be finite")
    if len(pts) and not (np.diff(pts[:, 0]) > 0).all():
        raise ValueError("knee: x must be strictly ascending")
    if len(pts) < 3:
        return None
    x, y = pts[:, 0], pts[:, 1]
    xs = (x - x[0]) / (x[-1] - x[0])
    yr = float(np.ptp(y))
    if yr <= 0:
        return None
    slopes = np.diff((y - y.min()) / yr) / np.diff(xs)
    drops = np.diff(slopes)  # at interior point i + 1
    sharp = [i for i in range(len(drops)) if slopes[i] > 0 and slopes[i + 1] <= SHARP * slopes[i]]
    if not sharp:
        return None
    i = min(sharp, key=lambda j: drops[j])
    before, after = float(slopes[i]), float(slopes[i + 1])
    raw_before = float((y[i + 1] - y[i]) / (x[i + 1] - x[i]))
    raw_after = float((y[i + 2] - y[i + 1]) / (x[i + 2] - x[i + 1]))
    k = i + 1
    return Finding(
        kind="knee",
        summary=f"the curve bends at x={x[k]:g} (y={y[k]:.3f}): slope {raw_before:.3g} before, "
        f"{raw_after:.3g} after",
        window=window,
        windows=windows,
        subject=dict(subject or {}),
        statistic=float(x[k]),
        score=float(min(1.0, max(0.0, 1.0 - after / before))),
        detail={
            "x": float(x[k]),
            "y": float(y[k]),
            "slope_before": raw_before,
            "slope_after": raw_after,
            "points": [[float(a), float(b)] for a, b in pts],
            "sharp": SHARP,
            "drop": float(-drops[i]) if math.isfinite(drops[i]) else None,
        },
    )
