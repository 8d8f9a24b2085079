"""bench/report.py renders result files into docs/benchmarks.md and the README's headline block; bench/_results.py
writes and checks them. Fixture results (small, hand-made numbers) are rendered and compared exactly."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _bench_scripts import load_bench_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
EXPECTED = Path(__file__).resolve().parent / "data" / "bench_report"



@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("report", monkeypatch)


MACHINE = {"cores": 2, "load_average": [0.5, 0.75, 1.0], "platform": "Linux-test-x86_64"}
VERSIONS = {"python": "3.11.7", "evocache": "0.1.0", "numpy": "2.0.0", "torch": None, "redis-py": "5.3.0"}


def _replayed(policy: str, size: float, hit: float, **extra: Any) -> dict[str, Any]:
    return {"policy": policy, "size": size, "capacity": round(size * 1000), "hit_ratio": hit,
            "byte_hit_ratio": hit, "prefix_hit_ratio": hit, **extra}


def _category(pairs: int, hits: int, traps: int | None) -> dict[str, Any]:
    return {"pairs": pairs, "hits": hits, "hit_rate": hits / pairs, "exact_hits": 0,
            "traps_served": traps or 0, "trap_rate": None if traps is None else traps / pairs, "wrong": traps or 0}


def _pairs_run(seed: int, run: str, entity: int, negation: int, error: float) -> dict[str, Any]:
    return {"seed": seed, "run": run, "exploration_calls": 7, "judge_calls": 40, "lookups": 400,
            "error_rate": error, "categories": {"entity_swap": _category(75, 5, entity),
                                                "negation": _category(75, 4, negation),
                                                "paraphrase": _category(200, 30, None)}}


def _stream(stream: str, order: str, seed: int, delta: float, hit: float, error: float, static_hit: float,
            static_error: float) -> dict[str, Any]:
    return {"stream": stream, "order": order, "seed": seed, "delta": delta, "classify": True, "n": 1000,
            "oracle_hit_rate": 0.99,
            "evocache": {"hit_rate": hit, "error_rate": error, "exploration_calls": 30, "judge_calls": 900,
                         "hits": round(hit * 1000), "wrong": round(error * 1000), "exact_hits": 0,
                         "explored_wrong": 1, "final_cutoff": 0.1, "calibration": 1.5},
            "best_static": {"threshold": 0.875, "hit_rate": static_hit, "error_rate": static_error},
            "ratio": hit / static_hit, "meets": False}


def _doc(part: str, rows: list[dict[str, Any]], context: dict[str, Any], command: str) -> dict[str, Any]:
    return {"format": "evocache-bench-result", "version": 1, "part": part, "command": command,
            "date": "2030-01-02T03:04:05Z", "machine": copy.deepcopy(MACHINE), "versions": dict(VERSIONS),
            "context": context,
            "rows": rows}


def _without_static(doc: dict[str, Any]) -> dict[str, Any]:
    row = doc["rows"][0]
    row["best_static"] = {"threshold": None, "hit_rate": 0.0, "error_rate": 0.0}
    row["ratio"] = None
    row["meets"] = False
    return doc


def _eviction_context(trace: str, unit: str = "objects") -> dict[str, Any]:
    return {"trace": trace, "requests": 1200, "objects": 400, "unit": unit, "skipped": 0}


def fixtures() -> dict[str, dict[str, Any]]:
    semantic = ".venv/bin/python bench/semantic.py --pairs-seeds 0,1 --results bench/results"
    mooncake = "bench/data/mooncake_synthetic_trace.jsonl"
    sizes = (0.05, 0.1)
    lookahead_rows = []
    for u, told, policies in ((0.5, False, {"lookahead": (0.11, 0.22), "lookahead:learned": (0.12, 0.24)}),
                              (0.5, True, {"lookahead:learned": (0.13, 0.25)}),
                              (0.8, False, {"lookahead": (0.15, 0.26), "lookahead:learned": (0.16, 0.27)}),
                              (0.8, True, {"lookahead:learned": (0.18, 0.29)})):
        for i, size in enumerate(sizes):
            lookahead_rows.append(_replayed("lru", size, (0.1, 0.2)[i], utilisation=u, output_lengths=told))
            lookahead_rows += [_replayed(p, size, hits[i], utilisation=u, output_lengths=told)
                               for p, hits in policies.items()]
            lookahead_rows.append(_replayed("belady", size, (0.3, 0.4)[i], utilisation=u, output_lengths=told))
    queue = {"per_block_s": 0.004, "requests": 40, "blocks": 1200, "span_s": 10.0}
    return {
        "semantic-streams": _doc("semantic-streams", [
            _stream("banking77", "as-is", 0, 0.02, 0.6, 0.012, 0.45, 0.019),
            _stream("banking77", "as-is", 1, 0.02, 0.63, 0.021, 0.45, 0.019),
            _stream("banking77", "shuffled-100", 100, 0.02, 0.62, 0.01, 0.5, 0.0195),
            _stream("banking77", "as-is", 0, 0.05, 0.7, 0.03, 0.68, 0.047),
        ], {"classify": True}, semantic),
        "semantic-pairs": _doc("semantic-pairs", [
            _pairs_run(0, "cold", 1, 2, 0.005), _pairs_run(0, "warm", 0, 1, 0.001),
            _pairs_run(1, "cold", 3, 0, 0.0075), _pairs_run(1, "warm", 2, 2, 0.004),
            {"seed": 0, "run": "static", "threshold": 0.8,
             "categories": _pairs_run(0, "static", 20, 40, 0.0)["categories"]},
        ], {"delta": 0.02, "classify": True}, semantic),
        # a row per run: a frozen copy of a small real run, its first row's static threshold taken away (a run
        # whose queries no threshold serves within δ)
        "semantic-generalisation": _without_static(
            json.loads((EXPECTED / "semantic-generalisation.json").read_text(encoding="utf-8"))),
        "eviction-mooncake": _doc("eviction-mooncake", [
            _replayed(p, size, hits[i]) for i, size in enumerate(sizes)
            for p, hits in {"lru": (0.1, 0.2), "arc": (0.12, 0.21), "learned": (0.11, 0.23),
                            "lcs:LRU": (0.1, 0.2), "belady": (0.3, 0.4)}.items()
        ], _eviction_context(mooncake), f"evocache bench eviction --trace {mooncake} --sizes 0.05,0.1 --policies "
                                        "lru,arc,learned --peers --json build/bench-eviction/mooncake.json"),
        "eviction-mooncake-output-lengths": _doc("eviction-mooncake-output-lengths", [
            _replayed(p, size, hits[i]) for i, size in enumerate(sizes)
            for p, hits in {"lru": (0.1, 0.2), "learned": (0.14, 0.25), "belady": (0.3, 0.4)}.items()
        ], {**_eviction_context(mooncake), "output_lengths": True},
            f"evocache bench eviction --trace {mooncake} --sizes 0.05,0.1 --policies lru,learned --output-lengths "
            "--json build/bench-eviction/mooncake_output_lengths.json"),
        "eviction-lookahead": _doc("eviction-lookahead", lookahead_rows, {
            **_eviction_context(mooncake),
            "queues": [{"utilisation": 0.5, "mean_waiting": 0.7, "max_waiting": 11, **queue},
                       {"utilisation": 0.8, "mean_waiting": 12.14, "max_waiting": 98, **queue}],
            "commands": ["evocache bench eviction --utilisation 0.5 ...", "evocache bench eviction --utilisation 0.8"]},
            ".venv/bin/python bench/eviction.py --results bench/results --parts e"),
        "eviction-cloudphysics": _doc("eviction-cloudphysics", [
            _replayed(p, size, hits[i]) for i, size in enumerate(sizes)
            for p, hits in {"lru": (0.17, 0.2), "learned": (0.2, 0.25), "belady-size (heuristic)": (0.28, 0.35)}.items()
        ], _eviction_context("../shared/data/traces/cloudPhysicsIO.csv", "bytes"),
            "evocache bench eviction --trace ../shared/data/traces/cloudPhysicsIO.csv --csv-columns id=lbn"),
        "eviction-throughput": _doc("eviction-throughput", [{
            "accesses": 121877, "capacity_objects": 2196, "rounds": 5, "replay_s": 0.5, "baseline_s": 0.05,
            "replay_per_min": 14625240.0, "baseline_per_min": 146252400.0, "ratio": 10.0}],
            {"trace": mooncake}, ".venv/bin/python bench/eviction.py --parts c"),
        "eviction-cost": _doc("eviction-cost", [
            {"policy": "lru", "hit_ratio": 0.155, "policy_calls": 400000, "policy_us": 1.2, "cpu_us": 7.0,
             "wall_us": 7.5, "policy_ratio": 1.0, "cpu_ratio": 1.0},
            {"policy": "learned", "hit_ratio": 0.156, "policy_calls": 400000, "policy_us": 56.4, "cpu_us": 77.0,
             "wall_us": 80.0, "policy_ratio": 47.0, "cpu_ratio": 11.0},
        ], {"trace": mooncake, "accesses": 121877, "capacity_bytes": 562176, "timer_ns_subtracted": 93.4},
            ".venv/bin/python bench/eviction.py --parts d"),
        "overhead": _doc("overhead", [
            {"comparison": "l1_hit_vs_cachetools", "candidate_us": 1.4, "baseline_us": 0.5, "ratio": 2.8,
             "target": 3.0},
            {"comparison": "l2_hit_vs_redis_get", "candidate_us": 130.0, "baseline_us": 100.0, "ratio": 1.3,
             "target": 1.2},
            {"comparison": "miss_path_vs_bare_1ms", "candidate_us": 1050.0, "baseline_us": 1000.0, "ratio": 1.05,
             "target": 1.05},
        ], {"rounds": 21}, ".venv/bin/python bench/overhead.py --results bench/results"),
        **serving_fixtures(),
        **gateway_fixtures(),
        **kv_fixtures(),
    }


def _compared(name: str, baseline: str, ours: tuple[float, float], theirs: tuple[float, float],
              target: float) -> dict[str, Any]:
    return {"comparison": name, "path": "http" if "http" in name else "handle", "baseline": baseline,
            "samples": 600, "evocache_p50_ms": ours[0], "evocache_p99_ms": ours[1], "baseline_p50_ms": theirs[0],
            "baseline_p99_ms": theirs[1], "ratio_p50": ours[0] / theirs[0], "ratio_p99": ours[1] / theirs[1],
            "target_p50_ratio": target}


def _router(router: str, share: float, l1_hits: int, spread: tuple[float, float, int]) -> dict[str, Any]:
    return {"router": router, "requests": 400, "errors": 0, "could_hit": 20, "hits": l1_hits, "l1_hits": l1_hits,
            "l1_hit_ratio": l1_hits / 20, "prior_blocks": 1000, "local_blocks": round(share * 1000),
            "affinity_share": share, "p50_ms": 60.0, "p99_ms": 150.0, "spread_p50": spread[0],
            "spread_p99": spread[1], "spread_max": spread[2], "over_threshold_share": 0.01,
            "per_replica": [210, 190]}


def serving_fixtures() -> dict[str, dict[str, Any]]:
    command = ".venv/bin/python bench/serving.py --results bench/results"
    rss = [{"start_mb": 160.0, "warm_mb": 165.0, "end_mb": 170.0, "growth": 5 / 165},
           {"start_mb": 161.0, "warm_mb": 166.0, "end_mb": 166.0, "growth": 0.0}]
    return {
        "serving-hit": _doc("serving-hit", [
            _compared("hit_handle", "echo deployment", (2.0, 4.0), (2.0, 3.2), 1.2),
            _compared("hit_http", "one echo deployment", (9.0, 18.0), (4.5, 9.0), 1.2),
            _compared("hit_http_two_hops", "two echo deployments", (9.0, 18.0), (8.0, 15.0), 1.2),
        ], {"rounds": 15, "per_round": 40, "replicas": 1, "prompt_chars": 252, "answer_chars": 256,
            "body_bytes": 542, "tier": "l1"}, command),
        "serving-miss": _doc("serving-miss", [
            {**_compared("miss_handle", "bare deployment", (52.0, 56.0), (51.0, 53.0), 1.05), "misses": 200},
        ], {"rounds": 10, "per_round": 20, "replicas": 1, "model_ms": 50.0}, command),
        "serving-affinity": _doc("serving-affinity", [
            _router("affinity", 0.9, 19, (2.0, 4.0, 6)), _router("default", 0.5, 10, (1.0, 3.0, 5)),
        ], {"trace": "bench/data/mooncake_synthetic_trace.jsonl", "requests": 400, "trace_requests": 3993,
            "chunk": 100, "clients": 8,
            "replicas": 2, "block_size": 16, "model_ms": 50.0, "imbalance_threshold": 4,
            "errors": {"affinity": [], "default": []}, "target_share_ratio": 1.5}, command),
        "serving-load": _doc("serving-load", [
            {"duration_s": 60.2, "clients": 32, "requests": 9000, "errors": 0, "ok": 9000, "throughput_rps": 149.5,
             "p50_ms": 200.0, "p99_ms": 400.0, "outcomes": {"miss": 5000, "hit": 4000}, "rss": rss,
             "rss_growth_max": 5 / 165},
        ], {"replicas": 2, "pool": 256, "fresh_share": 0.5, "warm_up_s": 10.0, "model": "instant",
            "rss_samples": 61, "error_examples": [], "target_rss_growth": 0.1}, command),
    }


def gateway_fixtures() -> dict[str, dict[str, Any]]:
    command = ".venv/bin/python bench/gateway.py --results bench/results"
    setup = {"vllm_command": "python -m vllm.entrypoints.openai.api_server --model MODEL_DIR",
             "serve_command": "evocache serve --upstream http://127.0.0.1:VLLM_PORT/v1 --tokenizer MODEL_DIR",
             "model": "tiny random-weight Llama", "max_tokens": 64, "temperature": 0, "vllm_start_s": 30.0,
             "serve_start_s": 30.0}
    hit = {"comparison": "hit_vs_echo", "path": "http", "baseline": "bare echo server", "samples": 480,
           "baseline_samples": 480, "evocache_p50_ms": 9.0, "evocache_p99_ms": 18.0, "baseline_p50_ms": 1.5,
           "baseline_p99_ms": 3.0, "ratio_p50": 6.0, "ratio_p99": 6.0, "target_p50_ratio": 1.2}
    computed = {**hit, "comparison": "hit_vs_vllm", "baseline": "vLLM straight", "baseline_samples": 60,
                "baseline_p50_ms": 300.0, "baseline_p99_ms": 600.0, "ratio_p50": 0.03, "ratio_p99": 0.03,
                "target_p50_ratio": None}
    miss = {**hit, "comparison": "miss_vs_vllm", "baseline": "vLLM straight", "samples": 80, "baseline_samples": 80,
            "evocache_p50_ms": 315.0, "evocache_p99_ms": 700.0, "baseline_p50_ms": 300.0, "baseline_p99_ms": 650.0,
            "ratio_p50": 1.05, "ratio_p99": 700 / 650, "target_p50_ratio": 1.05,
            "evocache_prompt_tokens": [170], "evocache_cached_tokens": [0, 128], "evocache_completion_tokens": [64],
            "baseline_prompt_tokens": [170], "baseline_cached_tokens": [128], "baseline_completion_tokens": [64]}

    def load(target: str, requests: int, hits: int, hit: tuple[float, float] | None,
             running: tuple[float, float]) -> dict[str, Any]:
        row = {"target": target, "duration_s": 62.0, "clients": 32, "requests": requests, "errors": 0,
               "ok": requests, "throughput_rps": requests / 62.0, "outcomes": {"miss": requests - hits},
               "completion_tokens_per_s": requests * 64 / 62.0, "max_in_flight": 32, "p50_ms": 900.0,
               "p99_ms": 3000.0, "miss_p50_ms": 1800.0, "miss_p99_ms": 3000.0, "vllm_running_mean": running[0],
               "vllm_running_max": running[1], "vllm_waiting_max": 0.0}
        if hit is not None:
            row |= {"outcomes": {"miss": requests - hits, "hit": hits}, "hit_p50_ms": hit[0], "hit_p99_ms": hit[1]}
        return row

    ours = load("evocache", 1200, 600, (20.0, 80.0), (7.5, 8.0)) | {
        "rss": {"start_mb": 2400.0, "warm_mb": 2450.0, "end_mb": 2460.0, "peak_mb": 2470.0, "processes": 14},
        "probe": {"interval_s": 0.1, "samples": 300, "errors": 0, "evocache_p50_ms": 12.0, "evocache_p99_ms": 90.0,
                  "echo_p50_ms": 1.2, "echo_p99_ms": 30.0},
        "hit_lookup": {"events": 900, "p50_ms": 0.3, "p99_ms": 2.5}}
    return {
        "gateway-hit": _doc("gateway-hit", [hit, computed], {
            **setup, "rounds": 12, "per_round": {"evocache": 40, "echo": 40, "vllm": 5}, "prompt_tokens": 170,
            "completion_tokens": 64, "body_bytes": 721, "tiers": {"l1": 480}, "answered_by": "ingress",
            "target_p50_ratio": 1.2}, command),
        "gateway-miss": _doc("gateway-miss", [miss], {**setup, "rounds": 40, "per_round": 2,
                                                      "streamed_upstream": True}, command),
        "gateway-load": _doc("gateway-load", [ours, load("vllm", 2000, 0, None, (28.0, 32.0))], {
            **setup, "load_s": 60.0, "repeat_share": 0.5, "warm_up_s": 10.0, "order": "through evocache, then straight to vLLM",
            "error_examples": [], "probe_error_examples": [], "rss_samples": 61,
            "vllm_rss_mb": {"start_mb": 1650.0, "end_mb": 1700.0}, "target_hit_p99_ms": 50.0, "target_errors": 0},
            command),
        "gateway-savings": _doc("gateway-savings", [
            {"outcome": "hit", "requests": 600, "prompt_tokens": 102000, "cached_tokens": 102000,
             "completion_tokens": 38400, "computed_tokens": 0, "cost_usd": 0.0, "saved_tokens": 140400,
             "saved_usd": 0.1086, "saved_usd_prompts_cached": 0.0627},
            {"outcome": "miss", "requests": 600, "prompt_tokens": 102000, "cached_tokens": 76800,
             "completion_tokens": 38400, "computed_tokens": 63600, "cost_usd": 0.0740, "saved_tokens": 0,
             "saved_usd": 0.0, "saved_usd_prompts_cached": 0.0},
        ], {"prices_usd_per_million": {"input": 0.5, "cached_input": 0.05, "output": 1.5},
            "prices_note": "illustrative, given on the command line; not any provider's", "duration_s": 62.0,
            "requests": 1200}, command),
    }


KV_MODEL = {"family": "llama", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "intermediate_size": 1408, "vocab_size": 30522, "max_position_embeddings": 4096}


def _ttft(case: str, tier: str | None, hit: float, ms: float, *, prefetch: bool = False, load: float = 0.0,
          fetched: float = 0.0, hidden: float = 0.0) -> dict[str, Any]:
    queued = prefetch or case == "cold-queued"
    return {"case": case, "tier": tier, "hit": hit, "prefetch": prefetch, "queued": queued, "samples": 5,
            "ttft_ms": ms, "ttft_ms_all": [ms] * 5, "speedup": 1000.0 / ms,
            "speedup_queued": 1010.0 / ms if queued else None, "reused_tokens": round(hit * 2048) // 16 * 16,
            "reused": {}, "recomputed_tokens": 2048, "load_ms": load, "prefetch_ms": fetched, "hidden_ms": hidden,
            "hidden_fraction": hidden / (load + fetched) if tier in ("l2", "l3") and load + fetched else None}


def _routed(utilisation: float, router: str, policy: str, hit: float, waiting: float | None) -> dict[str, Any]:
    return {"utilisation": utilisation, "per_block_ms": 13.4, "router": router, "policy": policy, "requests": 400,
            "blocks_requested": 1000, "blocks_reused": round(hit * 1000), "kv_hit_ratio": hit,
            "routed_by_prefix": None, "mean_waiting": waiting, "wait_p50_s": None, "wait_p99_s": None,
            "per_replica": [210, 190], "evictions": None, "l1_used_bytes": None}


def kv_fixtures() -> dict[str, dict[str, Any]]:
    command = ".venv/bin/python bench/kv.py --results bench/results"
    chunk = {"recompute_fraction": 0.0, "chunk_fallback": "", "prefill_ms_all": []}
    return {
        "kv-ttft": _doc("kv-ttft", [
            _ttft("cold", None, 0.0, 1000.0), _ttft("cold-queued", None, 0.0, 1010.0),
            _ttft("l1-0.9", "l1", 0.9, 180.0),
            _ttft("l2-0.9", "l2", 0.9, 360.0, load=150.0),
            _ttft("l2-0.9-prefetch", "l2", 0.9, 250.0, prefetch=True, load=10.0, fetched=190.0, hidden=150.0),
            _ttft("l3-0.9-prefetch", "l3", 0.9, 210.0, prefetch=True, load=1.0, fetched=99.0, hidden=99.0),
        ], {"tokens": 2048, "rounds": 5, "block_size": 16, "model": KV_MODEL, "dtype": "float32",
            "weights": "random", "device": "cpu", "threads": 2, "block_bytes": 262144, "cold_ms": 1000.0,
            "cold_queued_ms": 1010.0, "hit_tokens": {"0.5": 1024, "0.9": 1840},
            "targets": {"l1_speedup_90": 5.0, "l2_prefetch_speedup_90": 3.0, "l2_hidden_fraction": 0.8}}, command),
        "kv-chunks": _doc("kv-chunks", [
            {**chunk, "case": "full", "recompute_tokens": None, "chunk_tokens": 0, "kl": 0.0, "max_dlogit": 0.0,
             "greedy_agreeing": 16, "greedy_same": 16, "prefill_ms": 1000.0, "saved": 0.0},
            {**chunk, "case": "k=0", "recompute_tokens": 0, "chunk_tokens": 1776, "kl": 4.5e-05, "max_dlogit": 0.04,
             "greedy_agreeing": 6, "greedy_same": 9, "prefill_ms": 200.0, "saved": 0.8},
            {**chunk, "case": "k=16", "recompute_tokens": 16, "chunk_tokens": 1760, "kl": 1.25e-05,
             "max_dlogit": 0.02, "greedy_agreeing": 16, "greedy_same": 16, "prefill_ms": 250.0, "saved": 0.75},
        ], {"tokens": 2040, "rounds": 5, "block_size": 16, "preamble_first": 160, "preamble_second": 136,
            "chunk": 1776, "question": 128, "generated": 16, "model": KV_MODEL, "weights": "random",
            "device": "cpu", "threads": 2, "recompute_fraction": 0.0}, command),
        "kv-routing": _doc("kv-routing", [
            _routed(0.8, "affinity", "lru", 0.25, 1.2), _routed(0.8, "affinity", "belady", 0.5, None),
            _routed(0.8, "affinity", "lookahead", 0.26, 1.1), _routed(0.8, "default", "lru", 0.15, 0.7),
            _routed(0.8, "default", "belady", 0.35, None), _routed(0.8, "default", "lookahead", 0.2, 0.7),
        ], {"trace": "bench/data/mooncake_synthetic_trace.jsonl", "requests": 400, "distinct_blocks": 800,
            "blocks": 1000, "replicas": 2, "l1_size": 0.05, "l1_capacity_blocks": 40, "arrival_rate_rps": 3.9,
            "span_s": 102.0, "utilisations_without_reuse": [0.8], "imbalance_threshold": 10,
            "targets": {"affinity_hit_ratio": 1.5, "queue_aware_gap_share": 0.1}}, command),
        "kv-memory": _doc("kv-memory", [
            {"kind": "per-token", "dtype": "float32", "bytes_per_token": 16384, "block_bytes": 262144,
             "tokens_per_gib": 65536},
            {"kind": "per-token", "dtype": "bfloat16", "bytes_per_token": 8192, "block_bytes": 131072,
             "tokens_per_gib": 131072},
            {"kind": "bound", "dtype": "float32", "capacity_bytes": 50462720, "used_bytes": 50331648,
             "max_used_bytes": 50331648, "held_blocks": 192, "held_storage_bytes": 50331648, "stored_blocks": 512,
             "evictions": 320, "within": True},
        ], {"model": KV_MODEL, "block_size": 16, "layers": 8, "kv_heads": 4, "head_dim": 64, "prompts": 4,
            "prompt_tokens": 2048, "capacity_blocks": 192.5, "device": "cpu"}, command),
        # the policy loop's results are long (a row per window, a grid of static policies): frozen copies
        **{part: json.loads((EXPECTED / f"{part}.json").read_text(encoding="utf-8"))
           for part in ("loop-kv", "loop-semantic", "loop-stationary")},
    }


def write_fixtures(directory: Path, documents: dict[str, dict[str, Any]] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for part, document in (documents or fixtures()).items():
        (directory / f"{part}.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return directory


README = "# evocache\n\nIntro.\n\n<!-- bench:begin -->\nold figures\n<!-- bench:end -->\n\nMore.\n"


def test_the_page_and_the_headline_are_rendered_exactly(tmp_path: Path, report: ModuleType) -> None:
    results = report.load_all(write_fixtures(tmp_path / "results"))
    assert report.page(results) == (EXPECTED / "benchmarks.md").read_text(encoding="utf-8")
    assert report.headline(results) == (EXPECTED / "headline.md").read_text(encoding="utf-8").rstrip("\n")


def test_the_headline_quotes_the_figures_of_the_result_files(tmp_path: Path, report: ModuleType) -> None:
    block = report.headline(report.load_all(write_fixtures(tmp_path / "results")))
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]
    measured = [row.split(" | ")[1] for row in rows]
    assert measured == [
        "banking77 1.24-1.40×; error within δ in 2 of 3 runs",  # 0.6 / 0.45, 0.63 / 0.45, 0.62 / 0.5; 0.021 > δ
        # the 200-query runs, cold and cross: 0.035 / 0.19, 0.015 / 0.19, 0.02 / 0.135, 0.02 / 0.135
        "0.08-0.18× (mean 0.14×, target 1.25× met in 0 of 4 runs); error within δ in 4 of 4, at most 2.00 judge "
        "calls per query (budget 2)",
        "3 of 75 alone, 2 as a new tenant (2 pair orders)",
        "0.110 / 0.230, 0.140 / 0.250 told output lengths (LRU 0.100 / 0.200, ARC 0.120 / 0.210, Belady "
        "0.300 / 0.400)",
        "40.0 % / 45.0 %",  # (0.18 - 0.1) / (0.3 - 0.1), (0.29 - 0.2) / (0.4 - 0.2)
        "2.80× (1.40 µs against 0.50 µs)",
        "1.30× (130.00 µs against 100.00 µs)",
        "1.05× (1050.00 µs against 1000.00 µs)",
        "1.00× over a handle (2.00 ms against 2.00 ms), 1.12× over HTTP against the same two hops (9.00 ms "
        "against 8.00 ms), 2.00× against one bare deployment",
        "+2.0 % (52.0 ms against 51.0 ms)",
        "0.90 against 0.50 (1.80×)",
        "9,000 requests, 0 errors, 150 req/s, p99 400 ms; replica RSS +3.0 % after the first 10 s",
        "9.0 ms: 6.0× the echo server (1.50 ms); vLLM 300 ms",
        "+5.0 % (315 ms against 300 ms)",
        "1,200 requests, 0 errors, 19.4 req/s (straight to vLLM 32.3); hits p99 80.0 ms, misses p99 3000 ms; "
        "50.0 % of the tokens not computed by vLLM",  # (102,000 + 38,400) of 2 * 140,400
        "5.56× from L1, 4.00× from Redis (L2) prefetched while queued, 75.0 % of its load hidden (cold 1000 ms)",
        "0.250 against 0.150 (1.67×)",
        "14.6 M accesses per minute",
        "KV: 59.2 %, drift reported 0 windows after it came; semantic: 99.1 %, drift reported 0 windows after it "
        "came; 0 false drift reports on stationary traffic",
        "rules.batch.cache: response -> bypass: predicted +0.064 [+0.015, +0.135], realised +0.040; "
        "rules.faq.semantic.max_error: 0.03 -> 0.04: predicted +0.024 [+0.008, +0.044], not measured; "
        "harmful proposals rolled back: 1 of 2",
    ]
    assert rows[0].endswith("[details](docs/benchmarks.md#semantic-caching-streams) |")


@pytest.mark.slow
def test_the_command_writes_the_page_and_replaces_only_the_readme_block(tmp_path: Path, report: ModuleType,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    results = write_fixtures(tmp_path / "results")
    doc, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    argv = ["--results", str(results), "--doc", str(doc), "--readme", str(readme)]
    assert report.main([*argv, "--check"]) == 1  # nothing generated yet
    assert report.main(argv) == 0
    assert doc.read_text(encoding="utf-8") == (EXPECTED / "benchmarks.md").read_text(encoding="utf-8")
    headline = (EXPECTED / "headline.md").read_text(encoding="utf-8").rstrip("\n")
    assert readme.read_text(encoding="utf-8") == f"# evocache\n\nIntro.\n\n{headline}\n\nMore.\n"
    assert report.main([*argv, "--check"]) == 0
    assert report.main(argv) == 0  # idempotent: the block is found again between its markers
    assert readme.read_text(encoding="utf-8") == f"# evocache\n\nIntro.\n\n{headline}\n\nMore.\n"
    capsys.readouterr()


def _fails(report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str],
           documents: dict[str, dict[str, Any]], readme: str = README) -> str:
    results = write_fixtures(tmp_path / "results", documents)
    doc, readme_path = tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme_path.write_text(readme, encoding="utf-8")
    code = report.main(["--results", str(results), "--doc", str(doc), "--readme", str(readme_path)])
    out, err = capsys.readouterr()
    assert (code, out, doc.exists(), readme_path.read_text(encoding="utf-8")) == (1, "", False, readme)
    assert err.startswith("report.py: error: ") and err.count("\n") == 1
    return err.removeprefix("report.py: error: ").rstrip("\n").replace(str(results), "RESULTS")


@pytest.mark.slow
def test_a_missing_result_file_is_named_with_the_command_that_makes_it(
        tmp_path: Path, report: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    documents = fixtures()
    del documents["overhead"], documents["semantic-pairs"]
    assert _fails(report, tmp_path, capsys, documents) == (
        "missing result file(s): RESULTS/semantic-pairs.json (made by make bench-semantic); "
        "RESULTS/overhead.json (made by make bench)")


@pytest.mark.slow
def test_an_unknown_result_file_is_refused(tmp_path: Path, report: ModuleType,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    documents = fixtures()
    documents["semantic-extra"] = {**documents["overhead"], "part": "semantic-extra"}
    assert _fails(report, tmp_path, capsys, documents).startswith(
        "RESULTS: no section for semantic-extra.json; known parts: semantic-streams, semantic-pairs, ")


def _broken(part: str, change: Any) -> dict[str, dict[str, Any]]:
    documents = copy.deepcopy(fixtures())
    change(documents[part])
    return documents


@pytest.mark.slow
@pytest.mark.parametrize(("part", "change", "message"), [
    ("overhead", lambda d: d.pop("machine"), "RESULTS/overhead.json: missing field 'machine'"),
    ("overhead", lambda d: d.update(format="other"),
     "RESULTS/overhead.json: field 'format' must be 'evocache-bench-result', got 'other'"),
    ("overhead", lambda d: d.update(version=2),
     "RESULTS/overhead.json: version 2 is not the one this reader knows (1)"),
    ("overhead", lambda d: d.update(part="semantic-streams"),
     "RESULTS/overhead.json: field 'part' is 'semantic-streams', but the file is named 'overhead.json'"),
    ("overhead", lambda d: d.update(rows={}), "RESULTS/overhead.json: field 'rows' must be a list, got an object"),
    ("overhead", lambda d: d.update(rows=[]), "RESULTS/overhead.json: field 'rows' is empty"),
    ("overhead", lambda d: d["rows"].__setitem__(1, 3), "RESULTS/overhead.json: rows[1] must be an object, got an integer"),
    ("overhead", lambda d: d["rows"][0].pop("ratio"), "RESULTS/overhead.json: rows[0]: missing field 'ratio'"),
    ("overhead", lambda d: d["rows"][2].update(ratio="fast"),
     "RESULTS/overhead.json: rows[2]: field 'ratio' must be a number, got 'fast'"),
    ("overhead", lambda d: d["rows"][2].update(ratio=True),
     "RESULTS/overhead.json: rows[2]: field 'ratio' must be a number, got True"),
    ("overhead", lambda d: d["machine"].update(load_average=[1.0]),
     "RESULTS/overhead.json: machine: field 'load_average' must be three numbers, got [1.0]"),
    ("overhead", lambda d: d["machine"].pop("cores"), "RESULTS/overhead.json: machine: missing field 'cores'"),
    ("overhead", lambda d: d["versions"].update(numpy=2),
     "RESULTS/overhead.json: versions: 'numpy' must be a string or null, got 2"),
    ("semantic-streams", lambda d: d["rows"][3]["evocache"].pop("hit_rate"),
     "RESULTS/semantic-streams.json: rows[3].evocache: missing field 'hit_rate'"),
    ("semantic-pairs", lambda d: d["rows"][0].update(run="hot"),
     "RESULTS/semantic-pairs.json: rows[0]: field 'run' must be cold, warm or static, got 'hot'"),
    ("semantic-generalisation", lambda d: d["rows"][2].update(run="warm"),
     "RESULTS/semantic-generalisation.json: rows[2]: field 'run' must be prefix, cross or pairs, got 'warm'"),
    ("semantic-generalisation", lambda d: d["rows"][2].update(transferred_static=None),
     "RESULTS/semantic-generalisation.json: rows[2]: a run learnt on another stream has a transferred static "
     "threshold, and only such a run"),
    ("semantic-generalisation", lambda d: d["rows"][4].pop("judge_per_query"),
     "RESULTS/semantic-generalisation.json: rows[4]: missing field 'judge_per_query'"),
    ("semantic-generalisation", lambda d: d["rows"][5]["evocache"].update(calibration_bounded="yes"),
     "RESULTS/semantic-generalisation.json: rows[5].evocache: field 'calibration_bounded' must be a boolean, got 'yes'"),
    ("eviction-mooncake", lambda d: d["rows"].pop(4),  # Belady at 5 %
     "RESULTS/eviction-mooncake.json: at size 0.05 expected one 'lru' row and one 'belady' row, got 1 and 0"),
    ("kv-ttft", lambda d: d["rows"].pop(2), "RESULTS/kv-ttft.json: no row for case 'l1-0.9'"),
    ("kv-ttft", lambda d: d["rows"][3].update(tier="l4"),
     "RESULTS/kv-ttft.json: rows[3]: field 'tier' must be l1, l2, l3 or null, got 'l4'"),
    ("kv-routing", lambda d: d["rows"].pop(1),
     "RESULTS/kv-routing.json: at utilisation 0.8 the affinity router has no 'belady' row"),
    ("kv-memory", lambda d: d["rows"][2].update(kind="other"),
     "RESULTS/kv-memory.json: rows[2]: field 'kind' must be per-token or bound, got 'other'"),
])
def test_a_malformed_result_file_is_a_clear_error_and_nothing_is_written(
        tmp_path: Path, report: ModuleType, capsys: pytest.CaptureFixture[str], part: str, change: Any,
        message: str) -> None:
    assert _fails(report, tmp_path, capsys, _broken(part, change)) == message


@pytest.mark.slow
def test_a_file_that_is_not_json_is_named_with_its_line_and_column(
        tmp_path: Path, report: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    results = write_fixtures(tmp_path / "results")
    (results / "overhead.json").write_text('{"format": "evocache-bench-result",\n  "version": }\n')
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert report.main(["--results", str(results), "--doc", str(tmp_path / "d.md"), "--readme", str(readme)]) == 1
    assert capsys.readouterr().err == f"report.py: error: {results}/overhead.json:2:14: not JSON: Expecting value\n"


@pytest.mark.slow
@pytest.mark.parametrize(("readme", "message"), [
    ("# no block\n", "README.md: expected the line <!-- bench:begin --> once, found it 0 times"),
    (README + README, "README.md: expected the line <!-- bench:begin --> once, found it 2 times"),
    ("<!-- bench:end -->\n<!-- bench:begin -->\n", "README.md: <!-- bench:end --> comes before <!-- bench:begin -->"),
])
def test_a_readme_without_one_block_is_refused(tmp_path: Path, report: ModuleType,
                                               capsys: pytest.CaptureFixture[str], readme: str, message: str) -> None:
    err = _fails(report, tmp_path, capsys, fixtures(), readme=readme)
    assert err == f"{tmp_path}/{message}"


def test_the_writer_records_command_machine_and_versions_and_reads_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = load_bench_script("_results", monkeypatch)
    rows = [{"x": 1.5, "nan": float("nan"), "nested": {"inf": float("inf")}}]
    command = results.command_line([str(ROOT / "bench" / "data" / "t.jsonl"), f"--out={ROOT / 'build'}",
                                    str(ROOT.parent / "shared" / "x.csv"), "a b"],
                                   program=[str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "bench" / "x.py")])
    assert command == ".venv/bin/python bench/x.py bench/data/t.jsonl --out=build ../shared/x.csv 'a b'"
    path = results.write(tmp_path / "new", "overhead", rows, command=command, context={"rounds": 3})
    assert path == tmp_path / "new" / "overhead.json"
    loaded = results.load(path)
    assert (loaded.part, loaded.command, loaded.context) == ("overhead", command, {"rounds": 3})
    assert loaded.rows == [{"x": 1.5, "nan": None, "nested": {"inf": None}}]  # JSON has no NaN or infinity
    assert loaded.machine["cores"] == os.cpu_count() and len(loaded.machine["load_average"]) == 3
    assert set(loaded.versions) == {"python", *results.DEPENDENCIES}
    assert loaded.versions["evocache"] is not None and loaded.versions["python"] == ".".join(
        map(str, sys.version_info[:3]))


def test_the_semantic_bench_writes_its_rows_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    semantic, results = load_bench_script("semantic", monkeypatch), load_bench_script("_results", monkeypatch)
    args = semantic.options(["--out", str(tmp_path / "out"), "--embed-cache", str(tmp_path / "emb"),
                             "--results", str(tmp_path / "results")])
    documents = fixtures()
    rows = documents["semantic-streams"]["rows"]
    run = {k: v for k, v in documents["semantic-pairs"]["rows"][0].items() if k not in ("seed", "run")}
    pairs = {"delta": 0.02, "classify": True, "seed": 3, "warm": run, "cold": run,
             "seeds": {"3": {"cold": run, "warm": run}}, "static": {"0.8": run["categories"]}}
    written = semantic.write_results(args, rows, pairs)
    assert written == [tmp_path / "results" / "semantic-streams.json", tmp_path / "results" / "semantic-pairs.json"]
    assert results.load(written[0]).rows == rows
    assert results.load(written[1]).rows == [{"seed": 3, "run": "cold", **run}, {"seed": 3, "run": "warm", **run},
                                             {"seed": 3, "run": "static", "threshold": 0.8,
                                              "categories": run["categories"]}]
    assert results.load(written[1]).context == {"delta": 0.02, "classify": True}


@pytest.mark.slow
def test_the_eviction_bench_writes_a_result_file_per_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = load_bench_script("_results", monkeypatch)
    traces = Path(__file__).resolve().parent / "data" / "traces"
    done = subprocess.run(
        [sys.executable, str(BENCH / "eviction.py"), "--trace", str(traces / "mooncake.jsonl"), "--sizes", "0.4,1",
         "--rounds", "1", "--parts", "ac", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    table = results.load(tmp_path / "results" / "eviction-mooncake.json")
    cli = json.loads((tmp_path / "out" / "mooncake.json").read_text())
    assert table.rows == cli["rows"]
    assert table.context["trace"] == "tests/data/traces/mooncake.jsonl"
    assert table.command.startswith("evocache bench eviction --trace tests/data/traces/mooncake.jsonl --sizes 0.4,1 ")
    speed = results.load(tmp_path / "results" / "eviction-throughput.json")
    assert speed.rows == [json.loads((tmp_path / "out" / "throughput.json").read_text())]
    assert speed.command.endswith(f"--results {tmp_path / 'results'} --parts c")
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "eviction-mooncake-output-lengths.json", "eviction-mooncake.json", "eviction-throughput.json"]


@pytest.mark.slow
def test_the_committed_page_and_readme_block_are_what_the_committed_results_generate(report: ModuleType) -> None:
    """docs/benchmarks.md and the README's headline table are never edited by hand: regenerated from
    bench/results/ they come out exactly as committed (`make bench-report` after a benchmark run)."""
    argv = ["--results", str(ROOT / "bench" / "results"), "--doc", str(ROOT / "docs" / "benchmarks.md"),
            "--readme", str(ROOT / "README.md")]
    assert report.main([*argv, "--check"]) == 0
