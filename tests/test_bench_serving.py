"""bench/serving.py: evocache on a real local Ray Serve against bare Ray Serve, its result files, and their
rendering by bench/report.py. The end-to-end test runs every part with ``--quick`` (one Ray for all, ~2 min on
two cores); the measurement's bookkeeping is checked on hand-made sequences, without Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _bench_scripts import load_bench_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PARTS = ("serving-hit", "serving-miss", "serving-affinity", "serving-load")



@pytest.fixture
def serving(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("serving", monkeypatch)


def test_the_affinity_share_counts_each_reused_block_against_the_replica_that_last_answered_it(serving):
    run = serving.RouterRun("affinity", replicas=2)
    run.done((1, 2), False, 0.0, "r1", "miss", "")
    run.done((1, 2, 3), False, 0.0, "r1", "miss", "")  # blocks 1, 2 last on r1: 2 of 2 local
    run.done((1, 4), False, 0.0, "r2", "miss", "")  # block 1 last on r1: 0 of 1
    run.done((1, 2, 3), True, 0.0, "r1", "hit", "l1")  # 1 now last on r2; 2, 3 on r1: 2 of 3
    assert (run.prior_blocks, run.local_blocks) == (6, 4)
    assert (run.could_hit, run.hits, run.l1_hits) == (1, 1, 1)
    assert run.per_replica == {"r1": 3, "r2": 1}


def test_the_queue_spread_is_read_at_each_send_from_the_requests_then_in_flight(serving):
    run = serving.RouterRun("default", replicas=2)
    run.records = [(0.0, 5.0, "a"), (1.0, 2.0, "a"), (2.0, 3.0, "b"), (4.0, 6.0, "a")]
    run.per_replica = {"a": 3, "b": 1}
    # At 0: nothing in flight. At 1: a=1. At 2 the second has just been answered: a=1, b=0. At 4: a=1, b=0.
    assert run.spreads() == [0, 1, 1, 1]
    lonely = serving.RouterRun("default", replicas=2)  # one replica answered everything: the other counts as 0
    lonely.records = [(0.0, 3.0, "a"), (1.0, 3.0, "a"), (2.0, 3.0, "a")]
    lonely.per_replica = {"a": 3}
    assert lonely.spreads() == [0, 1, 2]


def test_a_trace_request_becomes_one_block_of_characters_per_hash_id(serving):
    assert serving.block_text(7) == "000000000000007 " and len(serving.block_text(123456789)) == serving.BLOCK_SIZE
    requests = serving.trace_requests(3)
    assert len(requests) == 3 and all(isinstance(h, int) for r in requests for h in r)
    prompt = "".join(serving.block_text(h) for h in requests[0])
    request = serving.generate_request(prompt)
    assert len(request.blocks) == len(requests[0])  # the ingress hashes exactly one block per hash id


def test_the_prepared_request_is_the_one_the_ingress_would_hand_the_replicas(serving):
    import json

    from evocache.serving import Api, ByteTokenizer, ModelConfig, ServerSpec, parse_request

    spec = ServerSpec(model=ModelConfig(kind="callable", id=serving.MODEL_ID, callable="m:f"),
                      block_size=serving.BLOCK_SIZE)
    api = Api(model_id=serving.MODEL_ID, model_revision="", tokenizer=ByteTokenizer(), backend=None, keys=None,
              block_size=serving.BLOCK_SIZE, block_extras=spec.block_extras())
    prompt = "".join(serving.block_text(h) for h in range(5)) + "tail"
    parsed = parse_request(json.dumps(serving.body(prompt)).encode(), "completion", api.limits)
    theirs = api.to_generate(parsed, serving.TENANT, serving.TIER, "completions")
    ours = serving.generate_request(prompt)
    fields = ("prompt", "input_ids", "blocks", "tenant", "tenant_tier", "max_tokens", "temperature", "top_p",
              "seed", "stop", "endpoint", "model")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert len(ours.blocks) == 5


def test_unknown_parts_and_a_bad_duration_are_refused(serving, capsys):
    assert serving.options(["--parts", "c,a"]).parts == ["a", "c"]
    for argv in (["--parts", "a,e"], ["--parts", ","], ["--duration", "0"]):
        with pytest.raises(SystemExit):
            serving.options(argv)
    assert "unknown part(s) e" in capsys.readouterr().err


@pytest.mark.slow
def test_the_quick_bench_writes_its_four_result_files_and_the_report_renders_them(tmp_path, monkeypatch):
    results = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(BENCH / "serving.py"), "--quick", "--results", str(results)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in results.iterdir()) == sorted(f"{part}.json" for part in PARTS)
    read = load_bench_script("_results", monkeypatch)
    loaded = {part: read.load(results / f"{part}.json") for part in PARTS}
    for result in loaded.values():
        assert result.command.endswith(f"bench/serving.py --quick --results {results}")

    hit = loaded["serving-hit"]
    calls = hit.context["rounds"] * hit.context["per_round"]
    assert [r["comparison"] for r in hit.rows] == ["hit_handle", "hit_http", "hit_http_two_hops"]
    assert hit.context["tier"] == "l1" and hit.context["body_bytes"] > hit.context["answer_chars"]
    for row in hit.rows:
        assert row["samples"] == calls
        for side in ("evocache", "baseline"):
            assert 0 < row[f"{side}_p50_ms"] <= row[f"{side}_p99_ms"]
        assert row["ratio_p50"] == pytest.approx(row["evocache_p50_ms"] / row["baseline_p50_ms"])

    (miss,) = loaded["serving-miss"].rows
    context = loaded["serving-miss"].context
    assert miss["samples"] == miss["misses"] == context["rounds"] * context["per_round"]
    assert miss["baseline_p50_ms"] >= context["model_ms"]  # the bare side really called the 50 ms model

    affinity = loaded["serving-affinity"]
    rows = {r["router"]: r for r in affinity.rows}
    assert set(rows) == {"affinity", "default"}
    for row in rows.values():
        assert row["requests"] == affinity.context["requests"] == 160 and row["errors"] == 0
        assert affinity.context["trace_requests"] > 160
        assert sum(row["per_replica"]) == row["requests"] and len(row["per_replica"]) <= 2
        assert 0 < row["local_blocks"] <= row["prior_blocks"]
        assert row["l1_hits"] <= row["hits"] and row["l1_hits"] <= row["could_hit"]  # a hit needs a request before
        assert 0 <= row["spread_p50"] <= row["spread_p99"] <= row["spread_max"] <= affinity.context["clients"]
    assert rows["affinity"]["affinity_share"] > rows["default"]["affinity_share"]

    (load,) = loaded["serving-load"].rows
    assert load["errors"] == 0 and load["requests"] == load["ok"] == sum(load["outcomes"].values())
    assert load["outcomes"].get("hit", 0) > 0 and load["clients"] == 32
    assert len(load["rss"]) == 2 and all(r["start_mb"] > 0 and r["end_mb"] > 0 for r in load["rss"])

    report = load_bench_script("report", monkeypatch)
    for part, render in (("serving-hit", report.serving_hit), ("serving-miss", report.serving_miss),
                         ("serving-affinity", report.serving_affinity), ("serving-load", report.serving_load)):
        lines = render(loaded)
        assert f"Command: `{loaded[part].command}`" in lines
        assert any(line.startswith("| ") and line.endswith(" met |") for line in lines)
