"""`evocache demo` end to end: a local Ray Serve deployment of the example model, a drifting workload sent
through the openai client, and the loop over the replica's access events, to its report."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evocache.agents._proposals import ProposalStore
from evocache.controller import FilePolicyStore

pytestmark = pytest.mark.slow  # the demo, run by the evocache command in a subprocess

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("demo") / "work"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("EVOCACHE_PLANNER", None)
    done = subprocess.run([sys.executable, "-m", "evocache.cli", "demo", "--workdir", str(work), "--windows", "12"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, json.loads((work / "report.json").read_text())


def test_demo_detects_the_drift_and_promotes_a_change_the_replica_then_serves(demo) -> None:
    work, report = demo
    assert [w["index"] for w in report["windows"]] == list(range(12))
    assert all(w["requests"] == 200 for w in report["windows"]) and report["requests_failed"] == 0
    first_b = 5  # the demo's drift: after the fifth window
    assert report["drift_detected_at"] is not None and first_b <= report["drift_detected_at"] <= first_b + 2
    store = ProposalStore(work / "proposals.db")
    promoted = [p for p in store.list() if p.status == "promoted"]
    assert promoted, [(p.id, p.status, p.predicted_gain) for p in store.list()]
    for p in promoted:  # never without replayed evidence and a review
        assert p.evidence is not None and p.predicted_gain > 0 and store.reviews(p.id)
    # the replica served the promoted version: its decisions in the access events carry its ref
    refs = {json.loads(line)["policy"] for line in (work / "events.jsonl").read_text().splitlines() if line}
    assert {p.new_ref for p in promoted} <= refs
    assert FilePolicyStore(work / "policies").state().active == promoted[0].new_ref  # the newest (list(): first)


def test_demo_rolls_back_the_harmful_proposal(demo) -> None:
    work, report = demo
    store = ProposalStore(work / "proposals.db")
    harmful = [p for p in store.list() if any(e["why"].startswith("injected") for e in p.edits)]
    assert len(harmful) == 1 and harmful[0].status == "rolled_back"
    assert [b["proposal"] for b in report["breaches"]] == [harmful[0].id]
    kinds = [r.kind for r in store.policy_history() if r.ref == harmful[0].new_ref]
    assert kinds == ["canary", "rolled_back"]


def test_demo_writes_its_report_page_with_the_plots(demo) -> None:
    work, report = demo
    page = Path(report["report_html"])
    assert page == work / "report" / "report.html"
    text = page.read_text()
    for name in ("hit-ratio.png", "latency.png", "kv-heatmap.png"):
        assert f'src="{name}"' in text and (page.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    promoted = [p for p in ProposalStore(work / "proposals.db").list() if p.status == "promoted"]
    assert html.escape(promoted[0].diff.splitlines()[0]) in text
