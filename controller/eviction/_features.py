"""The learned policy's features: LRB's, plus the context of KV blocks. Computed by ``_history.History``.

Time is the policy's access count (``tick``), not the clock: features then depend only on the order of
accesses, and replay reproduces them exactly.
"""

from __future__ import annotations

HALF_LIVES = (256.0, 1024.0, 4096.0, 16384.0)
"""Half-lives of the exponentially decayed counts, in accesses (LRB's EDCs, four of its ten)."""

FEATURES = (
    "age",  # accesses since the object's last access
    "gap1",  # the last three gaps between its accesses (NaN: fewer accesses)
    "gap2",
    "gap3",
    *(f"edc{int(h)}" for h in HALF_LIVES),
    "count",  # accesses seen (while its history was kept)
    "log_size",
    "pos",  # place in its request's prefix chain at the last access (NaN: no context)
    "req_len",  # blocks in that request
    "to_tail",  # req_len - pos: how far from the end of the chain
    "req_out",  # the request's output length in tokens (known at its completion; NaN: unknown)
    "req_new",  # blocks of its request from the first never seen before to the end (0: all seen so far)
    "children",  # cached blocks that have it as parent
    "head_requests",  # requests seen so far that started with the same first block
    "head_gap",  # accesses since that first block's previous request (NaN: the first one)
    "ns_code",  # the namespace and rule, as stable codes a tree can split on
    "rule_code",
)


MONOTONE = {
    "age": -1,
    **{f"edc{int(h)}": 1 for h in HALF_LIVES},
    "count": 1,
    "children": 1,
    "head_requests": 1,
}
"""Known directions (``monotone=True``): the longer since the last access, the less likely a return; the more
accesses (recent or not), cached children, or requests sharing the chain's first block, the likelier."""
