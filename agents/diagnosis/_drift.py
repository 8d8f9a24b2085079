"""Did the key distribution move: the newest window against its own history.

Raw keys make a poor distribution to compare: KV block hashes and prompts are mostly new in every window,
so two windows' raw distributions are nearly disjoint however steady the traffic is. A window is read instead
as a *profile* that is stable on stationary traffic:

- a key's features are its words when it is text (a semantic cache's prompts: two prompts about one topic
  share words where their exact keys never repeat) and the key itself otherwise (a block hash);
- the profile keeps the ``TOP_K`` heaviest features by name; the rest of the mass is summarised, so the long
  tail of one-off keys weighs as one mass and not as thousands of disjoint points.

Two statistics, each judged against its own history's ``percentile`` band (widened by ``widen`` times the
band's spread and at least ``MIN_MARGIN``, because a band of a handful of windows is itself noisy):

- ``entropy``: the normalised entropy of the window's own profile (its top features plus the rest hashed into
  ``BUCKETS`` buckets); two-sided: traffic that concentrates or spreads out;
- ``jsd``: the Jensen-Shannon divergence (base 2, 0..1) between the window and the pooled ``reference``
  windows before it, over the heaviest features of both plus two tail masses: tail features the reference had,
  tail features it did not. A key space that moves (keys remapped, another tenant's prompts) puts the new
  window's mass in "not in the reference", which stationary traffic, however unique its keys, does not.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .._types import Finding, WindowStats

TOP_K = 128
BUCKETS = 64
MIN_MARGIN = 0.02  # the least distance beyond the band that counts, in the statistic's own 0..1 units
_WORD = re.compile(r"[a-z0-9']+")


@dataclass(frozen=True, slots=True)
class Band:
    """The history's band: ``low``/``high`` the percentiles, ``lower``/``upper`` the widened limits."""

    low: float
    high: float
    lower: float
    upper: float


def key_features(keys: Mapping[str, int]) -> Counter[str]:
    """Lookups per feature: a text key (one with a space) counts once per word, lower-cased; any other key is
    its own feature."""
    out: Counter[str] = Counter()
    for key, n in keys.items():
        if " " in key:
            for word in _WORD.findall(key.lower()):
                out[word] += n
        else:
            out[key] += n
    return out


def window_entropy(features: Counter[str]) -> float:
    """Normalised entropy (0..1) of a window's profile: its ``TOP_K`` features and the rest in ``BUCKETS``
    hashed buckets (crc32, the same in every process). 0 for an empty window."""
    top = features.most_common(TOP_K)
    named = {k for k, _ in top}
    buckets = [0] * BUCKETS
    for key, n in features.items():
        if key not in named:
            buckets[zlib.crc32(key.encode()) % BUCKETS] += n
    mass = np.array([n for _, n in top] + buckets, dtype=float)
    total = mass.sum()
    if total <= 0:
        return 0.0
    p = mass[mass > 0] / total
    return float(-(p * np.log(p)).sum() / math.log(len(mass)))


def divergence(window: Counter[str], reference: Counter[str]) -> float:
    """Jensen-Shannon divergence (base 2) between a window's and a reference's profiles (see the module
    docstring). 0 when either is empty."""
    n_w, n_r = sum(window.values()), sum(reference.values())
    if not n_w or not n_r:
        return 0.0
    combined: Counter[str] = Counter()
    for counts, n in ((window, n_w), (reference, n_r)):
        for key, c in counts.items():
            combined[key] += c / n
    top = [k for k, _ in combined.most_common(TOP_K)]
    p = [window.get(k, 0) / n_w for k in top]
    q = [reference.get(k, 0) / n_r for k in top]
    named = set(top)
    seen = sum(c for k, c in window.items() if k not in named and k in reference) / n_w
    p += [seen, max(0.0, 1.0 - sum(p) - seen)]
    q += [max(0.0, 1.0 - sum(q)), 0.0]
    return _jsd(np.array(p), np.array(q))


def _jsd(p: np.ndarray, q: np.ndarray) -> float:
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / m[nz])).sum())

    return float(min(1.0, max(0.0, (kl(p) + kl(q)) / 2)))


def band(values: Sequence[float], percentile: float, widen: float) -> Band:
    """The ``[100 - percentile, percentile]`` band of ``values``, widened (see the module docstring)."""
    low, high = (float(x) for x in np.percentile(values, [100 - percentile, percentile]))
    margin = max(widen * (high - low), MIN_MARGIN)
    return Band(low, high, low - margin, high + margin)


def drift_findings(
    history: Sequence[WindowStats],
    *,
    percentile: float = 95.0,
    reference: int = 3,
    min_past: int = 3,
    widen: float = 0.5,
    last: int = 30,
) -> list[Finding]:
    """``key-drift`` findings about the newest window of ``history`` (oldest first): its entropy outside the
    band of the windows before it, its divergence from the ``reference`` windows before it above the band of
    the same divergence for each earlier window. Nothing until the history holds ``min_past`` past values of
    a statistic. Only the last ``last`` windows are read (the band's history, and the cost, stay bounded).
    Raises ``ValueError`` for a percentile outside (50, 100] or ``reference``/``min_past`` below 1, or
    ``last`` not above ``min_past + reference``."""
    if not 50 < percentile <= 100:
        raise ValueError(f"percentile must be in (50, 100], got {percentile!r}")
    if reference < 1 or min_past < 1:
        raise ValueError(f"reference and min_past must be >= 1, got {reference!r}, {min_past!r}")
    if last <= min_past + reference:
        raise ValueError(f"last must be above min_past + reference, got {last!r}")
    history = list(history[-last:])
    if len(history) < 2:
        return []
    feats = [key_features(w.keys) for w in history]
    entropies = [window_entropy(f) for f in feats]
    divs = [divergence(feats[t], _pooled(feats[max(0, t - reference) : t])) for t in range(1, len(feats))]
    out = []
    newest = history[-1]
    if len(entropies) - 1 >= min_past:
        b = band(entropies[:-1], percentile, widen)
        if not b.lower <= entropies[-1] <= b.upper:
            out.append(_finding("entropy", entropies[-1], b, entropies, history, percentile))
    if len(divs) - 1 >= min_past:
        b = band(divs[:-1], percentile, widen)
        if divs[-1] > b.upper:
            out.append(
                _finding(
                    "jsd",
                    divs[-1],
                    b,
                    [math.nan, *divs],
                    history,
                    percentile,
                    reference=min(reference, len(history) - 1),
                )
            )
    assert all(f.window == newest.index for f in out)
    return out


def window_mix(window: WindowStats) -> Counter[str]:
    """Requests per (rule, tenant) slice and per prompt-length octave of one window (the mix the
    ``mix-drift`` test compares)."""
    out: Counter[str] = Counter()
    for (rule, tenant), counts in window.by_rule_tenant.items():
        out[f"slice:{rule}/{tenant}"] += counts.requests
    for tokens in window.prompt_tokens:
        out[f"tokens:2^{max(0, int(tokens)).bit_length()}"] += 1
    return out


def mix_divergence(window: Counter[str], reference: Counter[str]) -> float:
    """Jensen-Shannon divergence (base 2) between two mixes, each part normalised on its own (slices, lengths)
    and the two parts averaged; 0 when either is empty."""
    parts = []
    for prefix in ("slice:", "tokens:"):
        w = {k: n for k, n in window.items() if k.startswith(prefix)}
        r = {k: n for k, n in reference.items() if k.startswith(prefix)}
        n_w, n_r = sum(w.values()), sum(r.values())
        if n_w and n_r:
            names = sorted(set(w) | set(r))
            parts.append(_jsd(np.array([w.get(k, 0) / n_w for k in names]),
                              np.array([r.get(k, 0) / n_r for k in names])))
    return float(np.mean(parts)) if parts else 0.0


def mix_drift_findings(
    history: Sequence[WindowStats],
    *,
    percentile: float = 95.0,
    reference: int = 3,
    min_past: int = 3,
    widen: float = 0.5,
    margin: float = 0.05,
    last: int = 30,
) -> list[Finding]:
    """A ``mix-drift`` finding when the newest window's traffic mix (``window_mix``) diverges from the
    ``reference`` windows before it by more than the band of that divergence over the history (widened as
    ``drift_findings`` does, and by at least ``margin``). Nothing until ``min_past`` past divergences."""
    history = list(history[-last:])
    if len(history) < 2:
        return []
    mixes = [window_mix(w) for w in history]
    divs = [mix_divergence(mixes[t], _pooled(mixes[max(0, t - reference) : t])) for t in range(1, len(mixes))]
    if len(divs) - 1 < min_past:
        return []
    b = band(divs[:-1], percentile, widen)
    b = Band(b.low, b.high, b.lower, max(b.upper, b.high + margin))
    if divs[-1] <= b.upper:
        return []
    newest = history[-1]
    before = _pooled(mixes[max(0, len(mixes) - 1 - reference) : -1])
    moved = sorted(
        (k for k in set(mixes[-1]) | set(before) if k.startswith("slice:")),
        key=lambda k: -abs(mixes[-1].get(k, 0) / max(newest.requests, 1) - before.get(k, 0) / max(sum(
            n for key, n in before.items() if key.startswith("slice:")), 1)),
    )[:3]
    excess = divs[-1] - b.upper
    spread = max(b.high - b.low, MIN_MARGIN)
    return [Finding(
        kind="mix-drift",
        summary=f"window {newest.index}: the traffic mix moved (divergence {divs[-1]:.3f} from the "
        f"{min(reference, len(history) - 1)} window(s) before, band up to {b.upper:.3f}; most moved: "
        f"{', '.join(k.removeprefix('slice:') for k in moved) or 'prompt lengths'})",
        window=newest.index,
        windows=(history[0].index, newest.index),
        subject={"mix": "rule-tenant-length"},
        statistic=divs[-1],
        score=float(min(1.0, excess / (excess + spread))),
        detail={"test": "mix-jsd", "band": [b.lower, b.upper], "percentile_band": [b.low, b.high],
                "percentile": percentile, "values": [math.nan, *divs], "direction": "up",
                "reference": min(reference, len(history) - 1),
                "moved": [k.removeprefix("slice:") for k in moved]},
    )]


def _pooled(windows: Sequence[Counter[str]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for w in windows:
        out.update(w)
    return out


def _finding(
    test: str,
    value: float,
    b: Band,
    values: Sequence[float],
    history: Sequence[WindowStats],
    percentile: float,
    reference: int = 0,
) -> Finding:
    newest = history[-1]
    edge = b.upper if value > b.upper else b.lower
    excess = abs(value - edge)
    spread = max(b.high - b.low, MIN_MARGIN)
    what = (
        "its key-distribution entropy"
        if test == "entropy"
        else f"its Jensen-Shannon divergence from the {reference} window(s) before"
    )
    detail = {
        "test": test,
        "band": [b.lower, b.upper],
        "percentile_band": [b.low, b.high],
        "percentile": percentile,
        "values": [float(v) for v in values],
        "direction": "up" if value > b.upper else "down",
    }
    if reference:
        detail["reference"] = reference
    return Finding(
        kind="key-drift",
        summary=f"window {newest.index}: the keys moved ({what} is {value:.3f}, band "
        f"[{b.lower:.3f}, {b.upper:.3f}])",
        window=newest.index,
        windows=(history[0].index, newest.index),
        subject={"keys": test},
        statistic=value,
        score=float(min(1.0, excess / (excess + spread))),
        detail=detail,
    )
