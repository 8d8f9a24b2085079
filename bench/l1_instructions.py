"""Instructions per L1 hit, `@cache_if` against `cachetools.cached`, counted by callgrind: noise-free.

    .venv/bin/python bench/l1_instructions.py [--hits 20000]

Wall-clock ratios on a shared machine move by 5-15 % between runs (bench/overhead.py). Instruction counts do
not: callgrind counts what the process executes, whatever else the machine does. Each side runs twice under
callgrind, once with no hits and once with ``--hits`` hits, and the difference divided by the hits is the cost
of one hit (start-up, imports and the first miss cancel out). Needs valgrind (Debian: apt-get install valgrind).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOAD = r'''
import sys
import cachetools
from evocache.controller import StoreConfig, build_runtime, cache_if

ANSWER = "x" * 1000
PROMPT = "What is the exchange rate " * 10

def model(prompt: str, temperature: float = 0.0, top_k: int = 0) -> str:
    return ANSWER

side, hits = sys.argv[1], int(sys.argv[2])
if side == "evocache":
    f = cache_if("len(prompt) <= 4096 and top_k <= 10", model="m", store=build_runtime(StoreConfig()))(model)
else:
    f = cachetools.cached(cachetools.LRUCache(maxsize=1024))(model)
f(PROMPT, 0.0, 5)
for _ in range(hits):
    f(PROMPT, 0.0, 5)
'''


def instructions(script: Path, side: str, hits: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, str(script), side,
             str(hits)],
            capture_output=True, text=True, check=True,
            # A fixed hash seed: start-up (imports) must cost the same in both runs for the difference to be
            # the hits alone.
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    match = re.search(r"Collected : (\d+)", done.stderr)
    assert match, done.stderr[-2000:]
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hits", type=int, default=20_000)
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("needs valgrind (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(WORKLOAD)
        per_hit = {
            side: (instructions(script, side, args.hits) - instructions(script, side, 0)) / args.hits
            for side in ("evocache", "cachetools")
        }
    print(f"instructions per L1 hit: evocache {per_hit['evocache']:,.0f}, cachetools {per_hit['cachetools']:,.0f}, "
          f"ratio {per_hit['evocache'] / per_hit['cachetools']:.2f}")


if __name__ == "__main__":
    main()
