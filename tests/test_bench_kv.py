"""bench/kv.py: the KV prefix cache's benchmark, its result files, and their rendering by bench/report.py. The
end-to-end test runs every part with ``--quick`` (a tiny Llama, 256-token prompts, the suite's kind of
redis-server, the trace's first 300 requests; under a minute on two cores) and checks what the files say, never
how fast anything was; the routing replay is checked on a hand-made trace."""

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
PARTS = ("kv-ttft", "kv-chunks", "kv-routing", "kv-memory")



@pytest.fixture
def kv(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("kv", monkeypatch)


def test_affinity_sends_a_shared_prefix_back_to_the_replica_that_holds_it(kv):
    # Far apart in time: every request finds both queues empty, so only the prefix decides.
    requests = [(0.0, (1, 2, 3)), (10.0, (1, 2, 3, 4)), (20.0, (1, 2, 5)), (30.0, (9, 8))]
    row = kv.replay_routing(requests, "affinity", "lru", capacity_blocks=64, per_block_s=0.01, rate_scale=1.0)
    # Request 2 reuses 1, 2, 3; request 3 reuses 1, 2 (the lookup stops at the first block not held).
    assert (row["blocks_requested"], row["blocks_reused"]) == (12, 5)
    assert sorted(row["per_replica"])[-1] >= 3 and sum(row["per_replica"]) == 4
    assert row["routed_by_prefix"] == 4


def test_a_full_l1_evicts_and_lookahead_keeps_the_blocks_of_a_waiting_request(kv):
    # One replica with room for two blocks: the third request (1, 2) waits while the second (3, 4) is served.
    # LRU stores 3, 4 over 1, 2; lookahead keeps 1, 2 for the waiting request and does not store 3, 4.
    requests = [(0.0, (1, 2)), (0.1, (3, 4)), (0.2, (1, 2))]
    runs = {policy: kv.replay_routing(requests, "affinity", policy, capacity_blocks=2, per_block_s=1.0,
                                      rate_scale=1.0, replicas=1) for policy in ("lru", "lookahead")}
    lru, ahead = runs["lru"], runs["lookahead"]
    assert lru["blocks_requested"] == ahead["blocks_requested"] == 6
    # LRU: 3, 4 evict 1, 2, which come back over them; 8-byte blocks.
    assert (lru["blocks_reused"], lru["evictions"], lru["l1_used_bytes"]) == (0, [4], [16])
    assert (ahead["blocks_reused"], ahead["evictions"]) == (2, [0])
    assert lru["mean_waiting"] == ahead["mean_waiting"] == pytest.approx(1 / 3)  # the second request starts with the third waiting


def test_belady_counts_the_optimum_per_replica(kv):
    row = kv.belady_row("affinity", {"r0": [(0, (1, 2)), (1, (3,)), (2, (1, 2))], "r1": [(3, (4,))]}, 2)
    assert (row["blocks_requested"], row["blocks_reused"]) == (6, 2)  # 1, 2 kept past 3, which is bypassed


def test_the_device_option_selects_cuda_only_where_torch_sees_one(kv, capsys):
    import torch

    assert kv.options(["--quick"]).device == "cpu"
    if torch.cuda.is_available():
        assert kv.options(["--device", "cuda"]).device == "cuda"
    else:
        with pytest.raises(SystemExit):
            kv.options(["--device", "cuda"])
        assert "torch sees no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kv.options(["--parts", "a,x"])
    assert "unknown part(s) x" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.redis
def test_quick_run_writes_a_sane_result_file_per_part_and_the_report_renders_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("EVOCACHE_REDIS_URL", None)  # the bench starts its own redis-server, as make bench-kv does
    done = subprocess.run([sys.executable, str(BENCH / "kv.py"), "--quick", "--results", str(results)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in results.iterdir()) == sorted(f"{p}.json" for p in PARTS)
    load = load_bench_script("_results", monkeypatch).load
    files = {part: load(results / f"{part}.json") for part in PARTS}
    assert all(f.command.endswith(f"bench/kv.py --quick --results {results}") for f in files.values())

    ttft = files["kv-ttft"]
    rows = {r["case"]: r for r in ttft.rows}
    hit = ttft.context["hit_tokens"]
    assert ttft.context["tokens"] == 256 and ttft.context["block_bytes"] > 0
    assert rows["cold"]["reused_tokens"] == 0 and rows["cold"]["recomputed_tokens"] == 256
    for fraction in ("0.5", "0.9"):
        assert rows[f"l1-{fraction}"]["reused"] == {"l1": hit[fraction]}
        for tier in ("l2", "l3"):
            for name in (f"{tier}-{fraction}", f"{tier}-{fraction}-prefetch"):
                assert rows[name]["reused"] == {"l1": 0, tier: hit[fraction]}, name  # a cold replica's L1
                assert rows[name]["recomputed_tokens"] == 256 - hit[fraction]
                assert 0.0 <= rows[name]["hidden_fraction"] <= 1.0
            assert rows[f"{tier}-{fraction}"]["load_ms"] > 0 and rows[f"{tier}-{fraction}"]["hidden_ms"] == 0
            assert rows[f"{tier}-{fraction}-prefetch"]["prefetch_ms"] > 0
    for r in ttft.rows:
        assert r["ttft_ms"] > 0 and r["samples"] == 1
        assert r["speedup"] == pytest.approx(ttft.context["cold_ms"] / r["ttft_ms"])

    chunks = files["kv-chunks"]
    context = chunks.context
    assert context["preamble_first"] != context["preamble_second"]
    by_k = {r["recompute_tokens"]: r for r in chunks.rows}
    assert set(by_k) == {None, 0, 16, 32}
    for k in (0, 16, 32):
        assert by_k[k]["chunk_tokens"] == context["chunk"] - k and by_k[k]["chunk_fallback"] == ""
        assert by_k[k]["kl"] >= 0 and 0 <= by_k[k]["greedy_agreeing"] <= context["generated"]
    assert by_k[0]["kl"] > 0  # reusing a moved chunk is approximate

    routing = files["kv-routing"]
    groups: dict[tuple[float, str], dict[str, dict]] = {}
    for r in routing.rows:
        groups.setdefault((r["utilisation"], r["router"]), {})[r["policy"]] = r
    assert {router for _, router in groups} == {"affinity", "default"}
    for group in groups.values():
        assert set(group) == {"lru", "lookahead", "belady"}
        for policy, r in group.items():
            assert r["blocks_requested"] == routing.context["blocks"]
            assert 0 <= r["kv_hit_ratio"] <= 1
            if policy != "belady":
                assert sum(r["per_replica"]) == routing.context["requests"] == r["requests"]
                assert all(u <= routing.context["l1_capacity_blocks"] * 8 for u in r["l1_used_bytes"])
        assert group["belady"]["blocks_reused"] >= group["lru"]["blocks_reused"]

    memory = files["kv-memory"]
    per_token = {r["dtype"]: r for r in memory.rows if r["kind"] == "per-token"}
    assert per_token["float32"]["bytes_per_token"] == 2 * per_token["bfloat16"]["bytes_per_token"]
    bound = next(r for r in memory.rows if r["kind"] == "bound")
    assert bound["within"] and bound["max_used_bytes"] <= bound["capacity_bytes"]
    assert bound["evictions"] > 0 and bound["stored_blocks"] == bound["held_blocks"] + bound["evictions"]
    assert bound["held_storage_bytes"] == bound["used_bytes"]

    report = load_bench_script("report", monkeypatch)
    section = report.kv_ttft(files)
    assert any(line.startswith("| 90 % prefix from L1") for line in section)
    assert report.kv_chunks(files)[0].startswith("Chunk reuse")
    assert any("`lookahead` ≥ LRU" in line for line in report.kv_routing(files))
    assert any("within the bound" in line for line in report.kv_memory(files))
