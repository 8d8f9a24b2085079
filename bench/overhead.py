"""Per-call cost of evocache's cache paths against the plain alternatives, run side by side.

    make bench            (or: .venv/bin/python bench/overhead.py [--rounds 21] [--json out.json]
                                                              [--results DIR])

Three ratios, each the median over interleaved rounds (this machine is shared and noisy; the two sides of a ratio
always run back to back in the same process):

1. L1 hit through ``@cache_if`` against a ``cachetools.cached`` hit on the same function and arguments.
2. L2 hit through ``@cache_if`` (a store with Redis only) against a raw redis-py GET of the same payload.
3. The miss path of ``@cache_if`` (every call new arguments: plan, lookup, call, store, events) against calling
   the same 1 ms function bare.

Targets: ratio 1 <= 3.0, ratio 2 <= 1.2, ratio 3 <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cachetools
import redis

from evocache.controller import RedisConfig, StoreConfig, build_runtime, cache_if

PROMPT = "What is the exchange rate for a transfer from EUR to GBP today, and is there a fee? " * 4
ANSWER = "The rate is shown in the app before you confirm; transfers between your own accounts are free. " * 10


def per_call(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def ratio(candidate: Callable[[], object], baseline: Callable[[], object], n: int, rounds: int) -> dict:
    """Median per-call seconds of both sides over interleaved rounds, and the ratio of the medians."""
    cand, base = [], []
    for _ in range(rounds):
        base.append(per_call(baseline, n))
        cand.append(per_call(candidate, n))
    c, b = statistics.median(cand), statistics.median(base)
    return {"candidate_us": c * 1e6, "baseline_us": b * 1e6, "ratio": c / b}


def l1_hit(rounds: int) -> dict:
    runtime = build_runtime(StoreConfig())

    def model(prompt: str, temperature: float = 0.0, top_k: int = 0) -> str:
        return ANSWER

    ours = cache_if("len(prompt) <= 4096 and top_k <= 10", model="m", store=runtime)(model)
    theirs = cachetools.cached(cachetools.LRUCache(maxsize=1024))(model)
    ours(PROMPT, 0.0, 5)
    theirs(PROMPT, 0.0, 5)
    assert ours.cache_info().hits == 0
    out = ratio(lambda: ours(PROMPT, 0.0, 5), lambda: theirs(PROMPT, 0.0, 5), 20_000, rounds)
    assert ours.cache_info().hits > 0 and ours.cache_info().misses == 1
    runtime.close()
    return out


class _Redis:
    """The Redis that EVOCACHE_REDIS_URL names, else a throwaway redis-server on a free loopback port."""

    def __enter__(self) -> str:
        self.server = None
        if os.environ.get("EVOCACHE_REDIS_URL"):
            return os.environ["EVOCACHE_REDIS_URL"]
        # The repository has one redis-server launcher, the test suite's (tests/_redis_server.py); benches run
        # from a source checkout like the tests, so they import it from there.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from _redis_server import RedisServer

        try:
            self.server = RedisServer().start()
        except FileNotFoundError as exc:
            sys.exit(f"bench needs redis-server or EVOCACHE_REDIS_URL: {exc}")
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()


def l2_hit(url: str, rounds: int) -> dict:
    # A secret of its own: the bench's server is its own, and no key file is written for it.
    secret = os.urandom(24).hex()
    runtime = build_runtime(StoreConfig(redis=RedisConfig(url=url, timeout_s=1.0, secret=secret)))

    def model(prompt: str, temperature: float = 0.0) -> str:
        return ANSWER

    ours = cache_if("len(prompt) <= 4096", model="m", admission={"tiers": ["l2"]}, store=runtime)(model)
    ours(PROMPT)
    client = redis.Redis.from_url(url)
    client.set("bench:raw", ANSWER.encode())
    out = ratio(lambda: ours(PROMPT), lambda: client.get("bench:raw"), 2_000, rounds)
    assert ours.cache_info().misses == 1 and ours.cache_info().hits > 0
    client.close()
    runtime.close()
    return out


def miss_path(rounds: int) -> dict:
    runtime = build_runtime(StoreConfig())
    counter = iter(range(10**9))

    def model(prompt: str, temperature: float = 0.0) -> str:
        # 1 ms of busy work rather than time.sleep: a sleep wakes up 50-100 µs late at random, which would
        # swamp the overhead being measured.
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        return ANSWER

    ours = cache_if("len(prompt) <= 4096", model="m", store=runtime)(model)
    out = ratio(lambda: ours(f"{PROMPT} #{next(counter)}"), lambda: model(f"{PROMPT} #{next(counter)}"), 200, rounds)
    assert ours.cache_info().hits == 0
    runtime.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="write the result file overhead.json here, for bench/report.py (make bench passes "
                             "bench/results)")
    args = parser.parse_args()

    results = {"l1_hit_vs_cachetools": l1_hit(args.rounds)}
    with _Redis() as url:
        results["l2_hit_vs_redis_get"] = l2_hit(url, args.rounds)
    results["miss_path_vs_bare_1ms"] = miss_path(max(args.rounds // 3, 5))
    targets = {"l1_hit_vs_cachetools": 3.0, "l2_hit_vs_redis_get": 1.2, "miss_path_vs_bare_1ms": 1.05}

    from rich.console import Console
    from rich.table import Table

    table = Table(title="evocache per-call overhead (median of interleaved rounds)")
    for col in ("comparison", "evocache µs", "baseline µs", "ratio", "target"):
        table.add_column(col, justify="right" if col != "comparison" else "left")
    for name, r in results.items():
        ok = r["ratio"] <= targets[name]
        table.add_row(name, f"{r['candidate_us']:.2f}", f"{r['baseline_us']:.2f}",
                      f"[{'green' if ok else 'red'}]{r['ratio']:.3f}[/]", f"≤ {targets[name]}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "targets": targets}, fh, indent=2)
    if args.results is not None:
        from _results import command_line, write  # bench/_results.py: this script's directory is on sys.path

        rows = [{"comparison": name, **r, "target": targets[name]} for name, r in results.items()]
        path = write(args.results, "overhead", rows, command=command_line(), context={"rounds": args.rounds})
        print(f"(written to {path})")


if __name__ == "__main__":
    main()
