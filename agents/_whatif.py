"""What a policy document would have done with a stretch of traffic: the replay that judges every proposal.

``controller.replay`` replays one eviction policy over keys. A proposal changes more than that: a rule's ttl,
a rule turned to bypass, a tenant's share of the capacity, the KV ``min_tokens``, a rule's semantic settings,
the eviction policy. ``Simulator`` owns one capacity-bounded cache (the L1 a replica would have) and replays
``Request``s under a ``Policy``:

- each request takes the settings of the rule its source says it matched (``Request.rule``; a name the policy
  does not know takes the defaults), so edits to a rule's settings are judged, not edits to its ``when``;
- a bypassing rule, or a KV request shorter than the rule's ``min_tokens``, makes no lookup and stores
  nothing;
- an entry lives ``ttl`` seconds of trace time; a KV request hits its leading cached blocks (a prefix: block i
  is of no use once an earlier block missed), and stores the blocks it computed;
- a tenant with ``l1_share < 1`` evicts its own entries first once it holds its share;
- a semantic request (a prompt and its answer group) is looked up exactly first, then, when its rule has
  ``semantic:``, through a ``SemanticCache`` with the rule's mode and error bound over precomputed vectors
  (an answer is served semantically only while its exact entry is held: evicted or expired, it leaves the
  index); a hit whose answer group differs is ``wrong``;
- the eviction policy is the production class the policy names for ``l1`` (``eviction.l1``, else LRU), run on
  the trace's clock, with the access context learned policies read.

The simulator keeps its state between calls: ``run`` the windows one after another, and switch the policy at a
window boundary as a rollout would (``canary`` routes a share of requests, by key, to the candidate, the way
the policy store's canary does). With the same requests, policies and seed, results are the same.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evocache.controller import canary_for
from evocache.controller import StoreConfigError
from evocache.controller.eviction import EntryInfo, EvictionPolicy, make_eviction_policy, start_from_model
from evocache.dsl import Policy

from ._types import Outcome, Request

if TYPE_CHECKING:
    from evocache.controller.semantic import SemanticCache
    from evocache.controller.semantic._bench import VectorTable


@dataclass(frozen=True, slots=True)
class RuleSettings:
    """What the simulator reads of one rule of one policy (resolved over the defaults)."""

    cache: bool
    ttl: float
    min_tokens: int
    semantic: tuple[str, float, float | None, float] | None  # (mode, explore, threshold, max_error)


def rule_settings(policy: Policy, rule: str) -> RuleSettings:
    """The settings ``policy`` gives requests of ``rule`` (the defaults for a rule it does not name)."""
    decision = policy.decision_for(rule)
    kv = decision.kv
    min_tokens = 0 if kv is None or kv.reuse == "off" else int(kv.min_tokens or 0)
    sem = decision.semantic
    semantic = None
    if sem is not None:
        semantic = (
            sem.mode or "bounded",
            float(sem.explore if sem.explore is not None else 0.05),
            None if sem.threshold is None else float(sem.threshold),
            float(sem.max_error),
        )
    cache_kv = kv is None or kv.reuse != "off"
    return RuleSettings(
        cache=decision.cache and cache_kv, ttl=float(decision.ttl), min_tokens=min_tokens, semantic=semantic
    )


class _Arm:
    """One policy's settings, resolved once per rule and tenant."""

    def __init__(self, policy: Policy, capacity: int) -> None:
        self.policy = policy
        self._rules: dict[str, RuleSettings] = {}
        self._quota: dict[str, float] = {}
        self._capacity = capacity

    def rule(self, name: str) -> RuleSettings:
        settings = self._rules.get(name)
        if settings is None:
            settings = self._rules[name] = rule_settings(self.policy, name)
        return settings

    def quota(self, ns: str) -> float:
        """The most ``ns`` may hold, in capacity units (inf: no quota)."""
        quota = self._quota.get(ns)
        if quota is None:
            tenants = self.policy.tenants
            spec = tenants.get(ns) if ns in tenants else tenants.get("default")  # as the controller reads it
            share = 1.0 if spec is None else float(spec.l1_share)
            quota = self._quota[ns] = math.inf if share >= 1.0 else share * self._capacity
        return quota


def eviction_name(policy: Policy) -> str:
    return policy.eviction.l1 or "lru"


class Simulator:
    """A replica's L1 under a policy, replayed on the trace's clock. See the module docstring.

    ``capacity`` is in the requests' size unit (tokens for KV blocks, bytes for responses; each key weighs its
    request's ``size``). ``vectors``: the embeddings of the semantic requests' prompts (``VectorTable``),
    needed only when a rule has ``semantic:``. ``models``: the directory of the trained models a policy's
    ``eviction.model`` names (the store's ``l1.models``); a learned policy starts from the model it names, as a
    replica does. Raises ``ValueError`` for a capacity < 1 and ``StoreConfigError`` for an eviction policy
    name the controller does not know or a model file it cannot use (when the policy is first used).
    """

    def __init__(
        self,
        policy: Policy,
        capacity: int,
        *,
        seed: int = 0,
        vectors: VectorTable | None = None,
        models: Path | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._seed = seed
        self._vectors = vectors
        self._now = 0.0
        self._held: OrderedDict[Hashable, tuple[int, float, str]] = OrderedDict()  # key -> (size, expiry, ns)
        self._used = 0
        self._used_ns: dict[str, int] = {}
        self._req = 0
        self._arm = _Arm(policy, capacity)
        self._models = models
        self._eviction_spec: tuple[str, str | None] = ("", None)
        self._eviction: EvictionPolicy = self._start_eviction(policy)
        self._semantic: dict[tuple[str, float, float | None], SemanticCache] = {}
        self._inserted: list[tuple[str, str, str, str]] = []  # (ns, rule, prompt, group): to fill a new cache
        self._entry_keys: dict[str, Hashable] = {}  # semantic entry id -> the exact key it was stored under
        self._semantic_ids: dict[Hashable, tuple[Any, str]] = {}  # exact key held -> (scope, entry id)
        self._live_entries: set[str] = set()  # entry ids whose exact key the cache still holds
        self._groups: dict[tuple[str, str], str] = {}  # (ns, prompt) -> group of the entry stored for it

    @property
    def policy(self) -> Policy:
        return self._arm.policy

    # -- the policy in force -------------------------------------------------------------------------------

    def use(self, policy: Policy) -> None:
        """Switch to ``policy`` from the next request on (a promotion). The cache keeps its entries; a new
        eviction policy takes over the held keys in their last-use order."""
        self._arm = _Arm(policy, self.capacity)
        if (eviction_name(policy), policy.eviction.model) != self._eviction_spec:
            self._eviction.close()
            self._eviction = self._start_eviction(policy)
            for key, (size, _, ns) in self._held.items():
                self._eviction.on_insert(key, EntryInfo(size, ns))

    def _start_eviction(self, policy: Policy) -> EvictionPolicy:
        """The eviction class ``policy`` names, started from the trained model it names (if any)."""
        name, model = eviction_name(policy), policy.eviction.model
        if model is not None and self._models is None:
            raise StoreConfigError(
                f"policy {policy.ref}: eviction.model: no models directory to read it from (Simulator(models=))"
            )
        built = self._build_eviction(name)
        self._eviction_spec = (name, model)
        return start_from_model(built, None if model is None else self._models / model, policy.ref)

    def _build_eviction(self, name: str) -> EvictionPolicy:
        return make_eviction_policy(
            name, capacity=self.capacity, clock=lambda: self._now, rng=random.Random(self._seed)
        )

    # -- replay --------------------------------------------------------------------------------------------

    def run(
        self, requests: Sequence[Request], *, canary: Policy | None = None, fraction: float = 0.0
    ) -> list[Outcome]:
        """Replay ``requests`` (in time order) and return one ``Outcome`` each. With ``canary``, a request
        whose first key ``canary_for(key, fraction)`` picks is decided by it instead of the policy in
        force."""
        candidate = _Arm(canary, self.capacity) if canary is not None else None
        out: list[Outcome] = []
        for req in requests:
            arm = self._arm
            if candidate is not None and req.keys and canary_for(req.keys[0], fraction):
                arm = candidate
            out.append(self._one(req, arm))
        return out

    def arm_of(self, req: Request, fraction: float) -> bool:
        """Whether ``req`` would be a canary request at ``fraction`` (the same test ``run`` makes)."""
        return bool(req.keys) and canary_for(req.keys[0], fraction)

    def _one(self, req: Request, arm: _Arm) -> Outcome:
        self._now = t = req.t
        settings = arm.rule(req.rule)
        self._req += 1
        if not settings.cache or (req.kind == "kv" and 0 <= req.prompt_tokens < settings.min_tokens):
            return Outcome(0, 0, bypass=True)
        ns = req.ns
        evicted: list[str] = []
        if req.kind == "semantic":
            return self._semantic_request(req, settings, arm, evicted)
        hits = 0
        chain = True  # KV blocks are of use only as a prefix: after a miss, later blocks count as misses
        parent: Hashable | None = None
        n = len(req.keys)
        for pos, key in enumerate(req.keys):
            k = (ns, key)
            info = EntryInfo(
                req.size,
                ns,
                rule=req.rule,
                req=self._req,
                pos=pos,
                req_len=n,
                parent=parent,
                req_out=req.output_tokens,
            )
            if self._lookup(k, info):
                hits += chain
            else:
                chain = False
                self._admit(k, info, t + settings.ttl, arm.quota(ns), evicted)
            parent = k
        return Outcome(n, hits, tier="l1" if hits else "", evicted=tuple(evicted))

    def _lookup(self, k: Hashable, info: EntryInfo) -> bool:
        """Whether ``k`` is held and fresh; notifies the eviction policy of the access (and of the hit)."""
        if self._eviction.uses_context:
            self._eviction.on_access(k, info)
        held = self._held.get(k)
        if held is not None and held[1] <= self._now:  # expired: gone before this lookup
            self._drop(k)
            held = None
        if held is None:
            return False
        self._eviction.on_hit(k)
        self._held.move_to_end(k)
        return True

    def _admit(self, k: Hashable, info: EntryInfo, expiry: float, quota: float, evicted: list[str]) -> None:
        size = info.size
        if size > self.capacity or not self._eviction.admit(k, info):
            return
        ns = info.ns
        while self._used_ns.get(ns, 0) + size > quota and self._used_ns.get(ns, 0) > 0:
            try:
                victim = self._eviction.victim(ns)
            except KeyError:
                break
            self._evict(victim, evicted)
        while self._used + size > self.capacity:
            self._evict(self._eviction.victim(), evicted)
        self._held[k] = (size, expiry, ns)
        self._used += size
        self._used_ns[ns] = self._used_ns.get(ns, 0) + size
        self._eviction.on_insert(k, info)

    def _evict(self, key: Hashable, evicted: list[str]) -> None:
        evicted.append(self._held[key][2])
        self._drop(key)

    def _drop(self, key: Hashable) -> None:
        size, _, ns = self._held.pop(key)
        self._used -= size
        self._used_ns[ns] -= size
        self._eviction.on_remove(key)
        self._groups.pop(key, None)
        placed = self._semantic_ids.pop(key, None)
        if placed is not None:  # what the cache no longer holds is not served semantically either
            scope, entry_id = placed
            self._live_entries.discard(entry_id)
            self._entry_keys.pop(entry_id, None)
            for cache in self._semantic.values():
                cache.remove(scope, [entry_id])

    # -- semantic ------------------------------------------------------------------------------------------

    def _semantic_request(
        self, req: Request, settings: RuleSettings, arm: _Arm, evicted: list[str]
    ) -> Outcome:
        """An exact lookup of the prompt's key, then (when the rule has ``semantic:``) a semantic one; a miss
        stores the answer (its group) under the key and in the semantic index."""
        ns, key = req.ns, req.keys[0]
        k = (ns, key)
        info = EntryInfo(req.size, ns, rule=req.rule, req=self._req, pos=0, req_len=1)
        group = req.group or ""
        if self._lookup(k, info):
            wrong = self._groups.get(k, group) != group
            return Outcome(1, 1, wrong=wrong, tier="l1", evicted=tuple(evicted))
        spec = settings.semantic
        decision = None
        if spec is not None:
            from evocache.controller.semantic._index import Scope

            mode, explore, threshold, max_error = spec
            cache = self._semantic_cache(mode, explore, threshold)
            scope = Scope(ns or "-", req.rule or "-")
            prompt = req.prompt if req.prompt is not None else key
            decision, entry = cache.lookup(scope, prompt, max_error=max_error)
            if entry is not None:
                held = self._held.get(self._entry_keys[entry])
                if held is not None and held[1] <= self._now:  # expired since it was stored
                    self._drop(self._entry_keys[entry])
                    entry = None
            if entry is not None:
                self._held.move_to_end(self._entry_keys[entry])
                self._eviction.on_hit(self._entry_keys[entry])
                wrong = cache.answer_ref(entry) != group
                return Outcome(1, 1, wrong=wrong, semantic=True, tier="semantic", evicted=tuple(evicted))
        self._admit(k, info, req.t + settings.ttl, arm.quota(ns), evicted)
        self._groups[k] = group
        if spec is not None:
            prompt = req.prompt if req.prompt is not None else key
            scope = Scope(ns or "-", req.rule or "-")
            if k in self._held and k not in self._semantic_ids:  # only what the cache holds can be served
                self._inserted.append((ns, req.rule, prompt, group))
                entry_id = f"e{len(self._inserted)}"
                self._entry_keys[entry_id] = k
                self._semantic_ids[k] = (scope, entry_id)
                self._live_entries.add(entry_id)
                for other in self._semantic.values():
                    other.insert(scope, entry_id, prompt, group)
            cache.judge_miss(scope, prompt, group, decision)
        return Outcome(1, 0, evicted=tuple(evicted))

    def _semantic_cache(self, mode: str, explore: float, threshold: float | None) -> SemanticCache:
        key = (mode, explore, threshold)
        cache = self._semantic.get(key)
        if cache is None:
            from evocache.controller.semantic import SemanticCache
            from evocache.controller.semantic._index import Scope
            from evocache.controller.semantic._policies import PolicyOptions

            if self._vectors is None:
                raise ValueError("a rule has semantic: settings but the simulator was given no vectors")
            options = PolicyOptions(
                mode=mode,
                explore=explore if mode == "bounded" else 0.05,
                threshold=threshold if mode == "static" else None,
            )
            cache = SemanticCache(self._vectors, policy=options.build(), rng=random.Random(self._seed))
            for i, (ns, rule, prompt, group) in enumerate(self._inserted, start=1):
                if f"e{i}" in self._live_entries:
                    cache.insert(Scope(ns or "-", rule or "-"), f"e{i}", prompt, group)
            self._semantic[key] = cache
        return cache
