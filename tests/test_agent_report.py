"""The HTML report of a loop run: the KV heat map's binning exactly, and the page drawn from a report, real
proposals in a real store and real finding plots."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from _helpers import SteppingClock
from evocache.agents._candidates import Edit, apply_edits
from evocache.agents._proposals import Proposal, ProposalStore
from evocache.agents._report import PNG_MAGIC, REPORT_NAME, kv_heatmap, render_report
from evocache.agents._types import Finding, WindowStats
from evocache.agents.diagnosis import plot_finding
from evocache.dsl import load_policy

SERVE = load_policy(Path(__file__).resolve().parent.parent / "examples" / "policies" / "serve.yaml")
LONGER = apply_edits(SERVE, [Edit("ttl", "rules.chat.ttl", 3600.0, 7200.0, "chat answers hit for hours")])
HARMFUL = apply_edits(LONGER, [Edit("ttl", "defaults.ttl", 1800.0, 1.0, "injected")])
T0 = 1_800_000_000.0
EVIDENCE = {"metrics": {"hit_ratio": {"base": 0.40, "new": 0.46, "ci": [0.02, 0.09]}}, "evaluated_at": T0 + 5}
SCRIPT = "keys moved <script>alert(1)</script> & more"
BREACH = "canary hit ratio 0.120 is below the base's 0.410 by more than 0.0205 (<- interval ends at -0.2)"


# --- the heat map's binning ---------------------------------------------------------------------------------

def test_kv_heatmap_counts_asked_and_cached_positions_per_bin() -> None:
    heat = kv_heatmap([(0, 32, 16), (0, 16, 0), (1, 32, 32), (4, 20, 10)], bins=4)
    assert heat.windows == (0, 1, 4)
    assert heat.edges == (0, 8, 16, 24, 32)
    assert heat.asked.tolist() == [[16, 16, 8, 8], [8, 8, 8, 8], [8, 8, 4, 0]]
    assert heat.hits.tolist() == [[8, 8, 0, 0], [8, 8, 8, 8], [8, 2, 0, 0]]
    np.testing.assert_array_equal(heat.share, [[0.5, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0],
                                               [1.0, 0.25, 0.0, np.nan]])
    assert not heat.empty


def test_kv_heatmap_edges_are_integer_and_never_more_bins_than_positions() -> None:
    assert kv_heatmap([(0, 10, 3)], bins=4).edges == (0, 2, 5, 7, 10)
    assert kv_heatmap([(0, 10, 3)], bins=4).hits.tolist() == [[2, 1, 0, 0]]
    short = kv_heatmap([(2, 5, 2), (2, 3, 3)], bins=16)
    assert short.edges == (0, 1, 2, 3, 4, 5)
    assert short.asked.tolist() == [[2, 2, 2, 1, 1]]
    assert short.hits.tolist() == [[2, 2, 1, 0, 0]]


def test_kv_heatmap_of_nothing_is_empty() -> None:
    assert kv_heatmap([]).empty
    assert kv_heatmap([(0, 0, 0)]).empty
    assert kv_heatmap([(0, 0, 0)]).windows == (0,)


@pytest.mark.parametrize(("entries", "message"), [
    ([(0, 8, 4), (1, 8, 9)], r"kv_positions\[1\]: 9 cached tokens of a 8-token prompt"),
    ([(0, -1, 0)], r"kv_positions\[0\]: \(0, -1, 0\) has a negative count"),
    ([(0, 8)], r"kv_positions\[0\]: \(0, 8\) is not \(window, prompt_tokens, cached_tokens\)"),
])
def test_kv_heatmap_rejects_bad_entries_naming_them(entries: list[tuple[int, ...]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kv_heatmap(entries)  # type: ignore[arg-type]


# --- the page -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Proposal, Proposal]:
    """One proposal promoted (with its realised gain) and one rolled back, as the loop leaves them."""
    with ProposalStore(tmp_path_factory.mktemp("store") / "proposals.db", clock=SteppingClock(T0, step=10.0)) as store:
        good = store.add(Proposal.create(SERVE, LONGER, at=T0, id="p-00000001", evidence=EVIDENCE,
                                         predicted_gain=0.06, window=1))
        bad = store.add(Proposal.create(LONGER, HARMFUL, at=T0 + 1, id="p-00000002", evidence=EVIDENCE,
                                        predicted_gain=-0.2, window=4))
        for pid, end in ((good.id, "promoted"), (bad.id, "rolled_back")):
            store.review(pid, "approve", "tester")
            store.transition(pid, "canary", actor="agent")
            store.transition(pid, end, actor="agent", note=BREACH if end == "rolled_back" else "")
        store.set_realised_gain(good.id, 0.051)
        return store.get(good.id), store.get(bad.id)


@pytest.fixture(scope="module")
def plots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Real finding plots: a knee (drawn first), a change point and a key drift."""
    where = tmp_path_factory.mktemp("plots")
    history = [WindowStats(index=i, start=i * 60.0, end=i * 60.0 + 59, policy="serve-example@1", requests=100,
                           lookups=100, hits=h) for i, h in enumerate((60, 62, 30, 31, 33, 35))]
    findings = [
        Finding(kind="knee", summary="the hit ratio flattens above 2000 entries", window=5, windows=(0, 5),
                detail={"points": [[500, 0.2], [1000, 0.35], [2000, 0.45], [4000, 0.47]], "x": 2000,
                        "y": 0.45}),
        Finding(kind="change-point", summary="the hit ratio fell from 0.61 to 0.32", window=2, windows=(0, 5),
                detail={"before": 0.61, "after": 0.32}),
        Finding(kind="key-drift", summary="the key distribution moved", window=2, windows=(0, 2),
                detail={"values": [0.05, 0.06, 0.4], "band": [0.0, 0.1], "test": "js"}),
    ]
    return [Path(plot_finding(f, history, [], where)) for f in findings]


def report(promoted: Proposal, rolled_back: Proposal) -> dict[str, object]:
    policies = ["serve-example@1", "serve-example@1", "serve-example@1", "serve-example@2", "serve-example@2",
                "serve-example@2"]
    canary = [None, "serve-example@2", "serve-example@2", None, "serve-example@3", "serve-example@3"]
    hits = [0.61, 0.62, 0.31, 0.44, 0.45, 0.12]
    findings: list[list[dict[str, object]]] = [[] for _ in hits]
    findings[2] = [{"kind": "key-drift", "score": 0.8, "p_value": 0.0012, "summary": SCRIPT},
                   {"kind": "change-point", "score": 0.6, "p_value": None, "summary": "hit ratio fell"}]
    return {
        "windows": [{"index": i, "start": i * 60.0, "end": i * 60.0 + 59, "requests": 100,
                     "policy": policies[i], "canary": canary[i], "hit_ratio": hits[i], "wrong": 0,
                     "phases": ["steady"] if i < 2 else ["drift"], "findings": findings[i]}
                    for i in range(6)],
        "drift_detected_at": 2,
        "proposals": [{"id": p.id, "window": p.window, "status": p.status, "predicted_gain": p.predicted_gain,
                       "realised_gain": p.realised_gain} for p in (promoted, rolled_back)],
        "breaches": [{"proposal": rolled_back.id, "reason": BREACH, "windows": [4, 5],
                      "difference": [-0.29, -0.35, -0.2]}],
        "capacity": 4096,
    }


def images(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


def test_the_page_links_its_plots_as_png_files_beside_it(tmp_path: Path, stored: tuple[Proposal, Proposal],
                                                         plots: list[Path]) -> None:
    kv = [(w, 64, c) for w in range(6) for c in (0, 32, 64)]
    path = render_report(report(*stored), tmp_path / "out", proposals=stored,
                         latencies_ms=[1.0, 2.5, 40.0, 900.0], kv_positions=kv, finding_plots=plots,
                         title="trace <a>")
    assert path == tmp_path / "out" / REPORT_NAME
    moved = shutil.move(tmp_path / "out", tmp_path / "elsewhere")  # relative links: the folder moves whole
    page = (Path(moved) / REPORT_NAME).read_text(encoding="utf-8")
    names = images(page)
    assert names == ["hit-ratio.png", f"finding-00-{plots[1].name}", f"finding-01-{plots[2].name}",
                     f"finding-02-{plots[0].name}", "latency.png", "kv-heatmap.png"]
    for name in names:
        assert (Path(moved) / name).read_bytes().startswith(PNG_MAGIC)
    # nothing else is left there: no temporary files
    assert sorted(p.name for p in Path(moved).iterdir()) == sorted([*names, REPORT_NAME])
    assert "<script" not in page and "http" not in page
    assert "<h1>trace &lt;a&gt;</h1>" in page
    assert ("<dt>windows</dt><dd>6</dd><dt>requests</dt><dd>600</dd>"
            "<dt>drift detected at</dt><dd>window 2</dd><dt>proposals</dt><dd>2</dd>"
            "<dt>promoted</dt><dd>1</dd><dt>rolled back</dt><dd>1</dd>") in page
    assert ("Policies in force: serve-example@1 (windows 0\u20132), serve-example@2 (windows 3\u20135)."
            in page)
    assert "4 requests; p50 21.2 ms, p95 771.0 ms, p99 874.2 ms, max 900.0 ms (log scale)." in page
    assert "18 KV requests." in page


def test_the_page_escapes_what_comes_from_data(tmp_path: Path, stored: tuple[Proposal, Proposal]) -> None:
    promoted, rolled_back = stored
    page = render_report(report(*stored), tmp_path, proposals=stored).read_text(encoding="utf-8")
    assert ('<tr><td>2</td><td>key-drift</td><td>0.800</td><td>0.0012</td>'
            '<td>keys moved &lt;script&gt;alert(1)&lt;/script&gt; &amp; more</td></tr>') in page
    assert ("<tr><td>2</td><td>change-point</td><td>0.600</td><td>&ndash;</td><td>hit ratio fell</td></tr>"
            in page)
    assert "<script>" not in page
    assert f'<pre class="diff">{html.escape(promoted.diff)}</pre>' in page
    assert "+    ttl: 2h" in promoted.diff and 'endpoint == "chat"' in promoted.diff
    assert 'endpoint == "chat"' not in page and "endpoint == &quot;chat&quot;" in page
    assert "Predicted gain +0.0600, realised gain +0.0510." in page
    assert rolled_back.diff.splitlines()[0] not in page  # only promoted changes show their diff
    assert ('<tr><td>p-00000002</td><td>4</td><td class="status-rolled_back">rolled_back</td>'
            "<td>-0.2000</td><td>&ndash;</td></tr>") in page
    assert f"<td>4\u20135</td><td>-0.2900 [-0.3500, -0.2000]</td><td>{html.escape(BREACH)}</td>" in page


def test_empty_latencies_and_kv_requests_give_notes_not_plots(tmp_path: Path,
                                                              stored: tuple[Proposal, Proposal]) -> None:
    page = render_report(report(*stored), tmp_path).read_text(encoding="utf-8")
    assert images(page) == ["hit-ratio.png"]
    assert "No latencies given: no histogram." in page
    assert "No KV requests given: no heat map." in page
    assert "No finding plots given." in page
    assert "Promoted, diff not given: p-00000001." in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hit-ratio.png", REPORT_NAME]


def test_a_narrow_latency_range_stays_linear(tmp_path: Path) -> None:
    path = render_report({"windows": []}, tmp_path, latencies_ms=[10.0, 12.0, 14.0])
    page = path.read_text(encoding="utf-8")
    assert "3 requests; p50 12.0 ms, p95 13.8 ms, p99 14.0 ms, max 14.0 ms.</p>" in page
    assert "No windows in the report." in page and images(page) == ["latency.png"]


def test_bad_inputs_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="report: no 'windows'"):
        render_report({}, tmp_path)
    with pytest.raises(ValueError, match=r"report windows\[0\]: no 'hit_ratio'"):
        render_report({"windows": [{"index": 0, "policy": "p@1"}]}, tmp_path)
    with pytest.raises(ValueError, match=r"latencies_ms\[1\]: -3.0 is not a finite, non-negative latency"):
        render_report({"windows": []}, tmp_path, latencies_ms=[1.0, -3.0])
    text = tmp_path / "plot.png"
    text.write_text("not an image")
    with pytest.raises(ValueError, match=f"finding plot {re.escape(str(text))}: not a PNG"):
        render_report({"windows": []}, tmp_path, finding_plots=[text])
    with pytest.raises(ValueError, match="finding plot .*missing.png: cannot be read"):
        render_report({"windows": []}, tmp_path, finding_plots=[tmp_path / "missing.png"])
    assert not (tmp_path / REPORT_NAME).exists()
