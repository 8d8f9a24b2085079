"""The loop over a drifting trace, end to end: `evocache agent run`, its report, the rollback of a harmful
proposal, and a review left waiting in one process approved from another."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from evocache.agents._proposals import ProposalStore
from evocache.agents._scenarios import kv_drift
from evocache.controller import FilePolicyStore

pytestmark = pytest.mark.slow  # each test runs the evocache command in a subprocess

DATA = Path(__file__).parent / "data" / "agents_diag"
POLICY = """\
policy: kv-chat
version: 1
defaults: {ttl: 1d}
rules:
  - {name: chat, when: 'true', kv: {reuse: prefix}}
  - {name: batch, when: 'false', kv: {reuse: prefix}}
slo: {max_error_rate: 0.01}
guardrails:
  auto_approve: {ttl_change: 0.2, bypass: true, eviction: true, tenant_share_change: 0.9}
  canary: {fraction: 0.3, windows: 1, max_windows: 2, min_requests: 20}
"""


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loop")
    mooncake = root / "mooncake.jsonl"
    with gzip.open(next(DATA.glob("mooncake*")), "rt") as src:
        mooncake.write_text(src.read())
    return kv_drift(mooncake, root / "drift.jsonl", requests=1600)


def evocache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evocache.cli", *args], capture_output=True, text=True, timeout=600)


def test_agent_run_writes_its_report_and_rolls_back_the_harmful_proposal(trace: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "report.json"
    done = evocache("agent", "run", "--trace", str(trace), "--policy", str(policy), "--window", "200",
                    "--json", str(out), "--workdir", str(tmp_path / "work"), "--inject-harmful", "6")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"windows", "drift_detected_at", "proposals"}
    assert [w["index"] for w in report["windows"]] == list(range(len(report["windows"])))
    for w in report["windows"]:
        assert set(w) >= {"index", "start", "end", "requests", "policy", "hit_ratio", "findings"}
        assert all(set(f) >= {"kind", "score", "p_value"} for f in w["findings"])
    store = ProposalStore(tmp_path / "work" / "proposals.db")
    injected = {p.id for p in store.list() if any(e["why"].startswith("injected") for e in p.edits)}
    harmful = [p for p in report["proposals"] if p["id"] in injected]
    # injected once, from window 6 on, judged a loss by its replay; rolled back on a shown loss: never promoted
    assert len(harmful) == 1 and harmful[0]["window"] >= 6 and harmful[0]["predicted_gain"] < 0
    assert harmful[0]["status"] == "rolled_back"
    assert report["breaches"] and report["breaches"][0]["proposal"] == harmful[0]["id"]
    for p in store.list():
        if p.status in ("canary", "promoted", "rolled_back"):
            assert p.evidence is not None and store.reviews(p.id), p.id  # replayed and reviewed, always
    assert "canary" in [r.kind for r in store.policy_history()]
    active = FilePolicyStore(tmp_path / "work" / "policies").state()
    assert active.canary is None and active.active != store.get(harmful[0]["id"]).new_ref


def test_a_review_waiting_in_one_process_is_approved_from_another(trace: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    work = tmp_path / "work"
    done = evocache("agent", "run", "--trace", str(trace), "--policy", str(policy), "--window", "200",
                    "--workdir", str(work), "--interactive")
    assert done.returncode == 0, done.stderr
    store = ProposalStore(work / "proposals.db")
    waiting = store.list(status="proposed")
    assert len(waiting) == 1 and waiting[0].thread_id  # one at a time: it waits in its pass's review
    assert FilePolicyStore(work / "policies").state().canary is None
    approved = evocache("proposals", "approve", waiting[0].id, "--store", str(work / "proposals.db"),
                        "--reviewer", "alice")
    assert approved.returncode == 0, approved.stderr
    assert store.get(waiting[0].id).status == "canary"
    assert FilePolicyStore(work / "policies").state().canary == waiting[0].new_ref
    assert [r.reviewer for r in store.reviews(waiting[0].id)] == ["alice"]


def test_agent_scenario_writes_a_drifting_stream_from_the_shipped_data(tmp_path: Path) -> None:
    out = tmp_path / "semantic.jsonl"
    done = evocache("agent", "scenario", "semantic", "--out", str(out), "--root", str(Path(__file__).parents[1]))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3000 and [r["phase"] for r in rows] == ["A"] * 1500 + ["B"] * 1500
    assert all(r["rule"] == "faq" and r["prompt"] and r["group"] for r in rows)
    bad = evocache("agent", "scenario", "other", "--out", str(out))
    assert bad.returncode == 2 and "unknown scenario 'other'" in bad.stderr
