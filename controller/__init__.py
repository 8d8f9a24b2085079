"""HOW it is cached: ``cache_if`` (enforcing a dsl contract), tiers, eviction, events, metrics.

    from evocache.controller import cache_if

    @cache_if("512 <= len(input_ids) <= 2048 and top_k <= 10", ttl="10m", model="my-model")
    def generate(input_ids: list[int], top_k: int = 0) -> str: ...

Public names are re-exported here; the modules behind them are private.
"""

from ._blocks import MAX_BLOCK_TOKENS, BlockHash, block_hashes
from ._cache_if import CacheInfo, cache_if
from ._contract import Admission, SemanticOptions, Tenant, tenant_scope
from ._control import NO_STORE, REFRESH, CacheControl, cache_control
from ._events import OUTCOMES as EVENT_OUTCOMES
from ._calls import read_events
from ._events import INCOMPLETE, AccessEvent, EventSink, JsonlSink, RedisStreamSink, RingSink
from ._keys import derive_key, namespace_for
from ._metrics import CacheMetrics
from ._outcome import AsyncCallStream, CallHandle, CallId, CallOutcome, CallStream, Called, KvReport
from ._files import NotARegularFile, read_bounded
from ._policy_store import (
    POLICY_STORE_ENV,
    FilePolicyStore,
    PolicyFollower,
    PolicyState,
    PolicyStatus,
    PolicyStore,
    PolicyStoreConfig,
    PolicyStoreError,
    RedisPolicyStore,
    Registration,
    ReplicaReport,
    Rollout,
    StoreSummary,
    UnenforceablePolicy,
    canary_for,
    default_policy_store,
    open_policy_store,
)
from ._redis_client import REDIS_ERRORS
from ._redis_client import connect as connect_redis
from ._rollout import RolloutArm, RolloutRuntimes, ShadowComparison
from ._runtime import (
    CacheRuntime,
    build_runtime,
    check_policy,
    configure,
    current_runtime,
    default_runtime,
    set_policy,
    use_runtime,
)
from ._secret import entry_secret
from ._serialize import JsonSerializer, PickleSerializer, Serializer
from ._slo import SloBreaker, SloBreakers
from ._store_config import (
    DiskConfig,
    EmbedderConfig,
    EventsConfig,
    L1Config,
    RedisConfig,
    SemanticConfig,
    StoreConfig,
)
from ._types import L1, L2, L3, CacheKey, Entry, Namespace, TierName
from .errors import (
    ContractError,
    ControllerError,
    CorruptEntry,
    EmbeddingError,
    LearnedModelError,
    SemanticError,
    StoreConfigError,
    TierError,
    TierUnavailable,
)
from .eviction import EVICTION_POLICIES, EntryInfo, EvictionPolicy, make_eviction_policy
from .tiers import DiskTier, Lookup, MemoryTier, RedisTier, Tier, TieredStore

__all__ = [
    "AccessEvent",
    "Admission",
    "AsyncCallStream",
    "BlockHash",
    "CacheControl",
    "CacheInfo",
    "CacheKey",
    "CacheMetrics",
    "CacheRuntime",
    "CallHandle",
    "CallId",
    "CallOutcome",
    "CallStream",
    "Called",
    "ContractError",
    "ControllerError",
    "CorruptEntry",
    "EmbeddingError",
    "DiskConfig",
    "DiskTier",
    "EVENT_OUTCOMES",
    "EVICTION_POLICIES",
    "INCOMPLETE",
    "EmbedderConfig",
    "Entry",
    "EntryInfo",
    "EventSink",
    "EventsConfig",
    "EvictionPolicy",
    "FilePolicyStore",
    "JsonSerializer",
    "JsonlSink",
    "KvReport",
    "L1",
    "L1Config",
    "L2",
    "L3",
    "LearnedModelError",
    "MAX_BLOCK_TOKENS",
    "NO_STORE",
    "Lookup",
    "MemoryTier",
    "Namespace",
    "NotARegularFile",
    "POLICY_STORE_ENV",
    "PickleSerializer",
    "PolicyFollower",
    "PolicyState",
    "PolicyStatus",
    "PolicyStore",
    "PolicyStoreConfig",
    "PolicyStoreError",
    "REDIS_ERRORS",
    "REFRESH",
    "RedisConfig",
    "RedisPolicyStore",
    "RedisStreamSink",
    "RedisTier",
    "Registration",
    "ReplicaReport",
    "RingSink",
    "Rollout",
    "RolloutArm",
    "RolloutRuntimes",
    "SemanticConfig",
    "SemanticError",
    "SemanticOptions",
    "Serializer",
    "ShadowComparison",
    "SloBreaker",
    "SloBreakers",
    "StoreConfig",
    "StoreConfigError",
    "StoreSummary",
    "Tenant",
    "Tier",
    "TierError",
    "TierName",
    "TierUnavailable",
    "TieredStore",
    "UnenforceablePolicy",
    "block_hashes",
    "build_runtime",
    "cache_control",
    "cache_if",
    "canary_for",
    "check_policy",
    "configure",
    "connect_redis",
    "current_runtime",
    "default_policy_store",
    "default_runtime",
    "derive_key",
    "entry_secret",
    "make_eviction_policy",
    "namespace_for",
    "open_policy_store",
    "read_bounded",
    "read_events",
    "set_policy",
    "tenant_scope",
    "use_runtime",
]
