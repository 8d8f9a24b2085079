"""Why a request's first uncached KV block missed (``KvUsage.miss``), in the order the docs list them."""

from __future__ import annotations

MISS_REASONS = ("never-seen", "evicted", "partial-block", "below-min-tokens", "off", "corrupt")
"""``never-seen``: no block under this salt was ever stored (also for tokens another tenant sent); ``evicted``:
dropped from L1 and in no lower tier; ``partial-block``: the prompt ends before a full block; ``below-min-tokens``
and ``off``: the rule's ``kv:`` says no; ``corrupt``: a lower tier's block failed the cache's checks."""
