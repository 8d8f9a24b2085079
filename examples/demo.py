"""evocache demo: decorated model functions serve a real workload through L1 (memory) and L3 (disk).

    make demo        (or: .venv/bin/python examples/demo.py [--requests 4000] [--workdir .evocache/demo])

The workload is the Banking77 question stream shipped in examples/data (real customer questions; provenance in
examples/data/README.md), replayed the way a support assistant sees it: questions drawn with Zipf popularity
(popular questions come back again and again), three tenants (one on the free tier), and one call in ten sampling
at temperature 0.7. The "model" stands in for a hosted LLM (no GPU or network here): it costs about 2 ms per
call and answers from the question's intent. The policy is examples/policies/demo.yaml: its faq rule also serves
paraphrases semantically (the packaged MiniLM embedder, within a 2 % error bound), and the demo counts how many
of those answers were for another intent.

At the end it prints hits and misses per rule and tier, and where the access events went.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from evocache.controller import (
    DiskConfig,
    EmbedderConfig,
    EventsConfig,
    L1Config,
    SemanticConfig,
    StoreConfig,
    build_runtime,
    cache_if,
    configure,
    read_events,
    tenant_scope,
)
from evocache.dsl import load_policy

HERE = Path(__file__).resolve().parent
TENANTS = [("acme", "pro"), ("globex", "pro"), ("initech", "free")]


def load_stream(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def build_workload(rows: list[dict[str, str]], n: int, seed: int) -> list[tuple[str, str, float]]:
    """(prompt, tenant, temperature) per request: Zipf(1.1) popularity over the stream's questions."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(rows))]
    prompts = rng.choices([r["prompt"] for r in rows], weights=weights, k=n)
    return [(p, rng.choice(TENANTS)[0], 0.7 if rng.random() < 0.1 else 0.0) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a real question stream through evocache.")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--workdir", default=".evocache/demo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()

    workdir = Path(args.workdir)
    marker = workdir / ".evocache-demo"
    if workdir.exists() and any(workdir.iterdir()) and not marker.exists():
        raise SystemExit(f"{workdir} exists and was not made by this demo: choose another --workdir")
    shutil.rmtree(workdir, ignore_errors=True)  # a previous run's L3 and events: start from a cold cache
    workdir.mkdir(parents=True)
    marker.touch()
    events_path = workdir / "events.jsonl"
    policy = load_policy(HERE / "policies" / "demo.yaml")
    runtime = configure(
        build_runtime(
            StoreConfig(
                l1=L1Config(bytes=64 * 1024),  # small on purpose, so the demo shows evictions and L3 hits
                disk=DiskConfig(path=str(workdir / "l3")),
                events=EventsConfig(sink="jsonl", path=str(events_path)),
                # the packaged MiniLM embeds prompts for the faq rule's semantic matching
                semantic=SemanticConfig(embedder=EmbedderConfig(threads=1)),
            ),
            policy=policy,
        )
    )
    rows = load_stream(HERE / "data" / "banking77_train.jsonl")
    intent = {r["prompt"]: r["group"] for r in rows}

    @cache_if("len(prompt) <= 2000", model="banking-assistant", model_revision="2026-11",
              prompt_template="You are a helpful bank assistant.\n{prompt}")
    def answer(prompt: str, temperature: float = 0.0) -> str:
        time.sleep(0.002)  # the stand-in model's cost
        return truth(prompt)

    def truth(prompt: str) -> str:
        """The stand-in model's answer: one per intent, so paraphrases share it (and `==` is a fair judge)."""
        topic = intent.get(prompt, "unknown").replace("_", " ")
        return f"[{topic}] Here is how we can help."

    workload = build_workload(rows, args.requests, args.seed)
    tier_of = {name: tier for name, tier in TENANTS}
    started = time.perf_counter()
    with Progress(TextColumn("[bold]serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("requests", total=len(workload))
        wrong = 0
        for prompt, tenant, temperature in workload:
            with tenant_scope(tenant, tier=tier_of[tenant]):
                wrong += answer(prompt, temperature=temperature) != truth(prompt)  # a semantic hit of another intent
            progress.advance(task)
    elapsed = time.perf_counter() - started
    runtime.events.flush()

    counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    saved_ms = 0.0
    for event in read_events(events_path):
        if event.outcome in ("hit", "miss", "bypass"):
            outcome = "hit (semantic)" if event.reason == "semantic" else event.outcome
            counts[(event.rule, outcome, event.tier or "-")] += 1
            if event.outcome == "hit":
                saved_ms += event.saved_ms
    table = Table(title=f"{policy.ref}: {len(workload)} requests in {elapsed:.1f} s")
    for col in ("rule", "outcome", "tier", "requests"):
        table.add_column(col, justify="right" if col == "requests" else "left")
    for (rule, outcome, tier), n in sorted(counts.items()):
        table.add_row(rule, outcome, tier, str(n))
    console.print(table)
    info = answer.cache_info()
    looked_up = info.hits + info.misses
    console.print(
        f"hits {info.hits}, misses {info.misses}, bypasses {info.bypasses}, stored {info.stores}; "
        f"hit ratio {info.hits / max(looked_up, 1):.1%} of cacheable calls; model time saved {saved_ms / 1000:.1f} s"
    )
    semantic = sum(n for (_, outcome, _), n in counts.items() if outcome == "hit (semantic)")
    console.print(
        f"semantic hits {semantic} (answers to paraphrases, within the faq rule's 2 % error bound), "
        f"of which wrong {wrong}: {wrong / max(looked_up, 1):.2%} of cacheable calls"
    )
    l1, l3 = runtime.store.tiers["l1"], runtime.store.tiers["l3"]
    console.print(f"L1 holds {l1.usage()} bytes, L3 holds {l3.usage()} bytes")
    console.print(f"access events: {events_path.resolve()}")
    runtime.close()


if __name__ == "__main__":
    main()
