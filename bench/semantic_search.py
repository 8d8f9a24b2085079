"""Semantic lookup latency: the scoped vector index alone at 100 k entries, and end-to-end with the real model.

    .venv/bin/python bench/semantic_search.py [--n 100000] [--queries 1000] [--real FILE.jsonl ...]
                                              [--e2e] [--threads 8] [--json OUT]

1. Search alone: ``VectorIndex`` (defaults: exact up to 10 k, then HNSW M=32, efConstruction=80, efSearch=64)
   over ``--n`` random unit vectors of dimension 384; one query per call, as on the request path; p50/p95/p99
   and recall@1 against exact search, for "near" queries (a stored vector moved to cosine ~0.9 of it: a
   paraphrase) and "far" ones (fresh random vectors: nothing close, the HNSW worst case). The target is
   p50 <= 1 ms at 100 k.
2. ``--real FILE ...``: the same over the real embeddings of the prompts of semantic streams
   (../shared/data/semantic/*.jsonl), indexed except the last ``--queries``, which are the queries.
   Embeddings are cached under .evocache/embeddings (keyed by model name and texts), as bench/semantic.py does.
3. ``--redis URL``: sharing through Redis: the time a new replica takes to load ``--shared-n`` entries from
   Redis (``SharedIndex`` rebuild), and how long an add on one replica takes to be found on another that
   follows the stream (p50/p95 over ``--follow-adds`` adds). Uses the prefix ``evc-sem-bench`` and deletes it.
4. ``--e2e``: end-to-end semantic lookup (embedding with the packaged all-MiniLM-L6-v2 on CPU + search), one
   prompt at a time, and ``--threads`` concurrent callers sharing one ``BatchingEmbedder``.

faiss runs its searches with ``--search-threads`` OpenMP threads (default 1: one query per request; extra
threads only spin against the other requests on a busy machine) and its index builds with all cores.
Latencies are wall-clock on this machine, whatever else runs on it: the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from evocache.controller.semantic import (
    BatchingEmbedder,
    Scope,
    SemanticIndex,
    SentenceTransformerEmbedder,
    SharedIndex,
    VectorIndex,
)
from evocache.controller.semantic._bench import embed_cached

DIM = 384
CACHE = Path(".evocache/embeddings")  # the same cache bench/semantic.py reads and writes
SCOPE = Scope("bench", "fn=bench|model=m|rev=1|params=0|emb=st:all-MiniLM-L6-v2")


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def near(vecs: np.ndarray, cosine: float, rng: np.random.Generator) -> np.ndarray:
    """Each row moved to the given cosine similarity of itself, in a random direction."""
    noise = rng.standard_normal(vecs.shape).astype(np.float32)
    noise -= (noise * vecs).sum(axis=1, keepdims=True) * vecs  # orthogonal to the row
    noise = unit(noise)
    return unit(cosine * vecs + np.sqrt(1 - cosine**2) * noise)


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ms = np.array(samples_ns) / 1e6
    return {f"p{q}_ms": round(float(np.percentile(ms, q)), 4) for q in (50, 95, 99)}


def time_searches(index: VectorIndex, queries: np.ndarray, k: int) -> tuple[dict[str, float], list[str]]:
    lat, top = [], []
    for q in queries:
        row = q[None, :]
        t0 = time.perf_counter_ns()
        found = index.search(row, k)
        lat.append(time.perf_counter_ns() - t0)
        top.append(found[0][0].entry_id if found[0] else "")
    return percentiles(lat), top


def search_alone(vecs: np.ndarray, queries: dict[str, np.ndarray], k: int, search_threads: int) -> dict:
    import faiss

    ids = [f"e{i}" for i in range(len(vecs))]
    index = VectorIndex(vecs.shape[1])
    t0 = time.perf_counter()
    index.add(ids, vecs)
    index.wait_rebuilt()
    build_s = time.perf_counter() - t0
    exact = faiss.IndexFlatIP(vecs.shape[1])
    exact.add(vecs)
    out = {"n": len(vecs), "kind": index.kind, "build_s": round(build_s, 1)}
    faiss.omp_set_num_threads(search_threads)
    try:
        for name, q in queries.items():
            stats, top = time_searches(index, q, k)
            _, truth = exact.search(q, 1)
            recall = float(np.mean([t == f"e{j}" for t, j in zip(top, truth[:, 0], strict=True)]))
            out[name] = {**stats, "recall_at_1": round(recall, 4), "queries": len(q)}
    finally:
        faiss.omp_set_num_threads(os.cpu_count() or 1)
    return out


def prompts_of(paths: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    seen.setdefault(json.loads(line)["prompt"])
    return list(seen)


def shared(url: str, vecs: np.ndarray, adds: int) -> dict:
    """Load time of a new replica over ``len(vecs)`` entries in Redis, and add-to-visible latency on a follower."""
    import redis

    prefix = "evc-sem-bench"
    admin = redis.Redis.from_url(url)
    for key in admin.scan_iter(f"{prefix}:*"):
        admin.delete(key)
    secret = secrets.token_bytes(32)  # one for the writer and the replicas: they all sign and check with it
    writer = SharedIndex(url, secret=secret, prefix=prefix, follow=False, socket_timeout=5, connect_timeout=5)
    t0 = time.perf_counter()
    for start in range(0, len(vecs), 1000):
        chunk = vecs[start : start + 1000]
        writer.add(
            SCOPE, [f"e{start + i}" for i in range(len(chunk))], chunk, metas=[{"answer": "k"}] * len(chunk)
        )
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    replica = SharedIndex(url, secret=secret, prefix=prefix, follow=False, socket_timeout=5, connect_timeout=5)
    load_s = time.perf_counter() - t0
    assert len(replica) == len(vecs), (len(replica), len(vecs))
    replica.close()

    follower = SharedIndex(
        url, secret=secret, prefix=prefix, block_ms=100, socket_timeout=5, connect_timeout=5, initial_wait=600
    )
    follower._index.index(SCOPE).wait_rebuilt()
    rng = np.random.default_rng(1)
    fresh = unit(rng.standard_normal((adds, vecs.shape[1])))
    lat = []
    for i, vec in enumerate(fresh):
        entry_id = f"new{i}"
        t0 = time.perf_counter_ns()
        writer.add(SCOPE, [entry_id], vec[None, :])
        while follower.get(SCOPE, entry_id) is None:
            time.sleep(0.0002)
        lat.append(time.perf_counter_ns() - t0)
    stats = follower.stats()
    follower.close()
    writer.close()
    for key in admin.scan_iter(f"{prefix}:*"):
        admin.delete(key)
    admin.close()
    return {
        "entries": len(vecs),
        "write_s": round(write_s, 2),
        "new_replica_load_s": round(load_s, 2),
        "add_to_visible_on_follower": {**percentiles(lat), "adds": adds},
        "follower_errors": stats.errors,
    }


def made_up(n: int) -> list[str]:
    verbs = ("cancel", "renew", "change", "close", "open", "top up", "freeze", "check")
    things = ("card", "account", "subscription", "pin", "transfer", "limit", "address", "plan", "refund")
    return [f"{i}: how do I {verbs[i % 8]} my {things[i // 8 % 9]}?" for i in range(n)]


def end_to_end(
    embedder: SentenceTransformerEmbedder, vecs: np.ndarray, prompts: list[str], threads: int
) -> dict:
    """Lookup = embed one prompt + search the scope's index (k=10); sequential, then concurrent callers."""
    index = SemanticIndex()
    index.add(SCOPE, [f"e{i}" for i in range(len(vecs))], vecs)
    index.index(SCOPE).wait_rebuilt()
    embedder.embed(prompts[:8])  # warm the model

    def lookup(emb, prompt: str) -> int:
        t0 = time.perf_counter_ns()
        index.search(SCOPE, emb.embed([prompt]), 10)
        return time.perf_counter_ns() - t0

    single = prompts[: len(prompts) // 3]
    t0 = time.perf_counter()
    seq = [lookup(embedder, p) for p in single]
    seq_rate = len(single) / (time.perf_counter() - t0)

    batcher = BatchingEmbedder(embedder, max_batch=64)
    work = prompts[len(single) :]
    lat: list[int] = []
    barrier = threading.Barrier(threads)

    def caller(part: list[str]) -> None:
        barrier.wait()
        mine = [lookup(batcher, p) for p in part]
        lat.extend(mine)

    parts = [work[i::threads] for i in range(threads)]
    pool = [threading.Thread(target=caller, args=(part,)) for part in parts]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    conc_rate = len(work) / (time.perf_counter() - t0)
    batcher.close()
    return {
        "index_n": len(vecs),
        "single": {**percentiles(seq), "lookups": len(seq), "lookups_per_s": round(seq_rate, 1)},
        "concurrent": {
            **percentiles(lat),
            "threads": threads,
            "lookups": len(lat),
            "lookups_per_s": round(conc_rate, 1),
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="random vectors in the index (search alone)")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--real", nargs="*", default=[], metavar="FILE", help="semantic streams (JSONL)")
    parser.add_argument("--e2e", action="store_true", help="end-to-end lookups with the real model")
    parser.add_argument("--e2e-lookups", type=int, default=600)
    parser.add_argument("--threads", type=int, default=8, help="concurrent callers in the e2e run")
    parser.add_argument("--search-threads", type=int, default=1, help="faiss OpenMP threads while searching")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--redis", metavar="URL", help="measure sharing through this Redis")
    parser.add_argument("--shared-n", type=int, default=20_000, help="entries a new replica loads from Redis")
    parser.add_argument("--follow-adds", type=int, default=200)
    parser.add_argument("--skip-random", action="store_true", help="skip the random-vector search run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    result: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }
    vecs = unit(rng.standard_normal((args.n, DIM)).astype(np.float32))
    if not args.skip_random:
        picks = vecs[rng.integers(0, args.n, args.queries)]
        queries = {"near": near(picks, 0.9, rng), "far": unit(rng.standard_normal((args.queries, DIM)))}
        result["random"] = search_alone(vecs, queries, args.k, args.search_threads)
        report("random unit vectors", result["random"])
    if args.redis:
        result["shared"] = shared(args.redis, vecs[: args.shared_n], args.follow_adds)
        report("sharing through Redis", result["shared"])

    embedder = None
    real_vecs = None
    if args.real or args.e2e:
        embedder = SentenceTransformerEmbedder(threads=args.torch_threads)
        import torch

        result["torch_threads"] = torch.get_num_threads()
    if args.real:
        prompts = prompts_of(args.real)
        t0 = time.perf_counter()
        real_vecs = embed_cached(prompts, embedder, CACHE)
        print(f"embedded {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s (cached in {CACHE})")
        base, held_out = real_vecs[: -args.queries], real_vecs[-args.queries :]
        result["real"] = search_alone(base, {"held_out": held_out}, args.k, args.search_threads)
        result["real"]["files"] = args.real
        report("real embeddings", result["real"])
    if args.e2e:
        e2e_prompts = prompts_of(args.real)[-args.e2e_lookups :] if args.real else made_up(args.e2e_lookups)
        index_vecs = real_vecs[: -args.queries] if real_vecs is not None else vecs
        result["e2e"] = end_to_end(embedder, index_vecs, e2e_prompts, args.threads)
        report("end-to-end lookup (embed + search)", result["e2e"])
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(
        f"load average before {result['load_before']}, after {result['load_after']} on {result['cpus']} CPUs"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def report(title: str, part: dict) -> None:
    print(f"== {title}")
    for key, value in part.items():
        if isinstance(value, dict):
            print(f"   {key:>10}: " + "  ".join(f"{k}={v}" for k, v in value.items()))
        elif key != "files":
            print(f"   {key:>10}: {value}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
