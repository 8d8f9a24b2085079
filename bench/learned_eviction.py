"""Experiment: the learned eviction policy against LRU and Belady on one trace, at several sizes.

    .venv/bin/python bench/learned_eviction.py [--trace FILE] [--sizes 0.01,0.05,0.1] [--opt key=value ...]

Prints, per size, hit ratios, the share of the LRU -> Belady gap closed, the policy's counters and the
replay's wall time. ``--opt`` passes options of the learned policy (one configuration for all sizes): a field
of ``LearnedTraining`` (``retrain_every=300``) goes into its ``training``, ``policy=learned-rank`` picks the
ranking policy, any other is the policy's own keyword. Trace format as `evocache bench eviction` reads it
(``--format``, ``--csv-columns``).
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import fields

from evocache.controller.eviction import LearnedBase, LearnedTraining, make_eviction_policy
from evocache.controller.replay import CsvColumns, belady_unit, read_trace, replay, working_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="bench/data/mooncake_synthetic_trace.jsonl")
    parser.add_argument("--format", default="auto")
    parser.add_argument("--csv-columns", default=None, help="time=...,id=...,size=... (csv traces)")
    parser.add_argument("--sizes", default="0.01,0.05,0.1")
    parser.add_argument("--unit", default="objects", choices=("objects", "bytes"))
    parser.add_argument("--seed", type=int, default=0, help="the replay's rng seed (the policy's sampling)")
    parser.add_argument("--opt", action="append", default=[], help="learned policy option, key=value")
    parser.add_argument("--train-speed", type=int, default=0, metavar="N",
                        help="instead: time one training on N samples collected by replaying the trace")
    args = parser.parse_args()
    columns = CsvColumns(**dict(p.split("=") for p in args.csv_columns.split(","))) if args.csv_columns else None
    trace = list(read_trace(args.trace, args.format, csv_columns=columns))
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.opt)}
    ws = working_set(trace)
    if args.train_speed:
        _train_speed(trace, args.train_speed, options, ws.objects)
        return
    for size in (float(s) for s in args.sizes.split(",")):
        capacity = max(1, int(size * (ws.objects if args.unit == "objects" else ws.bytes)))
        cap = {"capacity_objects": capacity} if args.unit == "objects" else {"capacity_bytes": capacity}
        lru = replay(trace, "lru", **cap).hit_ratio
        best = belady_unit(trace, capacity).hit_ratio if args.unit == "objects" else float("nan")
        policies = []
        factory = functools.partial(_build, policies, capacity, options)
        start = time.perf_counter()
        learned = replay(trace, factory, seed=args.seed, **cap).hit_ratio
        wall = time.perf_counter() - start
        gap = (learned - lru) / (best - lru) if best == best and best > lru else float("nan")
        print(f"size {size}: cap {capacity} lru {lru:.4f} learned {learned:.4f} belady {best:.4f} "
              f"gap {100 * gap:+.1f}% {policies[0].stats} {wall:.1f}s", flush=True)


def _train_speed(trace: list, n: int, options: dict, objects: int) -> None:
    """Replay the trace (repeated, shifted in time, until it yields ``n`` samples) at 5 % without training,
    then time one training on the latest ``n`` samples, as the policy would run it."""
    from evocache.controller.eviction._history import targets
    from evocache.controller.eviction._model import TrainingWindow, train

    span = trace[-1].t - trace[0].t + 1
    rounds = -(-n // len(trace)) + 1
    long = [a._replace(t=a.t + r * span, req=a.req + r * 10**7) for r in range(rounds) for a in trace]
    built: list[LearnedBase] = []
    replay(long, functools.partial(_build, built, objects // 20, {**options, "window": n, "retrain_every": 10**9}),
           capacity_objects=objects // 20)
    policy = built[0]
    rows, distances, horizons, first, last = policy._samples.training_set(policy._tick)
    labels = targets(distances, horizons, policy.target)
    start = time.perf_counter()
    t = policy.training
    objective = "reg:squarederror" if policy.target == "distance" else "binary:logistic"
    train(policy._select(rows), labels, features=policy.features, objective=objective,
          window=TrainingWindow(first, last, 0, len(labels), 0), rounds=t.rounds, depth=t.depth, threads=t.threads)
    print(f"trained on {len(labels)} samples ({int((distances <= horizons).sum())} reused), {t.rounds} rounds of depth "
          f"{t.depth}, {t.threads} thread(s): {time.perf_counter() - start:.2f}s")


_TRAINING = {f.name for f in fields(LearnedTraining)}


def _build(out: list, capacity: int, options: dict, **kw) -> LearnedBase:
    rest = {k: v for k, v in options.items() if k not in _TRAINING}
    training = LearnedTraining(**{k: v for k, v in options.items() if k in _TRAINING})
    policy = make_eviction_policy(rest.pop("policy", "learned"), capacity=capacity, training=training, **rest, **kw)
    out.append(policy)
    return policy


def _value(text: str):
    if "+" in text:  # a list: features=edc16384+count+age
        return tuple(text.split("+"))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
