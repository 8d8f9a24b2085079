"""Traffic-mix drift: the share per (rule, tenant) and per prompt-length octave, against its own history."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from evocache.agents._scenarios import kv_drift
from evocache.agents._types import Outcome, Request, window_stats
from evocache.agents._workload import read_requests, windows
from evocache.agents.diagnosis import diagnose, mix_drift_findings
from evocache.agents.diagnosis._drift import mix_divergence, window_mix

DATA = Path(__file__).parent / "data" / "agents_diag"
WINDOW = 200


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mix") / "mooncake.jsonl"
    with gzip.open(DATA / "mooncake_head2400.jsonl.gz", "rt") as src:
        path.write_text(src.read())
    return path


def _history(requests: list[Request]):
    return [window_stats(i, "p@1", span, [Outcome(len(r.keys), 0) for r in span])
            for i, span in enumerate(windows(requests, WINDOW))]


def _flagged(history) -> dict[int, float]:
    """The windows a mix drift is reported at, each judged when it arrives, and its statistic."""
    return {f.window: f.statistic for t in range(2, len(history) + 1) for f in mix_drift_findings(history[:t])}


def test_no_mix_drift_on_stationary_real_traffic(mooncake: Path, tmp_path: Path) -> None:
    trace = kv_drift(mooncake, tmp_path / "a.jsonl", split=1.0)
    history = _history(read_requests(trace))
    assert len(history) == 12
    assert _flagged(history) == {}


def test_mix_drift_at_the_first_window_of_the_new_phase(mooncake: Path, tmp_path: Path) -> None:
    trace = kv_drift(mooncake, tmp_path / "ab.jsonl", requests=1600)
    requests = read_requests(trace)
    first_b = next(i for i, span in enumerate(windows(requests, WINDOW)) if any(r.phase == "B" for r in span))
    history = _history(requests)
    flagged = _flagged(history)
    assert min(flagged) == first_b
    (f,) = mix_drift_findings(history[: first_b + 1])
    assert f.kind == "mix-drift" and f.window == first_b and f.statistic > f.detail["band"][1]
    assert {"chat/globex", "batch/batchco"} & set(f.detail["moved"])
    assert "mix-drift" in {x.kind for x in diagnose(history[: first_b + 1], [])}


def test_mix_divergence_counts_slices_and_lengths_apart() -> None:
    def stats(tenant: str, tokens: int, n: int = 10):
        reqs = [Request(t=float(i), kind="kv", keys=(f"k{i}",), ns=tenant, rule="chat", prompt_tokens=tokens)
                for i in range(n)]
        return window_stats(0, "p@1", reqs, [Outcome(1, 0)] * n)

    same = window_mix(stats("acme", 600))
    assert same == {"slice:chat/acme": 10, "tokens:2^10": 10}
    assert mix_divergence(same, same) == 0.0
    assert mix_divergence(window_mix(stats("globex", 600)), same) == pytest.approx(0.5)  # slices apart, lengths alike
    assert mix_divergence(window_mix(stats("globex", 6000)), same) == pytest.approx(1.0)
    steady = [stats("acme", 600)] * 5
    assert mix_drift_findings(steady) == []
