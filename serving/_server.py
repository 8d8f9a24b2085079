"""One model replica's work, without Ray: enforce the contract and the policy rollout on every request.

``ModelServer`` is what each Ray Serve replica of the model deployment holds (``serving._deployment``); it runs
in-process just as well, which is how most of its behaviour is tested. It owns:

* the replica's ``CacheRuntime``: its own L1, and the L2 (Redis), L3, event sink and semantic index of the
  ``StoreConfig``, shared with the other replicas through Redis;
* the model's answer function, decorated with ``@cache_if(contract)``: the request view is ``prompt``,
  ``input_ids``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (0: the OpenAI API has none), ``seed``,
  ``stop`` and ``endpoint``, plus
  ``tenant``, ``model`` and ``model_revision``, so a policy's rules and the contract can use any of them;
* the rollout: a ``PolicyFollower`` keeps the replica on the policy store's active version and canary, and each
  request runs on the arm its rollout key picks (``GenerateRequest.rollout_key``); a shadow version's decision
  is evaluated beside the active one and only counted;
* what the router reads: the block hashes it served (``BlockLedger``), only those its KV cache still holds in
  L1 when it has one, and its queue;
* with a Hugging Face model, the KV prefix cache: after each call whose model ran, a ``kv`` access event with
  the call's ``KvUsage`` and the KV metrics (``serving.kv._metrics``) on the runtime's registry.

The answer is a stream of text pieces, stored as its chunk list: a streamed request and a plain one share an
entry, and a hit replays the pieces the first answer streamed.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from evocache.dsl import CLIENT_CONTROLS
from pydantic import BaseModel, ConfigDict, Field

from evocache.controller import (
    Admission,
    REFRESH,
    BlockHash,
    CacheControl,
    KvReport,
    CacheRuntime,
    CallHandle,
    CallOutcome,
    PolicyFollower,
    PolicyStoreConfig,
    RolloutRuntimes,
    SemanticOptions,
    StoreConfig,
    build_runtime,
    cache_control,
    cache_if,
    entry_secret,
    open_policy_store,
    tenant_scope,
    use_runtime,
)

from ._affinity import STATS_BLOCKS, BlockLedger, checkpoints
from ._prices import Price
from ._model import (
    GenerationParams,
    Generator,
    HFGenerator,
    ModelConfig,
    Tokenizer,
    apply_stop,
    load_generator,
    load_tokenizer,
)
from ._request import Completion, Decision, Finish, GenerateRequest, completion_of
from ._upstream import END, SHARED_SALT_VALUE, UpstreamGenerator, tenant_salt
from .kv._cache import SHARED_SALT, KvConfig, KvPlan, KvPrefixCache, KvUsage
from .kv._metrics import KvMetrics
from .kv._store import BlockGeometry

log = logging.getLogger("evocache.serving")


class ServerSpec(BaseModel):
    """What a model replica is built from: the model, the contract its calls must meet, the store, where the
    policy comes from, and the block size the router hashes prompts with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig
    contract: str = "true"
    store: StoreConfig = Field(default_factory=StoreConfig)
    policy_store: PolicyStoreConfig | None = None
    block_size: int = Field(16, ge=1, le=4096)  # tokens per block: the router's hashes and the KV cache's
    kv: KvConfig | None = Field(default_factory=KvConfig)  # the KV prefix cache of a Hugging Face model
    ledger_blocks: int = Field(512, ge=1, le=4096)  # what each routing report carries
    # What tokens cost, by model id (serving._prices): the money each call saved in its event and metrics.
    prices: dict[str, Price] = Field(default_factory=dict)


    def block_extras(self) -> tuple[str, ...]:
        """What a block's hash binds besides its tokens and tenant: what changes the KV a block holds."""
        return (self.model.id, self.model.revision, self.model.dtype, self.kv.adapter if self.kv else "")


def same_answer(a: list[str | bytes], b: list[str | bytes]) -> bool:
    """The semantic judge: two answers agree when their texts do, however they were split into pieces, and
    so do their structured parts (an upstream engine's tool calls, say), usage and logprobs aside."""
    return _text(a) == _text(b) and _structure(a) == _structure(b)


def _text(pieces: list[str | bytes]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


def _structure(pieces: list[str | bytes]) -> list[Any]:
    parts = []
    for p in pieces:
        if isinstance(p, bytes):
            document = json.loads(p)
            if END in document:
                parts.append(document[END].get("finish_reason"))
            elif "delta" in document:
                parts.append(document["delta"])
    return parts


_END = object()


class _NoEngine:
    """The engine of a server that only looks up: asked for nothing, ever."""

    def __init__(self, pieces_are_tokens: bool) -> None:
        self.pieces_are_tokens = pieces_are_tokens

    def stream(self, prompt: str, input_ids: Any, params: Any) -> Iterator[str]:
        raise RuntimeError("a lookups-only server never generates")


def _status(decided: CallOutcome, control: CacheControl | None) -> str:
    """The call's ``CACHE_STATUS``: a miss under the client's no-store (its rule allowing it) is
    ``STORE-SKIPPED``, one whose lookup its no-cache skipped ``REFRESH``."""
    if decided.outcome == "hit":
        return "SEMANTIC HIT" if decided.reason == "semantic" else "HIT"
    if decided.outcome != "miss":
        return "BYPASS"
    if decided.reason == REFRESH:
        return "REFRESH"
    if control is not None and control.no_store:
        allowed = decided.decision.client_controls if decided.decision is not None else CLIENT_CONTROLS
        if "no-store" in allowed:
            return "STORE-SKIPPED"
    return "MISS"


_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, tuple[Counter, Counter, Counter]] = (
    weakref.WeakKeyDictionary())
_COUNTERS_LOCK = threading.Lock()


def _counters(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    """The serving counters of a runtime's registry, made once however many servers share the runtime: tokens
    and money saved by rule and tenant, and the upstream's failures by kind."""
    with _COUNTERS_LOCK:
        made = _COUNTERS.get(registry)
        if made is None:
            made = _COUNTERS[registry] = (
                Counter("evocache_tokens_saved", "Engine tokens the cache saved: a hit's prompt and completion, a "
                        "miss's prompt tokens the engine reused", ["rule", "tenant"], registry=registry),
                Counter("evocache_saved_cost", "Money the cache saved at the model's price (ServerSpec.prices)",
                        ["rule", "tenant"], registry=registry),
                Counter("evocache_upstream_errors", "Failed or retried calls to the upstream engine by kind: "
                        "refused (its 4xx), failed (its 5xx), transport, timeout, retried", ["kind"],
                        registry=registry),
            )
        return made


_RAW_PROMPT = ("messages", "prompt")


def _raw_prompt(request: GenerateRequest) -> Any:
    """The prompt as the client sent it (a chat's messages), which an upstream engine gets: another form of
    ``prompt`` for semantic matching, so a paraphrase's neighbours are not kept apart by it."""
    fields = request.fields or {}
    return fields.get("messages", fields.get("prompt"))


def _count(value: Any, default: int = 0) -> int:
    """A token count an upstream reported: a non-negative int, else ``default``."""
    return value if type(value) is int and value >= 0 else default


class ModelServer:
    def __init__(self, spec: ServerSpec, replica_id: str, *, generator: Generator | None = None,
                 tokenizer: Tokenizer | None = None, runtime: CacheRuntime | None = None) -> None:
        self.spec = spec
        self.replica_id = replica_id
        self.tokenizer = tokenizer or load_tokenizer(spec.model.tokenizer_source)
        self.generator = generator or load_generator(spec.model, self.tokenizer)
        self.runtime = runtime or build_runtime(spec.store)
        self.rollouts = RolloutRuntimes(self.runtime)
        self.ledger = BlockLedger(capacity_blocks=spec.ledger_blocks)
        # With a KV cache: each recorded checkpoint -> (its request's blocks, its index), so a report can say
        # whether L1 still holds the whole prefix the checkpoint names. Pruned to the ledger's blocks.
        self._chains: dict[bytes, tuple[tuple[BlockHash, ...], int]] = {}
        self._chains_lock = threading.Lock()
        self.kv: KvPrefixCache | None = None
        self.kv_metrics: KvMetrics | None = None
        if spec.kv is not None and isinstance(self.generator, HFGenerator):
            lower = {name: tier for name, tier in self.runtime.store.tiers.items() if name in ("l2", "l3")}
            geometry = BlockGeometry.of_model(self.generator.model, spec.block_size)
            self.kv = KvPrefixCache(spec.kv, geometry, extras=spec.block_extras(), device=self.generator.device,
                                    lower=lower)
            self.generator.attach_kv(self.kv)
            self.kv_metrics = KvMetrics(self.kv, self.runtime.metrics.registry)
        self.upstream = self.generator if isinstance(self.generator, UpstreamGenerator) else None
        # What the key binds of an upstream: where it is and its model's name there (from the spec, so a server
        # that only looks up, the ingress's, keys alike).
        upstream = spec.model.upstream
        self._upstream_id = f"{upstream.url} {upstream.model or spec.model.id}" if upstream is not None else ""
        self._salt_secret = b""
        if self.upstream is not None:
            self._salt_secret = entry_secret(spec.store)
            self.upstream.client.errors = _counters(self.runtime.metrics.registry)[2]
        self.price = spec.prices.get(spec.model.id)
        self._tokens_saved, self._cost_saved, upstream_errors = _counters(self.runtime.metrics.registry)
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        model = spec.model
        self.answer = cache_if(
            spec.contract,
            model=model.id,
            model_revision=model.revision,
            name=f"evocache.serving:{model.id}",
            admission=Admission(stream=True),
            semantic=SemanticOptions(text="prompt", text_forms=("input_ids", "raw_prompt"), judge=same_answer),
            ignore=("chunks", "blocks"),
            call_param="call",
        )(self._answer)
        self.policy_store = None
        self.follower: PolicyFollower | None = None
        if spec.policy_store is not None:
            self.policy_store = open_policy_store(spec.policy_store)
            self.follower = PolicyFollower(self.policy_store, replica_id, self.rollouts.apply,
                                           interval=spec.policy_store.poll_interval_s)
            self.follower.poll()  # the first rollout before the first request
            self.follower.start()

    @classmethod
    def lookups_only(cls, spec: ServerSpec, replica_id: str, tokenizer: Tokenizer) -> ModelServer:
        """A server that answers ``lookup`` and never runs the engine (a gateway's ingress): the same contract,
        key and policy as the model replicas, its own L1 and the spec's shared tiers, no policy follower of its
        own (its owner applies rollouts to ``rollouts``) and no engine loaded."""
        return cls(spec.model_copy(update={"policy_store": None}), replica_id,
                   generator=_NoEngine(spec.model.kind == "hf"), tokenizer=tokenizer)

    # The function the contract is enforced on; its parameters are the request view (but ``chunks``, which
    # only places KV chunk reuse, ``blocks``, the prompt's block hashes the ingress computed under the tenant's
    # salt, and ``call``, the cache's handle of this call).
    def _answer(self, prompt: str, input_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                top_k: int, seed: int | None, stop: list[str], endpoint: str, upstream: str, fields: dict[str, Any],
                raw_prompt: Any, cache_namespace: str, *, chunks: tuple[int, ...] = (), blocks: tuple[BlockHash, ...] = (),
                call: CallHandle) -> Iterator[str | bytes]:
        if self.upstream is not None:
            prompt_field = "messages" if endpoint == "chat" else "prompt"
            yield from self._upstream_answer(max_tokens, temperature, top_p, seed, stop, endpoint,
                                             {**fields, prompt_field: raw_prompt}, call)
            return
        params = GenerationParams(max_tokens, temperature, top_p, seed, tuple(stop))
        pieces: list[str] = []
        if self.kv is None:
            for piece in apply_stop(self.generator.stream(prompt, input_ids, params), stop):
                pieces.append(piece)
                yield piece
            self._report_usage(call, len(input_ids), self._completion_tokens(pieces, bool(stop)), 0)
            return
        assert call.decided is not None and self.kv_metrics is not None  # decided before the model runs
        usage = KvUsage()
        plan = self._kv_plan(call.decided, len(input_ids), chunks, blocks)
        if not plan.enabled:
            usage.miss = plan.reason
            usage.prompt_tokens = usage.recomputed = len(input_ids)
        for piece in apply_stop(self.generator.stream(prompt, input_ids, params, plan, usage), stop):
            pieces.append(piece)
            yield piece
        # The stream ran to its end: its usage is counted and travels in the call's outcome and kv event.
        self.kv_metrics.observe(usage)
        report = usage.report()
        call.report_kv(report)
        self._report_usage(call, len(input_ids), self._completion_tokens(pieces, bool(stop)), report.cached_tokens)

    def _report_usage(self, call: CallHandle, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """What this answer took (kept with its entry: what each hit on it saves) and what the engine's prefix
        reuse saved it, in tokens and, with a price for the model, in money."""
        price = self.price
        cost = price.full(prompt_tokens, completion_tokens) if price is not None else 0.0
        reused = price.reused(cached_tokens) if price is not None else 0.0
        call.report_usage(prompt_tokens + completion_tokens, cost, cached_tokens, reused)

    def _upstream_answer(self, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                         stop: list[str], endpoint: str, fields: dict[str, Any],
                         call: CallHandle) -> Iterator[str | bytes]:
        """The upstream engine's answer: the request's fields as the client sent them, the sampling fields as
        the ingress resolved them, and the tenant's ``cache_salt`` (a shared one when the rule's ``kv`` shares
        prefixes). Its end piece carries the engine's usage, reported as the call's KV usage."""
        assert self.upstream is not None and call.decided is not None  # decided before the engine runs
        body: dict[str, Any] = {**fields, "temperature": temperature, "top_p": top_p,
                                "max_completion_tokens" if endpoint == "chat" else "max_tokens": max_tokens}
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        if self.upstream.config.salt:
            decision = call.decided.decision
            shared = decision is not None and decision.kv is not None and decision.kv.shared_prefixes
            body["cache_salt"] = SHARED_SALT_VALUE if shared else tenant_salt(self._salt_secret, str(call.decided.ns))
        for piece in self.upstream.answer("chat" if endpoint == "chat" else "completions", body):
            if isinstance(piece, bytes) and piece.startswith(b'{"' + END.encode()):
                usage = json.loads(piece)[END]["usage"]
                prompt_tokens = _count(usage.get("prompt_tokens"))
                details = usage.get("prompt_tokens_details")
                cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
                call.report_kv(KvReport(prompt_tokens=prompt_tokens, cached_tokens=cached,
                                        tier="engine" if cached else None, load_ms=0.0, miss="",
                                        detail={"engine": "upstream", "cached_tokens": cached}))
                self._report_usage(call, prompt_tokens, _count(usage.get("completion_tokens")), cached)
            yield piece

    @staticmethod
    def _kv_plan(decided: CallOutcome, prompt_tokens: int, chunks: tuple[int, ...],
                 blocks: tuple[BlockHash, ...] = ()) -> KvPlan:
        """What the KV cache may do for this request: the rule's ``kv:`` as the policy resolved it for the call
        (``CallOutcome.decision``), or with no policy, prefix reuse in every tier. ``blocks``: the prompt's
        block hashes under the tenant's salt (the ingress's), reused unless the rule shares prefixes."""
        salt = str(decided.ns)
        if decided.decision is None:
            return KvPlan(salt=salt, hashes=blocks)
        spec = decided.decision.kv  # resolved: every field filled in; None when the rule switches KV reuse off
        if spec is None:
            return KvPlan(salt=salt, enabled=False, reason="off")
        if prompt_tokens < spec.min_tokens:
            return KvPlan(salt=salt, enabled=False, reason="below-min-tokens")
        return KvPlan(salt=SHARED_SALT if spec.shared_prefixes else salt, tiers=tuple(spec.tiers), mode=spec.reuse,
                      recompute_tokens=spec.recompute_tokens, recompute_fraction=float(spec.recompute_fraction),
                      chunks=chunks, hashes=() if spec.shared_prefixes else blocks)

    # -- requests ----------------------------------------------------------------------------------------

    def stream(self, request: GenerateRequest) -> Iterator[Decision | str | Finish]:
        """The ``Decision`` first (once the cache has looked up), then the answer's pieces, then ``Finish``.
        Lazy: each piece is computed when asked for, and closing the stream stops the model between two
        pieces (``serving._pump`` drives it so from asyncio)."""
        with self._inflight_lock:
            self._inflight += 1
        pieces = None
        try:
            arm, rt = self.rollouts.arm_for(request.rollout_key)
            kwargs = self._kwargs(request)
            with use_runtime(rt), tenant_scope(request.tenant, request.tenant_tier), cache_control(request.control):
                pieces = self.answer.call(**kwargs, chunks=request.chunks, blocks=request.blocks)
                self.rollouts.compare(self.answer, (), kwargs, base=rt)
                first = next(pieces, _END)  # the lookup runs here, under the client's directives
            handle = pieces.handle
            assert handle.decided is not None  # the cache decides every call before its first piece or its end
            yield self._decision(handle.decided, arm, request.control)
            yield from self._answer_items(first, pieces, request, lambda: handle.outcome)
        finally:
            if pieces is not None:  # closed early (a caller gone): the model stops here, between two pieces
                pieces.close()
            with self._inflight_lock:
                self._inflight -= 1

    def lookup(self, request: GenerateRequest) -> list[Decision | str | bytes | Finish] | None:
        """The items ``stream`` would give for an exact hit of ``request`` in this server's tiers, or None (with
        nothing recorded) when the request would run the engine: what a front end serves without a model
        replica (``CachedFunction.lookup``)."""
        arm, rt = self.rollouts.arm_for(request.rollout_key)
        with use_runtime(rt), tenant_scope(request.tenant, request.tenant_tier), cache_control(request.control):
            called = self.answer.lookup(**self._kwargs(request), chunks=request.chunks, blocks=request.blocks)
        if called is None:
            return None
        pieces = iter(called.value)
        return [self._decision(called.outcome, arm, request.control),
                *self._answer_items(next(pieces, _END), pieces, request, lambda: called.outcome)]

    def _answer_items(self, first: Any, pieces: Iterator[str | bytes], request: GenerateRequest,
                      outcome_of: Callable[[], CallOutcome | None]) -> Iterator[str | bytes | Finish]:
        """The answer's pieces as a client gets them (an upstream's end piece read, not forwarded), then its
        ``Finish``, counted once the pieces are out (``outcome_of``: the call's outcome by then)."""
        text = []
        end: dict[str, Any] | None = None
        piece = first
        while piece is not _END:
            if isinstance(piece, str):
                text.append(piece)
                yield piece
            elif piece.startswith(b'{"' + END.encode()):
                end = json.loads(piece)[END]
            else:
                yield piece
            piece = next(pieces, _END)
        self._served(request.blocks)
        outcome = outcome_of()
        if outcome is not None and (outcome.saved_tokens or outcome.saved_cost):
            self._tokens_saved.labels(outcome.rule, request.tenant).inc(outcome.saved_tokens)
            self._cost_saved.labels(outcome.rule, request.tenant).inc(outcome.saved_cost)
        if end is not None:
            yield self._upstream_finish(end, request, outcome)
            return
        completion = self._completion_tokens(text, bool(request.stop))
        cached = outcome.kv.cached_tokens if outcome is not None and outcome.kv is not None else 0
        yield Finish("length" if completion >= request.max_tokens else "stop", len(request.input_ids),
                     completion, cached)

    @staticmethod
    def _upstream_finish(end: dict[str, Any], request: GenerateRequest, outcome: CallOutcome | None) -> Finish:
        """The finish of an upstream answer from its end piece: the engine's finish reason and token counts;
        cached tokens: the whole prompt on a hit (nothing was computed), else what the engine reused."""
        usage = end.get("usage") or {}
        prompt_tokens = _count(usage.get("prompt_tokens"), len(request.input_ids))
        hit = outcome is not None and outcome.outcome == "hit"
        cached = prompt_tokens if hit else (outcome.kv.cached_tokens if outcome and outcome.kv else 0)
        return Finish(str(end.get("finish_reason") or "stop"), prompt_tokens,
                      _count(usage.get("completion_tokens")), cached)

    def feedback(self, request: GenerateRequest, correct: bool) -> bool:
        """Say whether the answer this replica served ``request`` semantically was right (a user's verdict):
        the semantic layer learns from it and the rule's SLO breaker counts it. False when this replica served
        no semantic answer for the request (an exact hit, a miss, another replica, or long ago)."""
        arm, rt = self.rollouts.arm_for(request.rollout_key)
        with use_runtime(rt), tenant_scope(request.tenant, request.tenant_tier):
            return self.answer.feedback(**self._kwargs(request), correct=correct)

    def _kwargs(self, request: GenerateRequest) -> dict[str, Any]:
        return {"prompt": request.prompt, "input_ids": list(request.input_ids), "max_tokens": request.max_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "top_k": 0, "seed": request.seed,
                "stop": list(request.stop), "endpoint": request.endpoint, "upstream": self._upstream_id,
                "fields": {k: v for k, v in (request.fields or {}).items() if k not in _RAW_PROMPT},
                "raw_prompt": _raw_prompt(request), "cache_namespace": request.cache_namespace}

    def _completion_tokens(self, pieces: list[str], stopped: bool) -> int:
        """A model's pieces are its tokens (unless stop sequences re-cut them); else the text's token count."""
        if self.generator.pieces_are_tokens and not stopped:
            return len(pieces)
        return len(self.tokenizer.encode("".join(pieces))) if pieces else 0

    def complete(self, request: GenerateRequest) -> Completion:
        return completion_of(self.stream(request))

    def _decision(self, decided: CallOutcome, arm: str, control: CacheControl | None = None) -> Decision:
        """What the response headers say: the call's decision (known once its first piece is out, or its
        stream ended), its status (``CACHE_STATUS``), the arm and this server."""
        return Decision(outcome=decided.outcome, tier=decided.tier or "", rule=decided.rule,
                        policy=decided.policy, arm=arm, replica=self.replica_id, reason=decided.reason,
                        status=_status(decided, control))

    # -- what the router, health checks and /metrics read -------------------------------------------------

    @property
    def queue_len(self) -> int:
        return self._inflight

    def _served(self, blocks: tuple[BlockHash, ...]) -> None:
        self.ledger.served(blocks)
        if self.kv is None or not blocks:
            return
        with self._chains_lock:
            for i in checkpoints(len(blocks)):
                self._chains[bytes(blocks[i])] = (blocks, i)
            if len(self._chains) > 4 * self.spec.ledger_blocks:  # no router asked for a while
                listed = {bytes.fromhex(h) for h in self.ledger.stats(0)[STATS_BLOCKS]}
                self._chains = {b: c for b, c in self._chains.items() if b in listed}

    def routing_stats(self) -> dict[str, Any]:
        """The router's report (``BlockLedger.stats``). With a KV cache, a served block is listed only while
        L1 holds every block of the prefix it names: the lookup stops at the first block it lacks, so a block
        whose leading blocks were evicted would draw requests to a replica that must recompute them."""
        stats = self.ledger.stats(self._inflight)
        if self.kv is None:
            return stats
        listed = [bytes.fromhex(h) for h in stats[STATS_BLOCKS]]
        with self._chains_lock:
            self._chains = chains = {b: self._chains[b] for b in listed if b in self._chains}
        held = self.kv.l1
        depth: dict[int, int] = {}  # id of a request's blocks -> how many of its leading blocks L1 holds
        kept = []
        for block in listed:
            if block not in chains:  # served before its chain was kept: the block alone
                if block in held:
                    kept.append(block.hex())
                continue
            chain, i = chains[block]  # kept alive by chains, so its id names it for this report
            n = depth.get(id(chain))
            if n is None:
                n = depth[id(chain)] = next((j for j, h in enumerate(chain) if h not in held), len(chain))
            if i < n:
                kept.append(block.hex())
        stats[STATS_BLOCKS] = kept
        return stats

    def kv_window(self) -> float | None:
        """Close the KV reuse-rate window (``evocache_kv_reuse_rate``); None without a KV cache."""
        return self.kv_metrics.window() if self.kv_metrics is not None else None

    def policy_ref(self) -> str:
        """The active version this replica enforces (``""`` before the first policy)."""
        return self.rollouts.active.policy_ref

    def metrics(self) -> bytes:
        return self.runtime.metrics.exposition()

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
        if self.follower is not None:
            self.follower.stop()
        if self.policy_store is not None:
            self.policy_store.close()
        if self.kv is not None:
            self.kv.close()  # waits for its L2/L3 writes, before the tiers close
        self.runtime.close()

