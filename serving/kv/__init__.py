"""The KV prefix cache of a replica's model, and its parts that move cached keys and values between requests.

    from evocache.serving.kv import KvPrefixCache
    filled = kv.prefill(plan, input_ids, usage, engine)  # engine: a KvEngine (config, lock, forward, RoPE)
    kv.store(filled)                                     # the new blocks into L1, and to L2/L3 on the writer

    from evocache.serving.kv import RopeShift
    shift = RopeShift.from_model(model)    # or RopeShift.for_config(config); refuses what is inexact
    keys = shift.shift(cache.layers[i].keys[..., start:stop, :], delta)   # the chunk moved by delta

``RopeShift`` needs torch and transformers and imports them when first used; the errors need neither. The
math, and which RoPE scalings are exact and why, are in serving/kv/_rope.py.
"""

from .._lazy import lazy_getattr as _lazy_getattr
from ._reasons import MISS_REASONS
from .errors import KvReuseError, RopeShiftUnsupported

# torch is imported on first use, so `import evocache.serving.kv` stays light.
_LAZY = {
    "EXACT_ROPE_TYPES": "._rope", "ROTARY_EMBEDDINGS": "._rope", "RopeShift": "._rope",
    "KvConfig": "._cache", "KvPlan": "._cache", "KvPrefixCache": "._cache", "KvUsage": "._cache",
    "Prefilled": "._cache", "KvEngine": "._engine", "DeviceBlocks": "._pool",
    "BlockGeometry": "._store", "CorruptBlock": "._store",
}  # fmt: skip

__getattr__ = _lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "BlockGeometry",
    "CorruptBlock",
    "DeviceBlocks",
    "EXACT_ROPE_TYPES",
    "KvConfig",
    "KvEngine",
    "KvPlan",
    "KvPrefixCache",
    "KvUsage",
    "KvReuseError",
    "MISS_REASONS",
    "Prefilled",
    "ROTARY_EMBEDDINGS",
    "RopeShift",
    "RopeShiftUnsupported",
]
