"""`evocache agent watch`: the loop over a deployment's access events, here a real `@cache_if` function
writing its events to a JSONL sink, and the policy store it follows."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from evocache.controller import (
    EventsConfig,
    FilePolicyStore,
    L1Config,
    StoreConfig,
    build_runtime,
    cache_if,
    configure,
    tenant_scope,
)
from evocache.dsl import parse_policy

POLICY = """\
policy: watched
version: 1
defaults: {ttl: 1h, tiers: [l1]}
rules:
  - {name: batch, when: 'tenant.tier == "batch"'}
  - {name: chat, when: 'true'}
guardrails:
  auto_approve: {bypass: true}
"""


def serve_traffic(tmp_path: Path) -> Path:
    """A real ``@cache_if`` function under POLICY answering 480 requests, its events in a JSONL file; the
    policy in force in a file policy store at ``tmp_path/policies``."""
    events = tmp_path / "events.jsonl"
    policy = parse_policy(POLICY, "policy.yaml")
    store = FilePolicyStore(tmp_path / "policies")
    store.apply(policy)
    runtime = configure(
        build_runtime(
            StoreConfig(
                l1=L1Config(bytes=8 * 1024), redis=None, events=EventsConfig(sink="jsonl", path=str(events))
            ),
            policy=policy,
        )
    )

    @cache_if("true", model="m")
    def answer(prompt: str) -> str:
        return f"answer to {prompt}"

    rng = random.Random(0)
    for i in range(480):
        if i % 3 == 2:  # a batch tenant's one-off documents, never asked again
            with tenant_scope("batchco", tier="batch"):
                answer(f"document {i} " + "x" * 40)
        else:
            with tenant_scope("acme", tier="pro"):
                answer(f"question {rng.randrange(30)}")
    runtime.events.flush()
    return events


def watch(tmp_path: Path, events: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "evocache.cli",
            "agent",
            "watch",
            "--events",
            str(events),
            "--store",
            str(tmp_path / "policies"),
            "--window",
            "120",
            "--max-windows",
            "4",
            "--interval",
            "0.1",
            "--capacity",
            str(8 * 1024),
            "--workdir",
            str(tmp_path / "agent"),
            *more,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_watch_runs_a_pass_per_window_of_events_and_keeps_its_report(tmp_path: Path) -> None:
    events = serve_traffic(tmp_path)
    out = tmp_path / "report.json"
    done = watch(tmp_path, events, "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [w["index"] for w in report["windows"]] == [0, 1, 2, 3]
    assert all(w["requests"] == 120 and w["policy"] == "watched@1" for w in report["windows"])
    # the batch rule's documents never hit: the loop says so
    kinds = {f["kind"] for w in report["windows"] for f in w["findings"]}
    assert "never-hits" in kinds
    assert "window 3: 120 requests, watched@1" in done.stdout


def test_the_live_loop_reads_the_other_signals_over_each_window(tmp_path: Path) -> None:
    from evocache.agents._live import LiveLoop
    from evocache.agents.errors import SignalUnavailable
    from evocache.agents.signals import EventsCollector, HostCollector, NvmlCollector, SignalHub

    events = tmp_path / "events.jsonl"
    policy = parse_policy(POLICY, "policy.yaml")
    runtime = configure(
        build_runtime(
            StoreConfig(redis=None, events=EventsConfig(sink="jsonl", path=str(events))), policy=policy
        )
    )

    @cache_if("true", model="m")
    def answer(prompt: str) -> str:
        return prompt.upper()

    with tenant_scope("acme", tier="pro"):
        for i in range(40):
            answer(f"q{i % 7}")
    runtime.events.flush()
    stamps = [json.loads(line)["t"] for line in events.read_text().splitlines()]
    inside = (stamps[0] + stamps[-1]) / 2  # a reading inside the window's span
    host, gpu = HostCollector(clock=lambda: inside), NvmlCollector(clock=lambda: inside)
    host.sample()
    try:
        gpu.sample()
    except SignalUnavailable:  # no GPU or driver here
        pass
    hub = SignalHub([host, gpu])
    loop = LiveLoop(
        EventsCollector.from_files([events]),
        FilePolicyStore(tmp_path / "policies"),
        tmp_path,
        window=40,
        capacity=1 << 20,
        policy=policy,
        signals=hub,
    )
    try:
        (row,) = loop.pump()
    finally:
        loop.close()
    assert 0.0 <= row["signals"]["host_cpu_percent"] <= 100.0 * os.cpu_count()
    assert row["signals"]["host_mem_used"] > 0
    report = loop.report()
    if "nvml" in report["signals_unavailable"]:  # a machine without a GPU or driver: said, not fatal
        assert report["signals_unavailable"]["nvml"]
    else:
        assert any(name.startswith("gpu_") for name in row["signals"])


@pytest.mark.slow
def test_a_review_left_waiting_by_watch_is_approved_from_another_process_on_the_store_it_follows(
    tmp_path: Path,
) -> None:
    # the policy store is the deployment's, outside the loop's workdir: the approving process finds it from
    # the loop's record
    events = serve_traffic(tmp_path)
    done = watch(tmp_path, events, "--interactive")
    assert done.returncode == 0, done.stderr
    work = tmp_path / "agent"
    record = json.loads((work / "loop.json").read_text())
    assert record["policy_store"] == {"directory": str((tmp_path / "policies").resolve())}
    assert record["capacity"] == 8 * 1024 and record["config"]["interactive"] is True
    listed = subprocess.run(
        [sys.executable, "-m", "evocache.cli", "proposals", "list", "--store", str(work / "proposals.db"),
         "--status", "proposed", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    waiting = json.loads(listed.stdout)
    assert len(waiting) == 1 and any(e["path"] == "rules.batch.cache" for e in waiting[0]["edits"])
    assert FilePolicyStore(tmp_path / "policies").state().canary is None

    approved = subprocess.run(
        [sys.executable, "-m", "evocache.cli", "proposals", "approve", waiting[0]["id"], "--store",
         str(work / "proposals.db")],
        capture_output=True, text=True, timeout=120,
    )
    assert approved.returncode == 0, approved.stderr
    state = FilePolicyStore(tmp_path / "policies").state()
    assert state.canary == waiting[0]["new_ref"] and state.fraction > 0, approved.stdout
    assert "canary" in approved.stdout


def test_a_redis_store_is_recorded_without_its_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evocache.agents._loop import record_policy_store, recorded_policy_store
    from evocache.agents.errors import AgentError
    from evocache.controller import PolicyStoreConfig, open_policy_store

    store = open_policy_store(PolicyStoreConfig(redis_url="redis://ops:s3cret@127.0.0.1:1/0", prefix="evc:p"))
    record_policy_store(tmp_path, store)
    text = (tmp_path / "loop.json").read_text()
    assert "s3cret" not in text and "ops" not in text
    assert json.loads(text)["policy_store"] == {
        "redis_url": "redis://127.0.0.1:1/0", "prefix": "evc:p", "credentials": True
    }
    monkeypatch.delenv("EVOCACHE_POLICY_STORE", raising=False)
    with pytest.raises(AgentError, match=r"redis://127\.0\.0\.1:1/0 with a password: set \$EVOCACHE_POLICY_STORE"):
        recorded_policy_store(tmp_path)
    monkeypatch.setenv("EVOCACHE_POLICY_STORE", "redis://ops:s3cret@127.0.0.1:1/0")
    reopened = recorded_policy_store(tmp_path)
    assert (reopened.url, reopened.prefix) == ("redis://ops:s3cret@127.0.0.1:1/0", "evc:p")
