"""The loop's diagnosis: each test on data whose answer is known, the drift tests on slices of real traces."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from evocache.agents._types import (
    Counts,
    Finding,
    Outcome,
    Request,
    Series,
    WindowStats,
    step_series,
    window_stats,
)
from evocache.agents.diagnosis import (
    DiagnosisConfig,
    bimodal_latency,
    changepoint_findings,
    diagnose,
    drift_findings,
    granger_findings,
    knee,
    never_hits,
    output_shift,
    plot_finding,
    push_out,
)
from evocache.agents.diagnosis._changepoint import breakpoints
from evocache.agents.diagnosis._drift import divergence, key_features
from evocache.controller.replay import read_trace

DATA = Path(__file__).parent / "data" / "agents_diag"
WINDOW = 300  # requests per window in the drift tests


# ---------------------------------------------------------------- helpers


def _series(name: str, values, labels=()) -> Series:
    return Series(
        name, tuple(labels), tuple(float(i) for i in range(len(values))), tuple(float(v) for v in values)
    )


def _lagged(n=200, lag=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = np.zeros(n)
    e = rng.normal(scale=0.5, size=n)
    y[lag:] = 0.8 * x[:-lag]
    return x + 5.0, y + e + 0.5, rng


def _window(index: int, lookups: int, hits: int, **kw) -> WindowStats:
    return WindowStats(
        index=index,
        start=float(index),
        end=float(index) + 1,
        policy="p@1",
        requests=lookups,
        lookups=lookups,
        hits=hits,
        **kw,
    )


def _stats(windows_of_requests) -> list[WindowStats]:
    return [
        window_stats(i, "p@1", w, [Outcome(len(r.keys), 0) for r in w])
        for i, w in enumerate(windows_of_requests)
    ]


def _chunks(requests, size=WINDOW):
    return [requests[i : i + size] for i in range(0, len(requests) - size + 1, size)]


def _mooncake() -> list[Request]:
    blocks: dict[int, list[str]] = {}
    times: dict[int, float] = {}
    with gzip.open(DATA / "mooncake_head2400.jsonl.gz", "rt", encoding="utf-8") as fh:
        for a in read_trace(fh, "mooncake"):
            blocks.setdefault(a.req, []).append(a.key)
            times[a.req] = a.t
    return [Request(t=times[r], kind="kv", keys=tuple(blocks[r])) for r in sorted(blocks)]


def _stream(name: str) -> list[Request]:
    with gzip.open(DATA / name, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [
        Request(t=float(i), kind="semantic", keys=(r["prompt"],), prompt=r["prompt"], group=r["group"])
        for i, r in enumerate(rows)
    ]


def _flagged(history: list[WindowStats]) -> dict[int, set[str]]:
    """The windows drift is reported at, as the loop sees them: each window judged when it arrives."""
    out: dict[int, set[str]] = {}
    for t in range(2, len(history) + 1):
        for f in drift_findings(history[:t]):
            out.setdefault(f.window, set()).add(f.detail["test"])
    return out


# ---------------------------------------------------------------- Granger


def test_granger_finds_the_cause_at_its_lag_and_nothing_in_noise():
    x, y, rng = _lagged()
    series = [
        _series("qps", x),
        _series("miss_ratio", y),
        _series("prompt_tokens", rng.normal(size=200) + 100),
        _series("long_prompt_share", rng.uniform(size=200)),
    ]
    found = granger_findings(series, window=9, windows=(0, 9))
    assert [(f.kind, f.subject["cause"], f.detail["lag"]) for f in found] == [("granger", "qps", 2)]
    f = found[0]
    assert f.subject == {"cause": "qps", "effect": "miss_ratio"}
    assert f.detail["effect"] == "miss_ratio" and f.detail["tests"] == 3 and f.detail["differenced"] is False
    assert f.statistic > 50 and f.p_value < 1e-10 and 0 < f.score <= 1
    assert f.window == 9 and f.windows == (0, 9)


def test_granger_tests_gpu_and_host_signals_as_causes_of_the_overall_miss_ratio():
    # GPU 1's memory fills two steps before the misses come; GPU 0, the host and the load say nothing
    x, y, rng = _lagged()
    gpu = lambda i: (("gpu", str(i)), ("name", "NVIDIA H200"))  # noqa: E731
    series = [
        _series("qps", rng.normal(size=200) + 10),
        _series("miss_ratio", y),
        _series("gpu_mem_used", rng.normal(size=200) + 40, gpu(0)),
        _series("gpu_mem_used", x, gpu(1)),
        _series("gpu_util", [55.0] * 200, gpu(0)),
        _series("host_cpu_percent", rng.uniform(size=200) * 100),
        _series("gpu_mem_total", x, gpu(1)),  # a capacity, not a load: never a cause
    ]
    found = granger_findings(series, window=4, windows=(0, 4))
    significant = [(f.subject["cause"], f.detail["lag"]) for f in found if f.kind == "granger"]
    assert significant == [("gpu_mem_used[gpu=1]", 2)]
    assert found[0].detail["tests"] == 4  # qps, both GPUs' memory, the host's CPU
    assert [(f.subject["cause"], f.detail["reason"]) for f in found if f.kind == "not-testable"] == [
        ("gpu_util[gpu=0]", "gpu_util[gpu=0] is constant")
    ]


def test_granger_independent_noise_gives_nothing_after_correction():
    rng = np.random.default_rng(7)
    series = []
    for k in range(5):
        labels = (("rule", f"r{k}"),)
        for name in ("qps", "miss_ratio", "prompt_tokens", "long_prompt_share"):
            series.append(_series(name, rng.normal(size=120), labels))
    assert granger_findings(series, window=0, windows=(0, 0)) == []


def test_granger_constant_and_short_series_are_not_testable():
    x, y, _ = _lagged()
    series = [
        _series("qps", x),
        _series("miss_ratio", [0.4] * 200),
        _series("long_prompt_share", [0.5] * 200),
        _series("qps", x[:8], [("tenant", "t")]),
        _series("miss_ratio", y[:8], [("tenant", "t")]),
    ]
    found = granger_findings(series, window=3, windows=(0, 3))
    assert sorted(
        (f.kind, f.subject.get("tenant", ""), f.subject["cause"], f.detail["reason"]) for f in found
    ) == [
        ("not-testable", "", "long_prompt_share", "long_prompt_share is constant"),
        ("not-testable", "", "qps", "miss_ratio is constant"),
        ("not-testable", "t", "qps", "8 steps with both values, need 12"),
    ]


def test_granger_fills_gaps_and_differences_random_walks():
    x, y, rng = _lagged(n=240)
    y_gaps = y.copy()
    y_gaps[[10, 50, 51, 120]] = np.nan
    found = granger_findings([_series("qps", x), _series("miss_ratio", y_gaps)], window=0, windows=(0, 0))
    assert [(f.detail["lag"], f.detail["filled"]) for f in found] == [(2, 4)]

    walk_x = np.cumsum(rng.normal(size=240))
    walk_y = np.concatenate([[0.0, 0.0], walk_x[:-2]]) + np.cumsum(rng.normal(scale=0.3, size=240))
    found = granger_findings(
        [_series("qps", walk_x), _series("miss_ratio", walk_y)], window=0, windows=(0, 0)
    )
    assert [(f.kind, f.detail["differenced"], f.detail["lag"]) for f in found] == [("granger", True, 2)]


def test_granger_mostly_empty_series_is_not_testable_and_label_sets_are_bounded():
    y = [np.nan] * 100
    y[::3] = [0.5 + 0.01 * i for i in range(34)]
    found = granger_findings([_series("qps", range(100)), _series("miss_ratio", y)], window=0, windows=(0, 0))
    assert [(f.kind, f.detail["reason"]) for f in found] == [
        ("not-testable", "66 of 100 steps have no value")
    ]

    rng = np.random.default_rng(1)
    series = [
        _series(n, rng.normal(size=60), [("rule", f"r{k}")]) for k in range(6) for n in ("qps", "miss_ratio")
    ]
    x, y, _ = _lagged(n=60)
    series += [_series("qps", x), _series("miss_ratio", y)]
    found = granger_findings(series, window=0, windows=(0, 0), max_label_sets=2)
    assert [(f.subject.get("rule", ""), f.detail["tests"]) for f in found] == [("", 2)]
    with pytest.raises(ValueError, match="max_lag"):
        granger_findings(series, window=0, windows=(0, 0), max_lag=0)


def test_granger_periodic_cause_is_tested_at_a_lag_its_design_allows():
    # a cause alternating 0, 1 repeats itself two steps on: at lag 2 its lags are collinear with the constant
    rng = np.random.default_rng(5)
    x = np.arange(200) % 2
    y = 0.5 + 0.3 * np.concatenate([[0, 0], x[:-2]]) + rng.normal(scale=0.05, size=200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = granger_findings([_series("qps", x), _series("miss_ratio", y)], window=0, windows=(0, 0))
    assert [(f.kind, f.detail["lag"]) for f in found] == [("granger", 1)]


def test_granger_reads_step_series():
    # the miss ratio follows the load two steps later: a burst fills the cache with one-off keys
    rng = np.random.default_rng(3)
    load = rng.integers(2, 12, size=150)
    requests, outcomes = [], []
    for step in range(150):
        earlier = load[step - 2] if step >= 2 else 7
        for j in range(int(load[step])):
            requests.append(Request(t=step + j / 20, kind="response", keys=(f"k{step}-{j}",), rule="faq"))
            outcomes.append(Outcome(1, int(rng.uniform() < 1.0 - earlier / 13)))
    series = step_series(requests, outcomes, start=0.0, end=150.0, step_s=1.0)
    found = [f for f in granger_findings(series, window=0, windows=(0, 0)) if f.kind == "granger"]
    assert {(f.subject.get("rule", ""), f.subject["cause"], f.detail["lag"]) for f in found} == {
        ("", "qps", 2),
        ("faq", "qps", 2),
    }


# ---------------------------------------------------------------- drift, on slices of real traces


def test_drift_none_on_stationary_real_traffic():
    mooncake = _mooncake()
    assert len(mooncake) == 2400
    assert _flagged(_stats(_chunks(mooncake))) == {}
    banking = _stream("banking77_head1800.jsonl.gz")
    assert _flagged(_stats(_chunks(banking))) == {}
    shuffled = list(banking)
    np.random.default_rng(0).shuffle(shuffled)
    assert _flagged(_stats(_chunks(shuffled))) == {}
    assert _flagged(_stats(_chunks(_stream("clinc150_head1200.jsonl.gz")))) == {}


def test_drift_found_when_mooncake_keys_move():
    mooncake = _mooncake()
    # the second part is the same traffic in another key space (another tenant's salt in every block hash)
    moved = [replace(r, keys=tuple(f"b/{k}" for k in r.keys), ns="b") for r in mooncake[1500:]]
    history = _stats(_chunks(mooncake[:1500] + moved))
    assert _flagged(history) == {5: {"jsd"}}
    (f,) = drift_findings(history[:6])
    assert f.kind == "key-drift" and f.window == 5 and f.windows == (0, 5)
    assert f.statistic == pytest.approx(1.0) and f.statistic > f.detail["band"][1] and 0 < f.score <= 1


def test_drift_found_when_the_prompts_change_source():
    banking = _stream("banking77_head1800.jsonl.gz")
    clinc = _stream("clinc150_head1200.jsonl.gz")
    assert _flagged(_stats(_chunks(banking[:1500] + clinc[:900]))) == {5: {"jsd"}}
    assert _flagged(_stats(_chunks(clinc + banking[:900]))) == {4: {"jsd"}}
    assert _flagged(_stats(_chunks(_mooncake()[:1500] + banking[:900]))) == {5: {"entropy", "jsd"}}


def test_drift_profile_is_stable_where_raw_keys_are_disjoint():
    a = key_features({"my card has not arrived": 1, "where is my card": 1})
    b = key_features({"has my card arrived yet": 1, "card not here": 1})
    assert a["card"] == 2 and "my" in b
    assert divergence(a, a) == 0.0
    assert divergence(key_features({"x1": 1, "x2": 1}), key_features({"y1": 1, "y2": 1})) == pytest.approx(
        1.0
    )
    assert drift_findings(_stats(_chunks(_stream("banking77_head1800.jsonl.gz"))[:2])) == []
    with pytest.raises(ValueError, match="percentile"):
        drift_findings([], percentile=40)


# ---------------------------------------------------------------- change points


def _hit_windows(ratios, lookups=1000):
    return [_window(i, lookups, round(r * lookups)) for i, r in enumerate(ratios)]


def test_change_point_at_the_known_window_with_levels():
    rng = np.random.default_rng(0)
    ratios = list(0.6 + rng.normal(scale=0.01, size=10)) + list(0.3 + rng.normal(scale=0.01, size=2))
    (f,) = changepoint_findings(_hit_windows(ratios))
    assert f.kind == "change-point" and f.window == 10 and f.windows == (0, 11)
    assert f.detail["before"] == pytest.approx(0.6, abs=0.01) and f.detail["after"] == pytest.approx(
        0.3, abs=0.01
    )
    assert f.statistic == pytest.approx(-0.3, abs=0.02) and f.detail["breakpoints"][-1] == 12
    assert changepoint_findings(_hit_windows(ratios[:11])) != []  # the newest window alone is enough


def test_change_point_none_on_noise_or_an_old_break():
    rng = np.random.default_rng(1)
    assert changepoint_findings(_hit_windows(0.5 + rng.normal(scale=0.02, size=15))) == []
    old = [0.6] * 5 + [0.3] * 10
    assert breakpoints(old) == [5, 15]
    assert changepoint_findings(_hit_windows(old)) == []
    assert changepoint_findings(_hit_windows([0.6, 0.6, 0.2])) == []  # too few windows
    # the rolling window: only the last `last` windows are re-read
    assert changepoint_findings(_hit_windows([0.9] * 30 + [0.5] * 6 + [0.2] * 2), last=8)[0].window == 36


# ---------------------------------------------------------------- knee


def test_knee_at_the_known_x():
    f = knee([(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.42), (6, 0.44), (7, 0.45)])
    assert f is not None and f.kind == "knee" and f.detail["x"] == 4 and f.detail["y"] == 0.4
    assert f.detail["slope_before"] == pytest.approx(0.1) and f.detail["slope_after"] == pytest.approx(0.02)
    uneven = knee([(0.01, 0.03), (0.05, 0.15), (0.1, 0.26), (0.3, 0.49), (0.6, 0.55), (1.0, 0.58)])
    assert uneven is not None and uneven.detail["x"] == 0.3


def test_knee_none_without_a_bend_and_bad_input():
    assert knee([(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]) is None
    assert knee([(1, 0.1), (2, 0.12), (3, 0.2), (4, 0.5)]) is None  # convex: it keeps paying more
    assert knee([(1, 0.5), (2, 0.5), (3, 0.5)]) is None
    assert knee([(1, 0.1), (2, 0.2)]) is None
    with pytest.raises(ValueError, match="ascending"):
        knee([(2, 0.1), (1, 0.2), (3, 0.3)])
    with pytest.raises(ValueError, match="finite"):
        knee([(1, 0.1), (2, float("nan")), (3, 0.3)])


# ---------------------------------------------------------------- output shift, bimodal latency


def _outputs(index, values):
    return _window(index, 100, 10, output_tokens=tuple(int(v) for v in values))


def test_output_shift_beyond_the_band_of_past_p95s():
    rng = np.random.default_rng(0)
    past = [_outputs(i, rng.normal(100, 10, size=200)) for i in range(4)]
    f = output_shift([*past, _outputs(4, rng.normal(300, 10, size=200))])
    assert f is not None and f.kind == "output-shift" and f.window == 4 and f.windows == (0, 4)
    assert f.detail["direction"] == "up" and f.statistic > f.detail["band"][1]
    assert output_shift([*past, _outputs(4, rng.normal(100, 10, size=200))]) is None
    assert (
        output_shift([*past[:2], _outputs(2, rng.normal(300, 10, size=200))]) is None
    )  # 2 past windows only


def test_bimodal_latency_from_cold_starts_and_unimodal_none():
    rng = np.random.default_rng(0)
    mixed = np.concatenate(
        [rng.lognormal(np.log(10), 0.2, size=700), rng.lognormal(np.log(1000), 0.2, size=300)]
    )
    f = bimodal_latency(_window(3, 1000, 0, latency_ms=tuple(mixed)))
    assert f is not None and f.kind == "bimodal-latency" and f.window == 3
    fast, slow = f.detail["modes_ms"]
    assert fast == pytest.approx(10, rel=0.15) and slow == pytest.approx(1000, rel=0.15)
    assert fast < f.detail["valley_ms"] < slow and f.detail["slow_share"] == pytest.approx(0.3, abs=0.01)
    one = rng.lognormal(np.log(50), 0.5, size=1000)
    assert bimodal_latency(_window(3, 1000, 0, latency_ms=tuple(one))) is None
    assert bimodal_latency(_window(3, 1000, 0, latency_ms=(5.0,) * 100)) is None
    assert bimodal_latency(_window(3, 1000, 0, latency_ms=tuple(mixed[:20]))) is None


# ---------------------------------------------------------------- traffic


def test_never_hits_rules_and_tenants():
    history = [
        _window(
            i,
            400,
            50,
            by_rule={
                "faq": Counts(20, 200, 50),
                "sampled": Counts(30, 150, 0),
                "rare": Counts(1, 10, 0),
                "": Counts(5, 40, 0),
            },
            by_tenant={"acme": Counts(40, 300, 50), "cold": Counts(11, 100, 0)},
        )
        for i in range(4)
    ]
    found = never_hits(history)
    assert [(dict(f.subject), f.detail["lookups"], f.windows) for f in found] == [
        ({"rule": "sampled"}, 450, (1, 3)),
        ({"tenant": "cold"}, 300, (1, 3)),
    ]
    assert found[0].score == pytest.approx(450 / 1200)
    assert never_hits(history, min_lookups=1000) == []


def test_push_out_of_a_tenant_by_another():
    def w(i, victim_hits, evictions):
        return _window(
            i,
            2000,
            100 + victim_hits,
            by_tenant={"bulk": Counts(100, 1000, 20), "chat": Counts(100, 1000, victim_hits)},
            pushed_out={("bulk", "chat"): evictions, ("chat", "bulk"): 2},
        )

    history = [w(0, 600, 5), w(1, 500, 40), w(2, 350, 60)]
    (f,) = push_out(history)
    assert f.kind == "push-out" and dict(f.subject) == {"tenant": "bulk", "victim": "chat"}
    assert f.statistic == 105 and f.detail["victim_hit_ratio"] == [0.6, 0.35]
    assert push_out([w(0, 500, 5), w(1, 500, 40), w(2, 500, 60)]) == []  # the victim does not suffer


# ---------------------------------------------------------------- plots and the whole diagnosis


def _loop_history(n=10, per=5000, seed=0):
    """``n`` windows of ``per`` lookups: the hit ratio drops in the last two, the "sampled" rule never
    hits."""
    rng = np.random.default_rng(seed)
    history, series = [], []
    for i in range(n):
        requests, outcomes = [], []
        for j in range(per // 5):
            rule = "sampled" if j % 4 == 0 else "faq"
            ns = f"t{j % 3}"
            keys = tuple(f"w{i}-r{j}-b{b}" for b in range(5))
            p = (0.6 if i < n - 2 else 0.25) if rule == "faq" else 0.0
            hits = int(rng.binomial(5, p))
            requests.append(
                Request(
                    t=i * 100 + j * 100 / (per // 5),
                    kind="kv",
                    keys=keys,
                    rule=rule,
                    ns=ns,
                    prompt_tokens=int(rng.integers(100, 4000)),
                    output_tokens=int(rng.integers(10, 200)),
                    latency_ms=float(rng.lognormal(np.log(80), 0.3)),
                )
            )
            outcomes.append(Outcome(5, hits))
        history.append(window_stats(i, "p@1", requests, outcomes))
        series_i = step_series(requests, outcomes, start=i * 100.0, end=i * 100.0 + 100, step_s=10.0)
        series.append(series_i)
    merged = {}
    for part in series:
        for s in part:
            old = merged.get((s.name, s.labels))
            merged[(s.name, s.labels)] = (
                s if old is None else Series(s.name, s.labels, old.t + s.t, old.v + s.v, s.unit)
            )
    return history, list(merged.values())


def test_diagnose_runs_every_test_and_sorts_by_score(tmp_path):
    history, series = _loop_history()
    assert len(series) == 24 and sum(w.lookups for w in history) == 50_000
    curve = [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.42), (6, 0.44)]
    found = diagnose(history, series, curve=curve, plots_dir=tmp_path / "plots")
    kinds = [f.kind for f in found]
    assert {"change-point", "never-hits", "knee"} <= set(kinds)
    assert [f.score for f in found] == sorted((f.score for f in found), reverse=True)
    assert {tuple(f.subject.items()) for f in found if f.kind == "never-hits"} == {(("rule", "sampled"),)}
    (cp,) = [f for f in found if f.kind == "change-point"]
    assert cp.window == 8
    for f in found:  # a not-testable note is text alone
        if f.kind == "not-testable":
            assert f.plot is None
        else:
            assert f.plot is not None and Path(f.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert diagnose(history, series) == [replace(f, plot=None) for f in found if f.kind != "knee"]
    restored = [Finding.from_dict(json.loads(json.dumps(f.to_dict()))) for f in found]
    assert restored == found  # plain JSON values all through: the loop's state and store hold them


def test_plot_every_kind(tmp_path):
    x, y, _ = _lagged()
    series = [_series("qps", x), _series("miss_ratio", y)]
    history = _hit_windows([0.6] * 6 + [0.3] * 2)
    mixed = np.concatenate(
        [np.full(70, 10.0) * np.linspace(0.9, 1.1, 70), np.full(30, 900.0) * np.linspace(0.9, 1.1, 30)]
    )
    history[-1] = replace(
        history[-1],
        latency_ms=tuple(mixed),
        by_rule={"sampled": Counts(10, 500, 0)},
        by_tenant={"a": Counts(1, 1, 0), "b": Counts(1, 1, 1)},
        pushed_out={("a", "b"): 4},
    )
    findings = [
        *granger_findings(series, window=7, windows=(0, 7)),
        *changepoint_findings(history),
        knee([(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.31)]),
        bimodal_latency(history[-1]),
        Finding(
            kind="key-drift",
            summary="s",
            window=7,
            windows=(0, 7),
            detail={"test": "jsd", "band": [0.1, 0.2], "values": [None, 0.1, 0.15, 0.9]},
        ),
        Finding(
            kind="output-shift",
            summary="s",
            window=7,
            windows=(0, 7),
            detail={"p95": 300.0, "band": [80.0, 120.0], "past": [[0, 100.0], [1, 101.0]]},
        ),
        Finding(kind="never-hits", summary="s", window=7, windows=(5, 7), subject={"rule": "sampled"}),
        Finding(
            kind="push-out", summary="s", window=7, windows=(5, 7), subject={"tenant": "a", "victim": "b"}
        ),
        Finding(kind="not-testable", summary="s", window=7, windows=(0, 7), detail={"reason": "constant"}),
    ]
    assert sorted({f.kind for f in findings}) == sorted(
        [
            "granger",
            "change-point",
            "knee",
            "bimodal-latency",
            "key-drift",
            "output-shift",
            "never-hits",
            "push-out",
            "not-testable",
        ]
    )
    paths = {plot_finding(f, history, series, tmp_path) for f in findings}
    assert len(paths) == len(findings)
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert plot_finding(findings[0], history, series, tmp_path) in paths  # same finding, same file
    with pytest.raises(ValueError, match="known: "):
        plot_finding(replace(findings[0], kind="bogus"), history, series, tmp_path)  # type: ignore[arg-type]


def test_public_names_and_a_light_import():
    import evocache.agents.diagnosis as diagnosis

    public = {n for n in dir(diagnosis) if not n.startswith("_")}
    assert public == set(diagnosis.__all__)
    code = (
        "import sys, evocache.agents.diagnosis; "
        "print(sorted(m for m in ('statsmodels', 'ruptures', 'matplotlib', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_is_validated_and_empty_history_refused():
    assert DiagnosisConfig().max_lag == 4
    with pytest.raises(ValueError, match="alpha"):
        DiagnosisConfig(alpha=1.5)
    with pytest.raises(ValueError, match="max_lag"):
        DiagnosisConfig(max_lag=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one window"):
        diagnose([], [])
