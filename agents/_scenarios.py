"""Drifting workloads built from real traces, for the demo and bench/loop.py: phase A, then phase B.

``kv_drift``: Mooncake requests. Phase A is the trace's first part as tenant ``acme`` under rule ``chat``. In
phase B the prompts shift (the rest of the trace, its prefixes re-hashed: a new system prompt, so nothing of
phase A is reused) to tenant ``globex``, and a batch tenant ``batchco`` (rule ``batch``) sends one-off long
documents whose blocks are never asked for again: they push the chat traffic's prefixes out of the cache.

``semantic_drift``: a question stream (Banking77) as phase A, then another (CLINC150): new prompts, new
answers, under the same rule.

Both write JSONL in the formats replay reads, with a ``phase`` field per line.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path


def _rehash(value: object, salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{salt}:{value}".encode(), digest_size=6).digest(), "big")


def kv_drift(
    mooncake: str | Path,
    out: str | Path,
    *,
    split: float = 0.5,
    batch_share: float = 0.35,
    batch_blocks: tuple[int, int] = (20, 60),
    requests: int | None = None,
    seed: int = 0,
) -> Path:
    """Write the KV drifting trace to ``out`` (see the module docstring) from the Mooncake trace ``mooncake``.
    ``batch_share`` of phase B's requests are batch documents of ``batch_blocks`` blocks."""
    rng = random.Random(seed)
    with open(mooncake, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if requests is not None:
        rows = rows[:requests]
    cut = int(len(rows) * split)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for i, row in enumerate(rows):
            phase_b = i >= cut
            line = {
                "timestamp": row["timestamp"],
                "input_length": row["input_length"],
                "output_length": row["output_length"],
                "hash_ids": row["hash_ids"],
                "tenant": "globex" if phase_b else "acme",
                "rule": "chat",
                "phase": "B" if phase_b else "A",
            }
            if phase_b:
                line["hash_ids"] = [_rehash(h, "phase-b") for h in row["hash_ids"]]
            fh.write(json.dumps(line) + "\n")
            if phase_b and rng.random() < batch_share / (1 - batch_share):
                n = rng.randint(*batch_blocks)
                doc = [_rehash(f"{i}:{j}", "batch") for j in range(n)]
                fh.write(
                    json.dumps(
                        {
                            "timestamp": row["timestamp"],
                            "input_length": n * 512,
                            "output_length": 16,
                            "hash_ids": doc,
                            "tenant": "batchco",
                            "rule": "batch",
                            "phase": "B",
                        }
                    )
                    + "\n"
                )
    return out


def semantic_drift(
    stream_a: str | Path,
    stream_b: str | Path,
    out: str | Path,
    *,
    per_phase: int = 1500,
    popular: int = 300,
    seed: int = 0,
) -> Path:
    """Write a stream of ``per_phase`` questions from ``stream_a`` then as many from ``stream_b``. Each phase
    draws from its ``popular`` first questions with Zipf(1.1) popularity, so questions and their paraphrases
    come back, as in a support queue."""
    rng = random.Random(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        t = 0.0
        for phase, path in (("A", stream_a), ("B", stream_b)):
            with open(path, encoding="utf-8") as src:
                rows = [json.loads(line) for line in src if line.strip()][:popular]
            weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(rows))]
            for row in rng.choices(rows, weights=weights, k=per_phase):
                fh.write(
                    json.dumps(
                        {
                            "t": t,
                            "prompt": row["prompt"],
                            "group": row["group"],
                            "rule": "faq",
                            "phase": phase,
                        }
                    )
                    + "\n"
                )
                t += 1.0
    return out
