"""The learned policy on synthetic traces unlike the Mooncake one (a sanity check that it learned an idea, not
a file): unit-size objects, no request context.

    .venv/bin/python bench/eviction_synthetic.py [--seed 0]

- ``zipf0.9``: 150,000 independent draws over 20,000 objects, Zipf(0.9) popularity (the independent
  reference model, where frequency matters and recency does not).
- ``hot+scans``: uniform draws over 2,000 hot objects, with every third stretch of 5,000 accesses a scan of
  never-repeated objects (what LRU handles worst).

Each at 200, 1,000 and 4,000 objects, for LRU, S3-FIFO and the learned policy (defaults).
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

from evocache.controller.eviction import make_eviction_policy
from evocache.controller.replay import Access, replay

POLICIES = ("lru", "s3fifo", "learned")
CAPACITIES = (200, 1000, 4000)


def zipf(rng: np.random.Generator, n: int = 150_000, objects: int = 20_000, a: float = 0.9) -> list[Access]:
    p = np.arange(1, objects + 1, dtype=float) ** -a
    keys = rng.choice(objects, size=n, p=p / p.sum())
    return [Access(float(i), str(k), 1) for i, k in enumerate(keys)]


def hot_and_scans(rng: np.random.Generator, n: int = 150_000, hot: int = 2_000, stretch: int = 5_000) -> list[Access]:
    draws = rng.choice(hot, size=n)
    out, scanned = [], 0
    for i in range(n):
        if (i // stretch) % 3 == 2:
            out.append(Access(float(i), f"scan{scanned}", 1))
            scanned += 1
        else:
            out.append(Access(float(i), str(int(draws[i])), 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print("trace      capacity  " + "  ".join(f"{p:>8}" for p in POLICIES))
    for name, trace in (("zipf0.9", zipf(rng)), ("hot+scans", hot_and_scans(rng))):
        for capacity in CAPACITIES:
            ratios = [replay(trace, functools.partial(make_eviction_policy, p), capacity_objects=capacity).hit_ratio
                      for p in POLICIES]
            print(f"{name:<10} {capacity:>8}  " + "  ".join(f"{r:8.4f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
