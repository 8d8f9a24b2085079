"""`evocache agent watch`: the loop over a deployment's access events, here a real `@cache_if` function
writing its events to a JSONL sink, and the policy store it follows."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

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


def test_watch_runs_a_pass_per_window_of_events_and_keeps_its_report(tmp_path: Path) -> None:
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

    out = tmp_path / "report.json"
    done = subprocess.run(
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
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
