"""bench/gateway.py: `evocache serve --upstream` in front of a real vLLM, against vLLM straight and a bare echo
server; its result files, and their rendering by bench/report.py. The end-to-end test runs every part with
``--quick`` (its own vLLM and evocache serve, about 2 minutes on two cores); the bookkeeping is checked on
hand-made answers, without servers."""

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
PARTS = ("gateway-hit", "gateway-miss", "gateway-load", "gateway-savings")


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_bench_script("gateway", monkeypatch)


def test_every_prompt_number_gives_a_new_prompt_of_the_same_words_count(gateway):
    numbers = (0, 1, 63, 64, 64**3, 64**4 - 1)
    prompts = [gateway.prompt(n) for n in numbers]
    assert len(set(prompts)) == len(numbers) and len(set(gateway.WORDS)) == len(gateway.WORDS) == 64
    assert all(p.startswith(gateway.PREAMBLE + "Ticket ") for p in prompts)
    assert all(p.endswith(": " + gateway.QUESTION) for p in prompts)
    assert {len(p.split()) for p in prompts} == {len(prompts[0].split())}
    with pytest.raises(ValueError, match="out of range"):
        gateway.prompt(64**4)


def test_misses_cost_their_usage_and_hits_save_a_range_between_the_cached_and_the_input_rate(gateway):
    prices = gateway.Prices(input=0.5, cached_input=0.05, output=1.5)
    answered = [gateway.Answered(1.0, 0.01, "hit", 170, 170, 64),
                gateway.Answered(2.0, 0.02, "hit", 170, 170, 64),
                gateway.Answered(0.0, 0.3, "miss", 170, 128, 64)]
    rows, context = gateway.savings(answered, prices, 10.0)
    assert rows == [
        {"outcome": "hit", "requests": 2, "prompt_tokens": 340, "cached_tokens": 340, "completion_tokens": 128,
         "computed_tokens": 0, "cost_usd": 0.0, "saved_tokens": 468,
         "saved_usd": pytest.approx((340 * 0.5 + 128 * 1.5) / 1e6),
         "saved_usd_prompts_cached": pytest.approx((340 * 0.05 + 128 * 1.5) / 1e6)},
        {"outcome": "miss", "requests": 1, "prompt_tokens": 170, "cached_tokens": 128, "completion_tokens": 64,
         "computed_tokens": 42 + 64, "cost_usd": pytest.approx((42 * 0.5 + 128 * 0.05 + 64 * 1.5) / 1e6),
         "saved_tokens": 0, "saved_usd": 0.0, "saved_usd_prompts_cached": 0.0},
    ]
    assert context["prices_usd_per_million"] == {"input": 0.5, "cached_input": 0.05, "output": 1.5}
    assert context["requests"] == 3 and "illustrative" in context["prices_note"]


def test_a_gauge_is_summed_over_its_label_sets_and_nothing_else(gateway):
    metrics = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
               '# TYPE vllm:num_requests_running gauge\n'
               'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0\n'
               'vllm:num_requests_running{engine="1",model_name="tiny-llama"} 2.0\n'
               'vllm:num_requests_running_total 9.0\n'
               'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 4.0\n')
    assert gateway.gauge(metrics, "vllm:num_requests_running") == 5.0
    assert gateway.gauge(metrics, "vllm:num_requests_waiting") == 4.0
    assert gateway.gauge(metrics, "vllm:num_requests_swapped") == 0.0


def test_a_load_row_splits_latency_by_outcome_and_reads_the_resident_set_after_the_warm_up(gateway):
    load = gateway.Load(None, "http://127.0.0.1:1/v1/completions", 30.0, clients=2, rss_pid=1)
    load.answers = [gateway.Answered(float(i), 0.010 + i / 1000, "hit", 170, 170, 64) for i in range(5)]
    load.answers += [gateway.Answered(float(i), 2.0 + i, "miss", 170, 128, 64) for i in range(3)]
    load.errors = ["HTTP 502: b''"]
    load.rss = [(0.0, 100 * 2**20, 10), (5.0, 110 * 2**20, 12), (10.0, 120 * 2**20, 12),
                (31.0, 115 * 2**20, 12)]
    load.vllm_queue = [(8.0, 0.0), (6.0, 1.0)]
    load.elapsed, load.max_in_flight = 40.0, 2
    row = load.row("evocache")
    assert (row["requests"], row["errors"], row["ok"], row["outcomes"]) == (9, 1, 8, {"hit": 5, "miss": 3})
    assert row["throughput_rps"] == 8 / 40.0 and row["completion_tokens_per_s"] == 8 * 64 / 40.0
    assert row["hit_p50_ms"] == pytest.approx(12.0) and row["miss_p50_ms"] == pytest.approx(3000.0)
    assert (row["vllm_running_mean"], row["vllm_running_max"], row["vllm_waiting_max"]) == (7.0, 8.0, 1.0)
    assert row["rss"] == {"start_mb": 100.0, "warm_mb": 120.0, "end_mb": 115.0, "peak_mb": 120.0,
                          "processes": 12}
    assert "probe" not in row


def test_interleaved_rounds_rotate_the_sides_and_count_calls_per_side(monkeypatch):
    timing = load_bench_script("_timing", monkeypatch)
    calls: list[str] = []
    samples = timing.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2,
                                 {"a": 2, "b": 1})
    assert calls == ["a", "a", "b", "b", "a", "a"]
    assert {name: len(seen) for name, seen in samples.items()} == {"a": 4, "b": 2}
    row = timing.compared("x", "http", [0.002, 0.004], [0.001], "bare", None)
    assert (row["samples"], row["baseline_samples"], row["target_p50_ratio"]) == (2, 1, None)
    assert row["ratio_p50"] == pytest.approx(3.0)


def test_options_are_checked_and_the_prices_and_serve_arguments_parsed(gateway, capsys):
    args = gateway.options(["--parts", "c,a", "--price-output", "2",
                            "--serve-args", "--max-ongoing-requests 64"])
    assert args.parts == ["a", "c"] and args.duration == 60.0
    assert args.prices == gateway.Prices(0.5, 0.05, 2.0)
    assert args.serve_args == ["--max-ongoing-requests", "64"]
    assert gateway.options(["--quick"]).duration == 10.0
    for argv in (["--parts", "a,d"], ["--parts", ","], ["--duration", "0"], ["--price-cached", "-1"],
                 ["--serve-args", "'unclosed"]):
        with pytest.raises(SystemExit):
            gateway.options(argv)
    err = capsys.readouterr().err
    assert "unknown part(s) d" in err and "--price-cached must not be negative" in err


@pytest.mark.slow
def test_the_quick_bench_writes_its_four_result_files_and_the_report_renders_them(tmp_path, monkeypatch):
    results = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(BENCH / "gateway.py"), "--quick", "--results", str(results)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in results.iterdir()) == sorted(f"{part}.json" for part in PARTS)
    read = load_bench_script("_results", monkeypatch)
    loaded = {part: read.load(results / f"{part}.json") for part in PARTS}
    for result in loaded.values():
        assert result.command.endswith(f"bench/gateway.py --quick --results {results}")
        assert result.versions["vllm"] and result.versions["ray"]

    hit = loaded["gateway-hit"]
    assert [r["comparison"] for r in hit.rows] == ["hit_vs_echo", "hit_vs_vllm"]
    assert hit.context["serve_command"].startswith("evocache serve --upstream http://127.0.0.1:VLLM_PORT/v1 ")
    assert hit.context["completion_tokens"] == 64 and hit.context["tiers"] == {"l1": hit.rows[0]["samples"]}
    for row in hit.rows:
        assert 0 < row["evocache_p50_ms"] <= row["evocache_p99_ms"]
        assert row["ratio_p50"] == pytest.approx(row["evocache_p50_ms"] / row["baseline_p50_ms"])
    assert hit.rows[1]["baseline_p50_ms"] > hit.rows[0]["evocache_p50_ms"]  # 64 tokens computed, or a hit

    (miss,) = loaded["gateway-miss"].rows
    assert miss["samples"] == miss["baseline_samples"] == 3 * 2
    assert miss["evocache_prompt_tokens"] == miss["baseline_prompt_tokens"]
    assert miss["evocache_completion_tokens"] == miss["baseline_completion_tokens"] == [64]

    ours, theirs = loaded["gateway-load"].rows
    assert (ours["target"], theirs["target"]) == ("evocache", "vllm")
    assert ours["errors"] == theirs["errors"] == 0 and ours["clients"] == 32
    assert ours["outcomes"].get("hit", 0) > 0 and set(theirs["outcomes"]) == {"miss"}
    assert 0 < ours["rss"]["start_mb"] <= ours["rss"]["peak_mb"] and ours["rss"]["processes"] > 3
    assert ours["probe"]["samples"] > 0 and ours["hit_lookup"]["events"] >= ours["outcomes"]["hit"]

    savings = {r["outcome"]: r for r in loaded["gateway-savings"].rows}
    assert savings["hit"]["requests"] == ours["outcomes"]["hit"] and savings["hit"]["computed_tokens"] == 0
    hits = savings["hit"]
    assert hits["saved_tokens"] == hits["prompt_tokens"] + hits["completion_tokens"]

    report = load_bench_script("report", monkeypatch)
    for part, render in (("gateway-hit", report.gateway_hit), ("gateway-miss", report.gateway_miss),
                         ("gateway-load", report.gateway_load), ("gateway-savings", report.gateway_savings)):
        lines = render(loaded)
        assert f"Command: `{loaded[part].command}`" in lines
