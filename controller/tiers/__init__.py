"""The tier interface and its implementations: L1 memory, L2 Redis, L3 disk, composed by ``TieredStore``."""

from ._base import Tier
from ._disk import DiskTier
from ._memory import MemoryTier
from ._redis import RedisTier
from ._tiered import Lookup, TieredStore

__all__ = ["Tier", "MemoryTier", "RedisTier", "DiskTier", "TieredStore", "Lookup"]
