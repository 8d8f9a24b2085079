"""The diagnosis as one call: its configuration and ``diagnose``, which runs every test."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .._types import Finding, Series, WindowStats
from ._changepoint import changepoint_findings
from ._drift import drift_findings, mix_drift_findings
from ._granger import granger_findings
from ._knee import knee
from ._plots import plot_finding
from ._shapes import bimodal_latency, output_shift
from ._traffic import never_hits, push_out


@dataclass(frozen=True, slots=True)
class DiagnosisConfig:
    """What the tests may look at and how strict they are.

    Granger: ``max_lag`` (the most lags a pair is given), ``alpha`` (after Benjamini-Hochberg),
    ``granger_label_sets`` (the most label sets tested; each costs three tests). Drift: ``drift_percentile``
    (the band), ``drift_reference`` (windows pooled as the reference), ``drift_widen``, ``drift_last``
    (windows read). ``min_windows``: the past windows a band needs (drift, output shift). Change points:
    ``changepoint_last`` windows re-read, ``changepoint_near`` (how recent a breakpoint must be to be news),
    ``changepoint_min_windows``. Traffic: ``traffic_windows`` pooled, ``never_hit_min_lookups``,
    ``push_out_min_entries``, ``push_out_low_hit``, ``push_out_min_drop``. Latency: ``bimodal_valley_ratio``.
    Raises ``ValueError`` for a value out of range.
    """

    max_lag: int = 4
    alpha: float = 0.05
    granger_label_sets: int = 12
    drift_percentile: float = 95.0
    drift_reference: int = 3
    drift_widen: float = 0.5
    drift_last: int = 30
    min_windows: int = 3
    changepoint_last: int = 20
    changepoint_near: int = 2
    changepoint_min_windows: int = 6
    traffic_windows: int = 3
    never_hit_min_lookups: int = 100
    push_out_min_entries: int = 10
    push_out_low_hit: float = 0.2
    push_out_min_drop: float = 0.05
    bimodal_valley_ratio: float = 0.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = int if f.type in ("int", int) else float
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise ValueError(f"DiagnosisConfig.{f.name} must be {kind.__name__}, got {value!r}")
        checks = {
            "max_lag": self.max_lag >= 1,
            "alpha": 0 < self.alpha < 1,
            "granger_label_sets": self.granger_label_sets >= 1,
            "drift_percentile": 50 < self.drift_percentile <= 100,
            "drift_reference": self.drift_reference >= 1,
            "drift_last": self.drift_last > self.min_windows + self.drift_reference,
            "drift_widen": self.drift_widen >= 0,
            "min_windows": self.min_windows >= 1,
            "changepoint_min_windows": 3 <= self.changepoint_min_windows <= self.changepoint_last,
            "changepoint_near": self.changepoint_near >= 1,
            "traffic_windows": self.traffic_windows >= 2,
            "never_hit_min_lookups": self.never_hit_min_lookups >= 1,
            "push_out_min_entries": self.push_out_min_entries >= 1,
            "push_out_low_hit": 0 <= self.push_out_low_hit <= 1,
            "push_out_min_drop": 0 <= self.push_out_min_drop <= 1,
            "bimodal_valley_ratio": 0 < self.bimodal_valley_ratio < 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"DiagnosisConfig: out of range: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}"
            )


def diagnose(
    history: Sequence[WindowStats],
    series: Sequence[Series],
    *,
    config: DiagnosisConfig = DiagnosisConfig(),
    curve: Sequence[tuple[float, float]] | None = None,
    plots_dir: str | Path | None = None,
) -> list[Finding]:
    """Every test on ``history`` (oldest first) and ``series``, findings sorted by score, strongest first
    (ties keep the order the tests ran in). ``curve``: a hit-ratio curve (x ascending, from a replay) to find
    the knee of. With ``plots_dir`` each finding but a not-testable one carries the path of its PNG there.
    Raises ``ValueError`` for
    an empty history."""
    if not history:
        raise ValueError("diagnose needs at least one window")
    c = config
    newest = history[-1]
    span = (history[0].index, newest.index)
    found: list[Finding] = []
    found += granger_findings(
        series,
        window=newest.index,
        windows=span,
        max_lag=c.max_lag,
        alpha=c.alpha,
        max_label_sets=c.granger_label_sets,
    )
    band = {
        "percentile": c.drift_percentile,
        "reference": c.drift_reference,
        "min_past": c.min_windows,
        "widen": c.drift_widen,
        "last": c.drift_last,
    }
    found += drift_findings(history, **band)  # the keys, and the traffic mix, against their own history
    found += mix_drift_findings(history, **band)
    found += changepoint_findings(
        history, last=c.changepoint_last, near=c.changepoint_near, min_windows=c.changepoint_min_windows
    )
    found += never_hits(history, last=c.traffic_windows, min_lookups=c.never_hit_min_lookups)
    found += push_out(
        history,
        last=c.traffic_windows,
        min_entries=c.push_out_min_entries,
        low_hit=c.push_out_low_hit,
        min_drop=c.push_out_min_drop,
    )
    singles = [
        output_shift(history, min_past=c.min_windows),
        bimodal_latency(newest, valley_ratio=c.bimodal_valley_ratio),
        knee(curve, window=newest.index, windows=span) if curve is not None else None,
    ]
    found += [f for f in singles if f is not None]
    found.sort(key=lambda f: -f.score)
    if plots_dir is not None:  # a not-testable note is text; its plot would only repeat it
        found = [
            f if f.kind == "not-testable" else replace(f, plot=plot_finding(f, history, series, plots_dir))
            for f in found
        ]
    return found
