"""One PNG per finding, showing its evidence: the report's figures.

Each kind has one drawing function in ``DRAW`` (a plain dict; an unknown kind fails with the known ones).
matplotlib is imported inside ``plot_finding`` and draws on an Agg canvas: no display, no pyplot state, and
the loop's other commands never pay for the import.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._types import Finding, Series, WindowStats

Draw = Callable[[Any, Finding, Sequence[WindowStats], Sequence[Series]], None]


def plot_finding(
    finding: Finding, history: Sequence[WindowStats], series: Sequence[Series], directory: str | Path
) -> str:
    """Draw ``finding``'s evidence into a PNG in ``directory`` (created if missing) and return its path; the
    name is the kind, the window and a digest of the finding, so the same finding gives the same file.
    Raises ``ValueError`` for a kind no drawing function knows."""
    try:
        draw = DRAW[finding.kind]
    except KeyError:
        raise ValueError(
            f"no plot for finding kind {finding.kind!r}; known: {', '.join(sorted(DRAW))}"
        ) from None
    # a Figure on an Agg canvas, no pyplot: nothing global (the backend, pyplot's figure list) changes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(json.dumps(finding.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[
        :10
    ]
    path = out / f"{finding.kind}-w{finding.window}-{digest}.png"
    fig = Figure(figsize=(7, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    draw(ax, finding, history, series)
    ax.set_title(finding.summary if len(finding.summary) <= 90 else finding.summary[:87] + "...", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return str(path)


def _granger(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    labels = tuple(sorted((k, v) for k, v in f.subject.items() if k not in ("cause", "effect")))
    wanted = {f.detail.get("cause", f.subject.get("cause")), f.detail.get("effect", f.subject.get("effect"))}
    found = [s for s in series if s.labels == labels and s.name in wanted]
    lag = int(f.detail.get("lag", 0) or 0)
    for i, s in enumerate(sorted(found, key=lambda s: s.name != f.subject.get("cause"))):
        target = ax if i == 0 else ax.twinx()
        t, name = np.asarray(s.t, dtype=float), s.name
        if i == 0 and lag and len(t) > 1:
            # the cause drawn lag steps later, where it lines up with the miss ratio it predicts
            t, name = t + lag * (t[1] - t[0]), f"{s.name} (+{lag} steps)"
        target.plot(t, s.v, color=f"C{i}", label=name, linewidth=1)
        target.set_ylabel(name, color=f"C{i}")
    ax.set_xlabel("t (s)")
    if not found:
        ax.text(0.5, 0.5, "series not given", ha="center", transform=ax.transAxes)


def _drift(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    values = [np.nan if v is None else v for v in f.detail.get("values", [])]
    idx = [w.index for w in history][-len(values) :] if values else []
    ax.plot(idx, values, marker="o", label=str(f.detail.get("test")))
    lower, upper = f.detail.get("band", (np.nan, np.nan))
    ax.axhspan(lower, upper, alpha=0.2, color="C2", label="band")
    ax.axvline(f.window, color="C3", linestyle="--")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("window")
    ax.legend(fontsize=7)


def _changepoint(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    ax.plot([w.index for w in history], [w.hit_ratio for w in history], marker="o", label="hit ratio")
    ax.axvline(f.window - 0.5, color="C3", linestyle="--", label="change")
    ax.axhline(f.detail["before"], color="C1", linewidth=0.8, label="before")
    ax.axhline(f.detail["after"], color="C2", linewidth=0.8, label="after")
    ax.set_xlabel("window")
    ax.legend(fontsize=7)


def _knee(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    pts = np.asarray(f.detail["points"], dtype=float)
    ax.plot(pts[:, 0], pts[:, 1], marker="o")
    ax.plot([f.detail["x"]], [f.detail["y"]], marker="*", markersize=14, color="C3", label="knee")
    ax.legend(fontsize=7)


def _output(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    past = np.asarray(f.detail["past"], dtype=float)
    ax.plot(past[:, 0], past[:, 1], marker="o", label="past p95")
    ax.plot([f.window], [f.detail["p95"]], marker="*", markersize=14, color="C3", label="newest p95")
    ax.axhspan(*f.detail["band"], alpha=0.2, color="C2", label="band")
    ax.set_xlabel("window")
    ax.legend(fontsize=7)


def _bimodal(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    from ._shapes import log_kde

    window = next((w for w in history if w.index == f.window), None)
    lat = np.array([v for v in (window.latency_ms if window else ()) if v > 0])
    if len(lat) > 1 and np.ptp(lat) > 0:
        grid, density = log_kde(np.log(lat))
        ax.plot(np.exp(grid), density)
        ax.set_xscale("log")
    for ms in f.detail["modes_ms"]:
        ax.axvline(ms, color="C1")
    ax.axvline(f.detail["valley_ms"], color="C3", linestyle="--")
    ax.set_xlabel("latency (ms)")


def _counts(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    ((label, name),) = ((k, v) for k, v in f.subject.items() if k in ("rule", "tenant"))
    attr = "by_rule" if label == "rule" else "by_tenant"
    idx = [w.index for w in history]
    counts = [getattr(w, attr).get(name) for w in history]
    ax.bar(idx, [c.lookups if c else 0 for c in counts], label="lookups")
    ax.bar(idx, [c.hits if c else 0 for c in counts], label="hits")
    ax.set_xlabel("window")
    ax.legend(fontsize=7)


def _push(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    a, b = f.subject["tenant"], f.subject["victim"]
    idx = [w.index for w in history]
    ax.bar(
        idx, [w.pushed_out.get((a, b), 0) for w in history], color="C0", alpha=0.5, label=f"{a} evicts {b}"
    )
    ax.set_ylabel("entries evicted")
    ratios = ax.twinx()
    for i, t in enumerate((a, b)):
        ratios.plot(
            idx,
            [w.by_tenant[t].hit_ratio if t in w.by_tenant else np.nan for w in history],
            marker="o",
            color=f"C{i + 1}",
            label=f"{t} hit ratio",
        )
    ratios.set_ylabel("hit ratio")
    ax.legend(fontsize=7, loc="upper left")
    ratios.legend(fontsize=7, loc="upper right")


def _text(ax: Any, f: Finding, history: Sequence[WindowStats], series: Sequence[Series]) -> None:
    ax.axis("off")
    ax.text(
        0.02,
        0.5,
        "\n".join(f"{k}: {v}" for k, v in f.detail.items()),
        fontsize=8,
        va="center",
        transform=ax.transAxes,
    )


DRAW: dict[str, Draw] = {
    "granger": _granger,
    "key-drift": _drift,
    "mix-drift": _drift,
    "change-point": _changepoint,
    "knee": _knee,
    "output-shift": _output,
    "bimodal-latency": _bimodal,
    "never-hits": _counts,
    "push-out": _push,
    "not-testable": _text,
}
