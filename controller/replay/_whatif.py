"""What a whole policy document would have done with a stretch of traffic: the replay that judges a change.

``replay`` runs one eviction policy over keys. A policy change is more than that: a rule's ttl, a rule turned
to bypass, a tenant's share of the capacity, the KV ``min_tokens``, a rule's semantic settings, the eviction
policy. ``PolicySimulator`` owns one capacity-bounded cache (the L1 a replica would have) and replays
``ReplayRequest``s under a ``Policy``, reading what the policy decides as the controller does, resolved by dsl
(``Decision``, ``Policy.tenant``):

- each request takes the decision of the rule its source says it matched (``ReplayRequest.rule``; a name the
  policy does not know takes the defaults: ``Policy.decision_for``), so edits to a rule's settings are judged,
  not edits to its ``when``;
- a bypassing rule, or a KV request shorter than the rule's ``min_tokens``, makes no lookup and stores
  nothing;
- an entry lives ``ttl`` seconds of trace time; a KV request hits its leading cached blocks (a prefix: block i
  is of no use once an earlier block missed), and stores the blocks it computed;
- a tenant with ``l1_share < 1`` (``Policy.tenant``: its own entry, else the default one) evicts its own
  entries first once it holds its share;
- a semantic request (a prompt and its answer group) is looked up exactly first, then, when its rule has
  ``semantic:``, through a ``SemanticCache`` with the rule's resolved mode, exploration and error bound over
  precomputed vectors (an answer is served semantically only while its exact entry is held: evicted or
  expired, it leaves the index); a hit whose answer group differs is ``wrong``;
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
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from evocache.dsl import Decision, Policy

from .._policy_store import canary_for
from ..errors import StoreConfigError
from ..eviction import EntryInfo, EvictionPolicy, LearnedTraining, make_eviction_policy, start_from_model

if TYPE_CHECKING:
    from ..semantic import Embedder, SemanticCache

RequestKind = Literal["kv", "response", "semantic"]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One client call.

    ``keys``: what the cache looks up for it, in order: KV block hashes (a prefix chain: block i is only of
    use when blocks 0..i-1 are), or the one response key. ``size``: the size of one key's entry (tokens of a
    KV block, bytes of a response). ``ns``: the tenant ("" when the source has none); ``rule``: the policy
    rule the source says it matched ("" when none). ``prompt_tokens`` / ``output_tokens``: -1 when unknown.
    ``latency_ms``: what serving it cost without the cache (the model's time), -1 when unknown; ``cost``: the
    same in money (the engine's reported cost of its answer, the access event's ``cost``), -1 when unknown.
    ``prompt`` and
    ``group`` (semantic streams): the prompt text and its answer group, the judge of a semantic hit.
    ``phase``: a label the source carries (a drifting benchmark's phase), never read by the loop's decisions.
    """

    t: float
    kind: RequestKind
    keys: tuple[str, ...]
    size: int = 1
    ns: str = ""
    rule: str = ""
    prompt_tokens: int = -1
    output_tokens: int = -1
    latency_ms: float = -1.0
    prompt: str | None = None
    group: str | None = None
    phase: str | None = None
    cost: float = -1.0


class ReplayOutcome(NamedTuple):
    """What a policy did with one request: ``lookups`` made (0 when bypassed), ``hits`` among them (for KV the
    leading blocks served from cache, a prefix), ``bypass`` (a rule said not to cache), ``wrong`` (a semantic
    hit whose answer group differs), ``tier`` the deepest tier a hit came from ("" for none), and
    ``evicted`` the tenants whose entries this request's admission evicted (with repeats)."""

    lookups: int
    hits: int
    bypass: bool = False
    wrong: bool = False
    semantic: bool = False
    tier: str = ""
    evicted: tuple[str, ...] = ()



@dataclass(frozen=True, slots=True)
class _Rule:
    """One rule's decision, with what the replay reads of its KV section: whether it caches at all and the
    shortest prompt it reuses blocks for."""

    decision: Decision
    cache: bool
    min_tokens: int

    @classmethod
    def of(cls, decision: Decision) -> _Rule:
        kv = decision.kv
        reuse = kv is not None and kv.reuse != "off"
        min_tokens = int(kv.min_tokens or 0) if kv is not None and reuse else 0
        return cls(decision, decision.cache and (kv is None or reuse), min_tokens)


class _Arm:
    """One policy's decisions, looked up once per rule and tenant."""

    def __init__(self, policy: Policy, capacity: int) -> None:
        self.policy = policy
        self._rules: dict[str, _Rule] = {}
        self._quota: dict[str, float] = {}
        self._capacity = capacity

    def rule(self, name: str) -> _Rule:
        rule = self._rules.get(name)
        if rule is None:
            rule = self._rules[name] = _Rule.of(self.policy.decision_for(name))
        return rule

    def quota(self, ns: str) -> float:
        """The most ``ns`` may hold, in capacity units (inf: no quota)."""
        quota = self._quota.get(ns)
        if quota is None:
            spec = self.policy.tenant(ns)  # as the controller's tiers read it
            share = 1.0 if spec is None else float(spec.l1_share)
            quota = self._quota[ns] = math.inf if share >= 1.0 else share * self._capacity
        return quota


def eviction_name(policy: Policy) -> str:
    return policy.eviction.l1 or "lru"


class PolicySimulator:
    """A replica's L1 under a policy, replayed on the trace's clock. See the module docstring.

    ``capacity`` is in the requests' size unit (tokens for KV blocks, bytes for responses; each key weighs its
    request's ``size``). ``vectors``: an ``Embedder`` over the semantic requests' prompts (precomputed:
    ``controller.semantic.precomputed_embedder``),
    needed only when a rule has ``semantic:``. ``models``: the directory of the trained models a policy's
    ``eviction.model`` names (the store's ``l1.models``); a learned policy starts from the model it names, as
    a replica does. ``training``: how a learned eviction policy labels and fits (``LearnedTraining``; None: the
    class's defaults), for a replay that trains a model. Raises ``ValueError`` for a capacity < 1 and ``StoreConfigError`` for an eviction policy
    name the controller does not know or a model file it cannot use (when the policy is first used).
    """

    def __init__(
        self,
        policy: Policy,
        capacity: int,
        *,
        seed: int = 0,
        vectors: Embedder | None = None,
        models: Path | None = None,
        training: LearnedTraining | None = None,
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
        self._training = training
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
                f"policy {policy.ref}: eviction.model: no models directory to read it from "
                "(PolicySimulator(models=))"
            )
        built = self._build_eviction(name)
        self._eviction_spec = (name, model)
        return start_from_model(built, None if model is None else self._models / model, policy.ref)

    def _build_eviction(self, name: str) -> EvictionPolicy:
        options: dict[str, Any] = {} if self._training is None else {"training": self._training}
        return make_eviction_policy(
            name, capacity=self.capacity, clock=lambda: self._now, rng=random.Random(self._seed), **options
        )

    @property
    def eviction(self) -> EvictionPolicy:
        """The eviction policy in force (a learned one: to fit its model or load one into it)."""
        return self._eviction

    # -- replay --------------------------------------------------------------------------------------------

    def run(
        self, requests: Sequence[ReplayRequest], *, canary: Policy | None = None, fraction: float = 0.0
    ) -> list[ReplayOutcome]:
        """Replay ``requests`` (in time order) and return one ``Outcome`` each. With ``canary``, a request
        whose first key ``canary_for(key, fraction)`` picks is decided by it instead of the policy in
        force."""
        candidate = _Arm(canary, self.capacity) if canary is not None else None
        out: list[ReplayOutcome] = []
        for req in requests:
            arm = self._arm
            if candidate is not None and req.keys and canary_for(req.keys[0], fraction):
                arm = candidate
            out.append(self._one(req, arm))
        return out

    def arm_of(self, req: ReplayRequest, fraction: float) -> bool:
        """Whether ``req`` would be a canary request at ``fraction`` (the same test ``run`` makes)."""
        return bool(req.keys) and canary_for(req.keys[0], fraction)

    def _one(self, req: ReplayRequest, arm: _Arm) -> ReplayOutcome:
        self._now = t = req.t
        rule = arm.rule(req.rule)
        self._req += 1
        if not rule.cache or (req.kind == "kv" and 0 <= req.prompt_tokens < rule.min_tokens):
            return ReplayOutcome(0, 0, bypass=True)
        ns = req.ns
        evicted: list[str] = []
        if req.kind == "semantic":
            return self._semantic_request(req, rule.decision, arm, evicted)
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
                self._admit(k, info, t + rule.decision.ttl, arm.quota(ns), evicted)
            parent = k
        return ReplayOutcome(n, hits, tier="l1" if hits else "", evicted=tuple(evicted))

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
        self, req: ReplayRequest, rule: Decision, arm: _Arm, evicted: list[str]
    ) -> ReplayOutcome:
        """An exact lookup of the prompt's key, then (when the rule has ``semantic:``) a semantic one; a miss
        stores the answer (its group) under the key and in the semantic index."""
        from ..semantic import Scope

        ns, key = req.ns, req.keys[0]
        k = (ns, key)
        info = EntryInfo(req.size, ns, rule=req.rule, req=self._req, pos=0, req_len=1)
        group = req.group or ""
        if self._lookup(k, info):
            wrong = self._groups.get(k, group) != group
            return ReplayOutcome(1, 1, wrong=wrong, tier="l1", evicted=tuple(evicted))
        spec = rule.semantic  # resolved: mode and explore filled in
        decision = None
        if spec is not None:
            cache = self._semantic_cache(spec.mode or "bounded", spec.explore, spec.threshold)
            scope = Scope(ns or "-", req.rule or "-")
            prompt = req.prompt if req.prompt is not None else key
            decision, entry = cache.lookup(scope, prompt, max_error=spec.max_error)
            if entry is not None:
                held = self._held.get(self._entry_keys[entry])
                if held is not None and held[1] <= self._now:  # expired since it was stored
                    self._drop(self._entry_keys[entry])
                    entry = None
            if entry is not None:
                self._held.move_to_end(self._entry_keys[entry])
                self._eviction.on_hit(self._entry_keys[entry])
                wrong = cache.answer_ref(entry) != group
                hit = ReplayOutcome(1, 1, wrong=wrong, semantic=True, tier="semantic", evicted=tuple(evicted))
                return hit
        self._admit(k, info, req.t + rule.ttl, arm.quota(ns), evicted)
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
        return ReplayOutcome(1, 0, evicted=tuple(evicted))

    def _semantic_cache(self, mode: str, explore: float, threshold: float | None) -> SemanticCache:
        key = (mode, explore, threshold)
        cache = self._semantic.get(key)
        if cache is None:
            from ..semantic import PolicyOptions, SemanticCache

            if self._vectors is None:
                raise ValueError("a rule has semantic: settings but the simulator was given no vectors")
            options = PolicyOptions(mode=mode, explore=explore, threshold=threshold)
            cache = SemanticCache(self._vectors, policy=options.build(), rng=random.Random(self._seed))
            for i, (ns, rule, prompt, group) in enumerate(self._inserted, start=1):
                if f"e{i}" in self._live_entries:
                    cache.insert(Scope(ns or "-", rule or "-"), f"e{i}", prompt, group)
            self._semantic[key] = cache
        return cache
