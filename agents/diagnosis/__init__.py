"""The loop's diagnosis: what drives the misses, and what changed.

    findings = diagnose(history, series)                 # every test, strongest first
    findings = diagnose(history, series, plots_dir="report/plots")   # each finding with its PNG

``history`` is the windows so far (oldest first, the newest last), ``series`` the per-step signals of the
same stretch (``step_series``). Each test is one module: Granger causality of the load signals on the miss
ratio (``_granger``), key and traffic-mix drift (``_drift``), change points of the hit ratio
(``_changepoint``), the knee of a hit-ratio curve (``_knee``), output-length shifts and bimodal latency
(``_shapes``), traffic that never hits and tenants that push others out (``_traffic``), and the plots
(``_plots``). statsmodels, ruptures, scipy and matplotlib are imported inside the functions that use them.
"""

from ._changepoint import changepoint_findings
from ._diagnose import DiagnosisConfig, diagnose
from ._drift import drift_findings, mix_drift_findings
from ._granger import granger_findings
from ._knee import knee
from ._plots import plot_finding
from ._shapes import bimodal_latency, output_shift
from ._traffic import never_hits, push_out

__all__ = [
    "DiagnosisConfig",
    "bimodal_latency",
    "changepoint_findings",
    "diagnose",
    "drift_findings",
    "granger_findings",
    "knee",
    "mix_drift_findings",
    "never_hits",
    "output_shift",
    "plot_finding",
    "push_out",
]
