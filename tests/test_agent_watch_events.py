"""`evocache agent watch` over an events file that is rewritten while it is watched: every event of the new
file is read once, from its start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import eventually
from evocache.controller import AccessEvent, FilePolicyStore
from evocache.dsl import parse_policy

pytestmark = pytest.mark.slow  # the evocache command in a subprocess

POLICY = """\
policy: watched
version: 1
defaults: {ttl: 1h, tiers: [l1]}
rules:
  - {name: chat, when: 'true'}
"""
T0 = 1_700_000_000.0
T1 = T0 + 10_000.0  # the rewritten file's events: later, and longer, so an old offset falls inside a line
WINDOW = 120


def events(start: float, n: int, tag: str) -> bytes:
    """``n`` version 2 calls one second apart: each key asked for twice, a miss stored in L1 then a hit."""
    out = []
    for i in range(n):
        key, first = f"{tag}-{i // 2:04d}", i % 2 == 0
        out.append(AccessEvent(t=start + i, key=key, ns="acme", rule="chat", policy="watched@1",
                               outcome="miss" if first else "hit", tier=None if first else "l1", size=64,
                               latency_ms=0.2, saved_ms=30.0, fn="app.answer",
                               call=f"c-{tag}-{i}", stored="l1" if first else "").to_json())
    return "".join(line + "\n" for line in out).encode()


def windows(report: Path) -> list[dict]:
    return json.loads(report.read_text())["windows"] if report.exists() else []


def test_a_file_rewritten_longer_while_watched_is_read_from_its_start(tmp_path: Path) -> None:
    path, report = tmp_path / "events.jsonl", tmp_path / "watch.json"
    FilePolicyStore(tmp_path / "policies").apply(parse_policy(POLICY, "policy.yaml"))
    path.write_bytes(events(T0, WINDOW, "old"))
    watch = subprocess.Popen(
        [sys.executable, "-m", "evocache.cli", "agent", "watch", "--events", str(path),
         "--store", str(tmp_path / "policies"), "--window", str(WINDOW), "--max-windows", "3",
         "--interval", "0.05", "--capacity", str(64 * 1024), "--workdir", str(tmp_path / "agent"),
         "--json", str(report)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        eventually(lambda: windows(report), timeout=300, message="the first window's report")
        with path.open("r+b") as fh:  # truncated and written longer, in the same file
            fh.truncate(0)
            fh.write(events(T1, 4 * WINDOW, "rewritten"))
        out, err = watch.communicate(timeout=300)
    finally:
        watch.kill()
        watch.wait()
    assert watch.returncode == 0, err
    spans = [(w["start"], w["end"], w["requests"]) for w in windows(report)]
    assert spans == [(T0, T0 + WINDOW - 1, WINDOW), (T1, T1 + WINDOW - 1, WINDOW),
                     (T1 + WINDOW, T1 + 2 * WINDOW - 1, WINDOW)]
