"""The eviction figures, each printed with the command that reproduces it.

    .venv/bin/python bench/eviction.py [--trace FILE] [--cloudphysics FILE] [--sizes 0.01,0.05,0.1]
                                       [--rounds 5] [--parts abcde] [--out DIR] [--results DIR]

(a) Policy x size table on the Mooncake trace: every registered eviction policy, Belady, and libCacheSim's
    online algorithms when ``libcachesim`` is installed (``evocache bench eviction --peers``); then the learned
    policy again with ``--output-lengths`` (each request's output length, learned at its completion).
(b) cloudPhysicsIO.csv, learned against LRU (bytes), with the libCacheSim rows for context. The file is
    GPL-3.0 data, so it is read from ../shared/data/traces/ and never copied here; without it (b) is skipped
    with a message.
(c) LRU replay throughput, in accesses per minute, against a plain ``OrderedDict`` LRU loop over the same
    accesses in the same process (median of ``--rounds`` interleaved rounds; both must hit alike).
(d) Per-request production cost of each policy: its ``on_*``/``victim``/``admit`` calls as the real L1
    ``MemoryTier`` makes them on the request path (``peek``, then ``get_many``, then ``set_many`` on a miss),
    timed inside the calls, and the process CPU time of the whole run (background training threads
    included), each next to LRU's as a ratio.
(e) Queue look-ahead on the Mooncake trace: ``lookahead`` (over LRU) and ``lookahead:learned`` told the
    requests waiting in an honest FIFO queue at utilisation 0.5, 0.8 and 0.95, the learned base with and
    without each request's output length.

Rows that need the ``learned`` policy are skipped with a message while it is not registered. (a), (b) and (e)
run the `evocache` command itself, so the published figures are exactly what a user gets. ``--parts`` runs some
of the figures only (``--parts cd``: the two timings). Everything written (JSON of each part, the plot) goes to
``--out``; with ``--results DIR`` also one result file per part for bench/report.py (bench/_results.py; ``make
bench-eviction`` passes ``bench/results``): eviction-mooncake, eviction-mooncake-output-lengths,
eviction-cloudphysics, eviction-throughput, eviction-cost and eviction-lookahead.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from evocache.controller import Entry, MemoryTier
from evocache.controller.eviction import (
    EVICTION_POLICIES,
    EntryInfo,
    EvictionPolicy,
    LRUPolicy,
    make_eviction_policy,
)
from evocache.controller.replay import Access, read_trace, replay, working_set

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "bench" / "data" / "mooncake_synthetic_trace.jsonl"
CLOUDPHYSICS = ROOT.parent / "shared" / "data" / "traces" / "cloudPhysicsIO.csv"
LEARNED = "learned"
# The ranking variant of the learned policy trains a regressor per window (about 25 s per size on this trace):
# `evocache bench eviction --policies lru,learned,learned-rank` adds it to a table.
OPTIONAL = frozenset({"learned-rank"})
POLICIES = [name for name in EVICTION_POLICIES if name not in OPTIONAL]
COST_SIZE = 0.05  # (d) runs at one size: the middle of the three published
UTILISATIONS = (0.5, 0.8, 0.95)  # (e): a mostly empty queue, a busy server, one near saturation
VALUE = b"v" * 224  # (d): every entry weighs 256 bytes with its 32-character key


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=MOONCAKE, help="Mooncake-style trace for (a), (c), (d).")
    parser.add_argument("--cloudphysics", type=Path, default=CLOUDPHYSICS, help="CSV trace for (b).")
    parser.add_argument("--sizes", default="0.01,0.05,0.1", help="Cache sizes of (a) and (b).")
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds of (c).")
    parser.add_argument("--parts", default="".join(PARTS), help="Which figures to run, e.g. 'cd' (default: all).")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench-eviction")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="Also write one result file per part here, for bench/report.py (make bench-eviction "
                             "passes bench/results).")
    args = parser.parse_args(argv)
    unknown = set(args.parts) - set(PARTS)
    if unknown or not args.parts:
        parser.error(f"--parts: expected letters of {''.join(PARTS)}, got {args.parts!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
    for letter in PARTS:
        if letter in args.parts:
            PARTS[letter](args)
    return 0


def table(args: argparse.Namespace) -> None:
    heading("(a) policy x size on " + args.trace.name)
    plot = ["--plot", str(args.out / "mooncake.png")] if _importable("matplotlib") else []
    if LEARNED not in EVICTION_POLICIES:
        print(f"the {LEARNED!r} policy is not registered yet: its row is missing")
    command = ["--trace", str(args.trace), "--sizes", args.sizes, "--policies", ",".join(POLICIES),
               *_peers(), *plot, "--json", str(args.out / "mooncake.json")]
    bench_command(command)
    record(args, "eviction-mooncake", command)
    if LEARNED in EVICTION_POLICIES:
        print("\nthe learned policy told each request's output length at its completion:")
        command = ["--trace", str(args.trace), "--sizes", args.sizes, "--policies", f"lru,{LEARNED}",
                   "--output-lengths", "--json", str(args.out / "mooncake_output_lengths.json")]
        bench_command(command)
        record(args, "eviction-mooncake-output-lengths", command)


def cloudphysics(args: argparse.Namespace) -> None:
    heading("(b) learned against LRU on " + args.cloudphysics.name)
    if not args.cloudphysics.is_file():
        print(f"skipped: {args.cloudphysics} is not here (GPL-3.0 data: read from ../shared, never copied)")
    elif LEARNED not in EVICTION_POLICIES:
        print(f"skipped: the {LEARNED!r} policy is not registered yet")
    else:
        command = ["--trace", str(args.cloudphysics), "--csv-columns", "id=lbn", "--sizes", args.sizes,
                   "--policies", f"lru,{LEARNED}", *_peers(), "--json", str(args.out / "cloudphysics.json")]
        bench_command(command)
        record(args, "eviction-cloudphysics", command)


def replay_speed(args: argparse.Namespace) -> None:
    trace, capacity = _cost_trace(args.trace)
    heading(f"(c) LRU replay throughput ({len(trace):,} accesses, capacity {capacity} objects)")
    speed = throughput(trace, capacity, args.rounds)
    print(f"evocache replay(lru): {speed['replay_per_min'] / 1e6:.2f} M accesses/min "
          f"(median of {args.rounds}, {speed['replay_s']:.3f} s a pass)")
    print(f"OrderedDict LRU loop: {speed['baseline_per_min'] / 1e6:.2f} M accesses/min "
          f"({speed['baseline_s']:.3f} s a pass)")
    print(f"ratio: replay takes {speed['ratio']:.2f}x the plain loop's time (target: >= 1 M accesses/min)")
    write(args.out / "throughput.json", speed)
    if args.results is not None:
        _result(args.results, "eviction-throughput", [speed], command=_script_command(args, "c"),
                context={"trace": _results_module().shown(str(args.trace))})


def policy_cost(args: argparse.Namespace) -> None:
    trace, capacity = _cost_trace(args.trace)
    heading(f"(d) per-request cost through the L1 MemoryTier ({COST_SIZE:.0%} of the objects)")
    if LEARNED not in EVICTION_POLICIES:
        print(f"the {LEARNED!r} policy is not registered yet: its row is missing")
    costs = production_costs(trace, capacity)
    print_costs(costs)
    write(args.out / "cost.json", costs)
    if args.results is not None:
        rows = [{"policy": name, **row} for name, row in costs["policies"].items()]
        context = {k: v for k, v in costs.items() if k != "policies"}
        _result(args.results, "eviction-cost", rows, command=_script_command(args, "d"),
                context={"trace": _results_module().shown(str(args.trace)), **context})


def lookahead(args: argparse.Namespace) -> None:
    heading("(e) queue look-ahead on " + args.trace.name)
    if LEARNED not in EVICTION_POLICIES:
        print(f"skipped: the {LEARNED!r} policy is not registered yet")
        return
    runs = []
    for utilisation in UTILISATIONS:
        for told in (False, True):
            name = f"lookahead_u{utilisation:g}" + ("_output_lengths" if told else "")
            policies = f"lru,lookahead:{LEARNED}" if told else f"lru,lookahead,lookahead:{LEARNED}"
            command = ["--trace", str(args.trace), "--sizes", args.sizes, "--policies", policies,
                       "--utilisation", f"{utilisation:g}", *(["--output-lengths"] if told else []),
                       "--json", str(args.out / f"{name}.json")]
            print()
            bench_command(command)
            runs.append((command, json.loads((args.out / f"{name}.json").read_text(encoding="utf-8"))))
    if args.results is not None:
        results = _results_module()
        rows = [{**row, "utilisation": report["queue"]["utilisation"],
                 "output_lengths": report.get("output_lengths", False)}
                for _, report in runs for row in report["rows"]]
        first = runs[0][1]
        context = {"trace": results.shown(first["trace"]), "requests": first["requests"],
                   "objects": first["objects"], "unit": first["unit"],
                   "queues": [report["queue"] for _, report in runs[::2]],
                   "commands": [results.command_line(command, program=["evocache", "bench", "eviction"])
                                for command, _ in runs]}
        _result(args.results, "eviction-lookahead", rows, command=_script_command(args, "e"), context=context)


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {
    "a": table, "b": cloudphysics, "c": replay_speed, "d": policy_cost, "e": lookahead}


def _results_module() -> ModuleType:
    import _results  # bench/_results.py: this script's directory is on sys.path

    return _results


def record(args: argparse.Namespace, part: str, command: list[str]) -> None:
    """With ``--results``: the JSON that `evocache bench eviction` wrote (its ``--json``) as the result file
    ``part``, under the command that reproduces it."""
    if args.results is None:
        return
    report = json.loads(Path(command[command.index("--json") + 1]).read_text(encoding="utf-8"))
    results = _results_module()
    context = {k: v for k, v in report.items() if k != "rows"}
    context["trace"] = results.shown(context["trace"])
    _result(args.results, part, report["rows"], context=context,
            command=results.command_line(command, program=["evocache", "bench", "eviction"]))


def _script_command(args: argparse.Namespace, part: str) -> str:
    """This script's command line for one part: its options as given, ``--parts`` narrowed to ``part``."""
    argv = sys.argv[1:]
    kept = [a for i, a in enumerate(argv) if not (a == "--parts" or a.startswith("--parts=")
                                                   or (i > 0 and argv[i - 1] == "--parts"))]
    return _results_module().command_line([*kept, "--parts", part])


def _result(results: Path, part: str, rows: list[dict[str, Any]], *, command: str,
            context: dict[str, Any]) -> None:
    print(f"(result file {_results_module().write(results, part, rows, command=command, context=context)})")


def _peers() -> list[str]:
    if _importable("libcachesim"):
        return ["--peers"]
    print("libCacheSim rows skipped: libcachesim is not installed (pip install 'evocache[peers]')")
    return []


@functools.cache
def _cost_trace(path: Path) -> tuple[list[Access], int]:
    """The trace of (c) and (d), read once, and their one capacity in objects."""
    trace = list(read_trace(path))
    return trace, max(1, math.floor(COST_SIZE * working_set(trace).objects))


def heading(text: str) -> None:
    print(f"\n== {text}", flush=True)


def write(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"(written to {path})")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def bench_command(args: list[str]) -> None:
    """Run `evocache bench eviction ARGS` as a user would, its table on our stdout. Raises on failure."""
    print("$ evocache bench eviction " + " ".join(args), flush=True)
    command = [sys.executable, "-c", "from evocache.cli.app import main; main()", "bench", "eviction", *args]
    subprocess.run(command, check=True)


# -- (c) replay throughput -----------------------------------------------------------------------------------

def lru_loop(trace: Sequence[Access], capacity: int) -> int:
    """The plainest LRU over ``trace`` in objects, cache-on-miss, keyed like ``replay``: the hits."""
    cache: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
    move, pop = cache.move_to_end, cache.popitem
    hits = 0
    for a in trace:
        k = (a.ns, a.key) if a.ns else a.key
        if k in cache:
            move(k)
            hits += 1
        else:
            cache[k] = None
            if len(cache) > capacity:
                pop(last=False)
    return hits


def throughput(trace: list[Access], capacity: int, rounds: int) -> dict[str, float]:
    replay_s, baseline_s = [], []
    for _ in range(rounds):  # interleaved: a noisy neighbour slows both sides alike
        t0 = time.perf_counter()
        baseline_hits = lru_loop(trace, capacity)
        t1 = time.perf_counter()
        replay_hits = replay(trace, "lru", capacity_objects=capacity).hits
        t2 = time.perf_counter()
        # Not a timing: the two must do the same work, or the ratio means nothing.
        assert replay_hits == baseline_hits, (replay_hits, baseline_hits)
        baseline_s.append(t1 - t0)
        replay_s.append(t2 - t1)
    r, b = statistics.median(replay_s), statistics.median(baseline_s)
    return {"accesses": len(trace), "capacity_objects": capacity, "rounds": rounds, "replay_s": r,
            "baseline_s": b, "replay_per_min": len(trace) / r * 60, "baseline_per_min": len(trace) / b * 60,
            "ratio": r / b}


# -- (d) production cost ----------------------------------------------------------------------------------

class TimedPolicy(EvictionPolicy):
    """``inner``, with the time spent inside each of its methods added up (``ns``) and its calls counted."""

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(clock=inner.clock, rng=inner.rng)
        self.inner = inner
        self.name = inner.name
        self.uses_context = inner.uses_context  # type: ignore[misc]  # the owner reads it per instance
        self.ns = 0
        self.calls = 0

    def _timed(self, method: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return method(*args)
        finally:
            self.ns += time.perf_counter_ns() - t0
            self.calls += 1

    def on_insert(self, key: Hashable, info: EntryInfo) -> None:
        self._timed(self.inner.on_insert, key, info)

    def on_hit(self, key: Hashable) -> None:
        self._timed(self.inner.on_hit, key)

    def on_hits(self, keys: Sequence[Hashable]) -> None:
        self._timed(self.inner.on_hits, keys)

    def on_access(self, key: Hashable, info: EntryInfo) -> None:
        self._timed(self.inner.on_access, key, info)

    def admit(self, key: Hashable, info: EntryInfo) -> bool:
        return self._timed(self.inner.admit, key, info)

    def on_remove(self, key: Hashable) -> None:
        self._timed(self.inner.on_remove, key)

    def victim(self, ns: str | None = None) -> Hashable:
        return self._timed(self.inner.victim, ns)

    def __len__(self) -> int:
        return len(self.inner)


def _timer_ns(n: int = 200_000) -> float:
    """What ``TimedPolicy`` measures for a call to a function that does nothing: the timer's own cost (and a
    bare call's), subtracted from every call it timed."""
    timed = TimedPolicy(LRUPolicy())
    nothing = _nothing
    for _ in range(n):
        timed._timed(nothing)
    return timed.ns / n


def _nothing() -> None:
    pass


def production_costs(trace: list[Access], capacity_objects: int) -> dict[str, Any]:
    """Each registered policy driven by a real ``MemoryTier`` over ``trace`` on the trace's clock; LRU first."""
    names = ["lru", *(name for name in POLICIES if name != "lru")]
    timer_ns = _timer_ns()
    rows = {name: drive(trace, name, capacity_objects, timer_ns) for name in names}
    lru = rows["lru"]
    for row in rows.values():
        row["policy_ratio"] = row["policy_us"] / lru["policy_us"]
        row["cpu_ratio"] = row["cpu_us"] / lru["cpu_us"]
    return {"accesses": len(trace), "capacity_bytes": capacity_objects * (32 + len(VALUE)),
            "timer_ns_subtracted": timer_ns, "policies": rows}


def drive(trace: list[Access], name: str, capacity_objects: int, timer_ns: float) -> dict[str, Any]:
    """One pass of the request path's L1 calls: ``peek``; on ``None`` ``get_many``; on a miss ``set_many``.

    Keys become 32-hex-digit digests (what the tier accepts), numbered by first access; a trace without
    namespaces runs in one namespace. A policy that can train on a background thread does so, as in production,
    and the CPU time of all the process's threads is counted.
    """
    now = 0.0

    def clock() -> float:
        return now

    capacity = capacity_objects * (32 + len(VALUE))
    # background=True as on the request path: a learned policy trains on its own thread; the others ignore it.
    policy = TimedPolicy(make_eviction_policy(name, capacity=capacity, background=True, clock=clock))
    tier = MemoryTier(capacity, policy=policy, clock=clock)
    digests: dict[Hashable, str] = {}
    requests = [(a.t, a.ns or "bench", digests.setdefault((a.ns, a.key), f"{len(digests):032x}")) for a in trace]
    peek, get_many, set_many = tier.peek, tier.get_many, tier.set_many
    hits = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for t, ns, key in requests:
        now = t
        if peek((ns, key), t) is not None:
            hits += 1
        elif get_many(ns, [key])[0] is not None:
            hits += 1
        else:
            set_many(ns, [(key, Entry(VALUE, None, t))])
    policy.inner.close()  # joins a background trainer: its work is part of the cost
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = len(requests)
    policy_ns = max(0.0, policy.ns - policy.calls * timer_ns)
    return {"hit_ratio": hits / n, "policy_calls": policy.calls, "policy_us": policy_ns / n / 1e3,
            "cpu_us": cpu / n * 1e6, "wall_us": wall / n * 1e6}


def print_costs(costs: dict[str, Any]) -> None:
    print(f"{'policy':<10} {'in policy us/req':>17} {'x LRU':>7} {'CPU us/req':>11} {'x LRU':>7} "
          f"{'calls/req':>10} {'hit ratio':>10}")
    n = costs["accesses"]
    for name, row in costs["policies"].items():
        print(f"{name:<10} {row['policy_us']:>17.2f} {row['policy_ratio']:>7.2f} {row['cpu_us']:>11.2f} "
              f"{row['cpu_ratio']:>7.2f} {row['policy_calls'] / n:>10.2f} {row['hit_ratio']:>10.3f}")
    print(f"in policy: time inside the policy's methods, less {costs['timer_ns_subtracted']:.0f} ns a call for "
          "the timer; CPU: the whole request path's L1 calls (tier and policy), all threads")


if __name__ == "__main__":
    sys.exit(main())
