"""Which load signals help predict the miss ratio: Granger causality per label set, corrected for many
tests.

For each label set (overall, each rule, each tenant) and each cause in ``CAUSES``, and for the overall miss
ratio also each device and host series in ``RESOURCE_CAUSES`` (one cause per GPU, named by its index:
``gpu_mem_used[gpu=0]``; a KV cache under memory pressure, or blocks arriving over PCIe, shows there before
it shows in the hit ratio), the pair (cause, miss ratio) is aligned, its NaN steps filled, made stationary (an ADF test; both differenced once when either is
not), given a lag (VAR order by AIC, at most ``max_lag`` and at most what the length allows) and tested with
the F test of ``grangercausalitytests``. The p-values of all pairs that could be tested are corrected together
(Benjamini-Hochberg); a pair that could not be tested (constant, too short, too many gaps) is a
``not-testable`` finding, never an error.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .._types import Finding, Series

EFFECT = "miss_ratio"
CAUSES = ("qps", "long_prompt_share", "prompt_tokens")
RESOURCE_CAUSES = ("gpu_util", "gpu_mem_used", "gpu_pcie_rx", "host_cpu_percent", "host_mem_used")
"""The signals (``agents.signals``: NVML, host) tested as causes of the overall miss ratio."""
MAX_RESOURCE_CAUSES = 8
"""At most this many resource series join the tests (a host with many GPUs: the first ones by name)."""
MIN_POINTS = 12  # below this an F test on two lagged regressions has too few residual degrees of freedom
MAX_GAP_SHARE = 0.5  # a series with more NaN steps than this is mostly guesswork once filled
ADF_ALPHA = 0.05

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Pair:
    labels: Labels
    cause: str
    x: np.ndarray  # the cause, aligned, gaps filled
    y: np.ndarray  # the miss ratio
    filled: int


@dataclass(frozen=True, slots=True)
class _Tested:
    pair: _Pair
    lag: int
    f: float
    p: float
    df: tuple[int, int]
    differenced: bool
    n: int


def granger_findings(
    series: Sequence[Series],
    *,
    window: int,
    windows: tuple[int, int],
    max_lag: int = 4,
    alpha: float = 0.05,
    max_label_sets: int = 12,
) -> list[Finding]:
    """``granger`` findings for the (cause, miss ratio) pairs significant at ``alpha`` after the
    Benjamini-Hochberg correction across every pair tested, and ``not-testable`` findings for the pairs that
    could not be tested. ``window``/``windows`` label the findings. At most ``max_label_sets`` label sets are
    tested (the overall one first, then by traffic), which bounds the cost. Raises ``ValueError`` for
    ``max_lag < 1`` or ``alpha`` outside (0, 1)."""
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 1:
        raise ValueError(f"max_lag must be an int >= 1, got {max_lag!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    tested: list[_Tested] = []
    untestable: list[Finding] = []
    for labels, cause, x, y in _candidates(series, max_label_sets):
        pair, why = _prepare(labels, cause, x, y)
        result = why if pair is None else _test(pair, max_lag)
        if isinstance(result, str):
            untestable.append(_not_testable(labels, cause, result, window, windows))
        else:
            tested.append(result)
    return _correct(tested, alpha, window, windows) + untestable


def _candidates(
    series: Sequence[Series], max_label_sets: int
) -> list[tuple[Labels, str, np.ndarray, np.ndarray]]:
    by_labels: dict[Labels, dict[str, Series]] = {}
    resources: dict[str, Series] = {}
    for s in series:
        if s.name == EFFECT or s.name in CAUSES:
            by_labels.setdefault(s.labels, {})[s.name] = s
        elif s.name in RESOURCE_CAUSES:
            resources[_resource_name(s)] = s

    def traffic(labels: Labels) -> float:
        qps = by_labels[labels].get("qps")
        return float(np.nansum(qps.v)) if qps is not None else 0.0

    ranked = sorted(
        (lb for lb in by_labels if EFFECT in by_labels[lb]), key=lambda lb: (lb != (), -traffic(lb), lb)
    )
    out = []
    for labels in ranked[:max_label_sets]:
        named = by_labels[labels]
        effect = named[EFFECT]
        for cause in CAUSES:
            if cause in named:
                out.append((labels, cause, _values(named[cause], effect), np.asarray(effect.v, dtype=float)))
        if labels == ():
            for cause in sorted(resources)[:MAX_RESOURCE_CAUSES]:
                out.append((labels, cause, _values(resources[cause], effect), np.asarray(effect.v, dtype=float)))
    return out


def _resource_name(s: Series) -> str:
    """``gpu_util[gpu=0]`` for a device's series (its ``name`` label, the model, left out), the bare name for
    the host's."""
    shown = [f"{k}={v}" for k, v in s.labels if k != "name"]
    return f"{s.name}[{','.join(shown)}]" if shown else s.name


def _values(cause: Series, effect: Series) -> np.ndarray:
    if cause.t == effect.t:
        return np.asarray(cause.v, dtype=float)
    if not cause.v:
        return np.full(len(effect.v), np.nan)
    # different steps: read the cause at the effect's steps (nearest earlier point)
    t = np.asarray(cause.t, dtype=float)
    idx = np.searchsorted(t, np.asarray(effect.t, dtype=float), side="right") - 1
    v = np.asarray(cause.v, dtype=float)
    return np.where(idx >= 0, v[np.clip(idx, 0, len(v) - 1)], np.nan)


def _prepare(labels: Labels, cause: str, x: np.ndarray, y: np.ndarray) -> tuple[_Pair | None, str]:
    both = np.isfinite(x) & np.isfinite(y)
    if both.sum() < MIN_POINTS:
        return None, f"{int(both.sum())} steps with both values, need {MIN_POINTS}"
    first, last = np.flatnonzero(both)[[0, -1]]
    x, y, both = x[first : last + 1], y[first : last + 1], both[first : last + 1]
    gaps = int((~both).sum())
    if gaps > MAX_GAP_SHARE * len(both):
        return None, f"{gaps} of {len(both)} steps have no value"
    x, y = _fill(x), _fill(y)
    for name, v in ((cause, x), (EFFECT, y)):
        if np.ptp(v) <= 1e-12 * max(1.0, float(np.max(np.abs(v)))):
            return None, f"{name} is constant"
    return _Pair(labels, cause, x, y, gaps), ""


def _fill(v: np.ndarray) -> np.ndarray:
    # interior gaps only (the ends were trimmed to finite values): linear between the known neighbours
    ok = np.isfinite(v)
    if ok.all():
        return v
    idx = np.arange(len(v))
    return np.interp(idx, idx[ok], v[ok])


def _stationary(v: np.ndarray, max_lag: int) -> bool:
    from statsmodels.tsa.stattools import adfuller

    try:
        with _quiet():
            return bool(adfuller(v, maxlag=max(0, max_lag), autolag="AIC")[1] < ADF_ALPHA)
    except ValueError:  # too short for the regression or constant: leave it as it is
        return True


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence what the lag and stationarity searches say about their candidates: 0.15's notice that
    ``adfuller`` will return a result object (index 1 is the p-value in both), and rank warnings for a
    candidate order that a periodic series makes singular (``_full_rank_lag`` decides what is tested)."""
    from statsmodels.tools.sm_exceptions import SingularMatrixWarning, ValueWarning

    with warnings.catch_warnings():
        for category in (FutureWarning, SingularMatrixWarning, ValueWarning, RuntimeWarning):
            warnings.simplefilter("ignore", category)
        yield


def _full_rank_lag(data: np.ndarray, lag: int) -> int:
    """The largest lag <= ``lag`` whose unrestricted regression (a constant, ``lag`` lags of each column)
    has full column rank; 0 when none has (a periodic cause repeats its own lags)."""
    n = len(data)
    for p in range(lag, 0, -1):
        cols = [np.ones(n - p)] + [data[p - k : n - k, c] for c in (0, 1) for k in range(1, p + 1)]
        if np.linalg.matrix_rank(np.column_stack(cols)) == 2 * p + 1:
            return p
    return 0


def _test(pair: _Pair, max_lag: int) -> _Tested | str:
    from statsmodels.tools.sm_exceptions import InfeasibleTestError
    from statsmodels.tsa.stattools import grangercausalitytests

    x, y = pair.x, pair.y
    bound = _lag_bound(len(x), max_lag)
    differenced = not (_stationary(x, bound) and _stationary(y, bound))
    if differenced:
        x, y = np.diff(x), np.diff(y)
        if np.ptp(x) <= 1e-12 or np.ptp(y) <= 1e-12:
            return "constant once differenced"
        bound = _lag_bound(len(x), max_lag)
    if bound < 1:
        return f"{len(x)} steps leave no room for a lag"
    data = np.column_stack([y, x])  # column 2 Granger-causes column 1
    lag = _full_rank_lag(data, _select_lag(data, bound))
    if lag == 0:
        return f"the lags of {pair.cause} and {EFFECT} are collinear"
    try:
        res = grangercausalitytests(data, maxlag=[lag])
    except (InfeasibleTestError, ValueError, np.linalg.LinAlgError) as exc:
        return f"the F test cannot run ({exc})"
    f, p, df_denom, df_num = res[lag][0]["ssr_ftest"]
    if not (math.isfinite(f) and math.isfinite(p)):
        return "the F test gave no finite statistic (a perfect fit)"
    return _Tested(pair, lag, float(f), float(p), (int(df_num), int(df_denom)), differenced, len(x))


def _lag_bound(n: int, max_lag: int) -> int:
    # the unrestricted regression has 2*lag + 1 parameters on n - lag rows: keep >= 2*lag residual dof
    return min(max_lag, (n - 2) // 5)


def _select_lag(data: np.ndarray, bound: int) -> int:
    from statsmodels.tsa.api import VAR

    try:
        with _quiet():
            chosen = VAR(data).select_order(maxlags=bound).selected_orders["aic"]
    except (ValueError, np.linalg.LinAlgError):
        return 1
    return int(min(bound, max(1, chosen)))


def _correct(tested: list[_Tested], alpha: float, window: int, windows: tuple[int, int]) -> list[Finding]:
    if not tested:
        return []
    from statsmodels.stats.multitest import multipletests

    reject, corrected, _, _ = multipletests([t.p for t in tested], alpha=alpha, method="fdr_bh")
    out = []
    for t, keep, p_adj in zip(tested, reject, corrected, strict=True):
        if keep:
            out.append(_granger(t, float(p_adj), len(tested), window, windows))
    return out


def _granger(t: _Tested, p_adj: float, n_tests: int, window: int, windows: tuple[int, int]) -> Finding:
    df_num, df_denom = t.df
    # partial R^2 of the cause's lags: how much of the miss ratio's remaining variance they explain
    strength = t.f * df_num / (t.f * df_num + df_denom)
    where = ", ".join(f"{k}={v}" for k, v in t.pair.labels) or "overall"
    return Finding(
        kind="granger",
        summary=f"{t.pair.cause} helps predict {EFFECT} {t.lag} step(s) ahead ({where}; "
        f"F={t.f:.2f}, BH p={p_adj:.3g})",
        window=window,
        windows=windows,
        subject=_subject(t.pair.labels, t.pair.cause),
        statistic=t.f,
        p_value=p_adj,
        score=float(min(1.0, max(0.0, strength))),
        detail={
            "cause": t.pair.cause,
            "effect": EFFECT,
            "lag": t.lag,
            "lag_selection": "aic",
            "p_raw": t.p,
            "df": list(t.df),
            "differenced": t.differenced,
            "points": t.n,
            "filled": t.pair.filled,
            "tests": n_tests,
            "correction": "fdr_bh",
        },
    )


def _not_testable(labels: Labels, cause: str, why: str, window: int, windows: tuple[int, int]) -> Finding:
    where = ", ".join(f"{k}={v}" for k, v in labels) or "overall"
    return Finding(
        kind="not-testable",
        summary=f"granger {cause} -> {EFFECT} ({where}) not testable: {why}",
        window=window,
        windows=windows,
        subject=_subject(labels, cause),
        detail={"test": "granger", "cause": cause, "effect": EFFECT, "reason": why},
    )


def _subject(labels: Labels, cause: str) -> dict[str, str]:
    return {**dict(labels), "cause": cause, "effect": EFFECT}
