"""``@cache_if``: the decorator that enforces a dsl contract on a function.

    @cache_if("512 <= len(input_ids) <= 2048 and top_k <= 10", ttl="10m", model="llama-3-8b")
    def generate(input_ids: list[int], top_k: int = 0, temperature: float = 0.0) -> str: ...

At decoration time the contract is compiled against the request view the function can provide (its own
parameters plus ``tenant``, ``model`` and ``model_revision``); naming anything else is a ``ContractError`` there
and then (fail closed at import). At call time:

1. The request view is built once; the contract must hold, then the policy in force (if any) picks the first
   matching rule, whose values decide ttl, tiers, size limit, sampling and streams. Without a policy the
   decorator's own options decide.
2. A call that samples (``temperature > 0`` and no ``seed``) is bypassed unless allowed.
3. The key binds function, model, revision, template, normalised generation params, tenant namespace and the
   canonical arguments (``controller._keys``).
4. Exact lookup through the tiers; on a miss the function runs and its result is admitted by the rule.

The cache never fails a call: tier failures are misses (``TieredStore``), unserialisable results are rejected
and counted, a payload that does not decode is dropped and recomputed. Every decision emits an access event.
Plans (key and decision for one set of simple arguments, tenant and runtime generation) are memoised, so a
repeated call skips binding, the contract and hashing.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from evocache.dsl import (
    STANDARD_FIELDS,
    DslError,
    ExpressionEvalError,
    FieldType,
    Kind,
    RequestSchema,
    compile_expression,
    parse_duration,
)

from ._metrics import LATENCY_BUCKETS
from ._keys import GENERATION_PARAMS, Uncacheable, derive_key, namespace_for, normalise_params, template_hash
from ._runtime import CacheRuntime, current_runtime
from ._serialize import SERIALIZERS, Serializer, Unserializable, dump_chunks, load_chunks
from ._types import L1, CacheKey, Entry, Namespace, TierName
from .errors import ContractError

log = logging.getLogger("evocache.controller")

_VALID_TIERS = ("l1", "l2", "l3")
ANY_TYPE = FieldType(Kind.ANY)
_SIMPLE = frozenset({str, int, float, bool, type(None), bytes})
_MEMO_LIMIT = 8192
_IMMUTABLE_TAGS = frozenset(b"sb")  # payload tags of str and bytes values (controller._serialize)


def _memo_key(args: tuple, kwargs: dict, generation: int) -> tuple | None:
    """The plan memo's key for a call whose arguments are all simple immutable values, else None.

    Argument types are part of it: 1, 1.0 and True are equal and hash alike but key differently.
    """
    types_ = tuple(map(type, args))
    if kwargs:
        kw = tuple(kwargs.items())
        types_ += tuple(map(type, kwargs.values()))
    else:
        kw = ()
    if _SIMPLE.issuperset(types_):
        return (args, kw, types_, _current_tenant.get(), generation)
    return None


# --- tenants ---------------------------------------------------------------------------------------------


class Tenant(NamedTuple):
    """Who a call is for. A named tuple: it is part of every memo key, and tuples hash in C."""

    id: str = "default"
    tier: str = "default"

    def view(self) -> dict[str, str]:
        return {"id": self.id, "tier": self.tier}


DEFAULT_TENANT = Tenant()
_current_tenant: contextvars.ContextVar[Tenant] = contextvars.ContextVar("evocache_tenant", default=DEFAULT_TENANT)


@contextlib.contextmanager
def tenant_scope(tenant_id: str, tier: str = "default"):
    """Calls inside the block are made for ``tenant_id`` (unless a ``tenant`` argument says otherwise)."""
    namespace_for(tenant_id)  # validates
    token = _current_tenant.set(Tenant(tenant_id, tier))
    try:
        yield
    finally:
        _current_tenant.reset(token)


def _tenant_of(value: Any) -> Tenant:
    if isinstance(value, Tenant):
        return value
    if isinstance(value, str):
        return Tenant(value)
    if isinstance(value, Mapping) and isinstance(value.get("id"), str):
        return Tenant(value["id"], str(value.get("tier", "default")))
    raise TypeError(f"tenant must be a tenant id, a Tenant or a mapping with 'id', got {type(value).__qualname__}")


# --- the contract: which fields the function can provide ---------------------------------------------------

_ANNOTATION_KINDS: Mapping[Any, FieldType] = {
    int: FieldType(Kind.INT),
    float: FieldType(Kind.FLOAT),
    str: FieldType(Kind.STR),
    bool: FieldType(Kind.BOOL),
}


def _field_type(annotation: Any, name: str) -> FieldType:
    """The view type of a parameter: from its annotation where it maps, else the standard field's, else ANY."""
    if annotation is inspect.Parameter.empty:
        return STANDARD_FIELDS.get(name, ANY_TYPE)
    if isinstance(annotation, str):  # postponed annotations we cannot resolve safely: trust the standard name
        return STANDARD_FIELDS.get(name, ANY_TYPE)
    if annotation in _ANNOTATION_KINDS:
        return _ANNOTATION_KINDS[annotation]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _field_type(rest[0], "")
            return FieldType(inner.kind, item=inner.item, fields=inner.fields, optional=True)
        return ANY_TYPE
    if origin in (list, tuple, Sequence, typing.Sequence) or annotation in (list, tuple):
        item = _field_type(args[0], "") if args and args[0] is not Ellipsis else ANY_TYPE
        return FieldType(Kind.LIST, item=item)
    return ANY_TYPE


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature with annotations resolved where they can be (``from __future__ import annotations``
    makes them strings); one that names something undefined keeps its strings, which count as ``any``."""
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, SyntaxError, TypeError):
        return inspect.signature(fn)


def _guarded(predicate: Callable[[Mapping[str, Any]], bool]) -> Callable[[Mapping[str, Any]], bool]:
    """A user predicate whose failures read like an expression's: the call is served uncached, never failed."""

    def test(view: Mapping[str, Any]) -> bool:
        try:
            return predicate(view)
        except Exception as exc:  # noqa: BLE001 - the user's own code, at the boundary that must not fail a call
            raise ExpressionEvalError(f"predicate raised {type(exc).__name__}: {exc}", "<callable>") from exc

    return test


@dataclass(frozen=True, slots=True)
class _Options:
    ttl: float
    sliding: bool
    tiers: tuple[TierName, ...] | None
    max_entry_bytes: int | None
    allow_sampling: bool
    stream: bool


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one call will do: computed once per (arguments, tenant, runtime generation), then memoised."""

    key: CacheKey | None  # None: bypass
    ns: Namespace
    rule: str
    reason: str
    ttl: float = 0.0
    sliding: bool = False
    tiers: tuple[TierName, ...] = ()
    max_entry_bytes: int | None = None
    stream_ok: bool = True
    # Derived, read by the L1 hit path: whether L1 is asked first, and this plan's metric label tuples.
    l1_first: bool = field(init=False, default=False)
    hit_labels: tuple[str, str, str] = field(init=False, default=("", "", ""))

    def __post_init__(self) -> None:
        object.__setattr__(self, "l1_first", self.key is not None and bool(self.tiers) and self.tiers[0] == L1)
        object.__setattr__(self, "hit_labels", (self.rule, L1, "hit"))


_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class CacheInfo:
    hits: int
    misses: int
    bypasses: int
    stores: int
    rejects: int


class _Counters:
    __slots__ = ("hits", "misses", "bypasses", "stores", "rejects")

    def __init__(self) -> None:
        self.hits = self.misses = self.bypasses = self.stores = self.rejects = 0


# --- the decorator -----------------------------------------------------------------------------------------


def cache_if(
    condition: str | Callable[[Mapping[str, Any]], bool] = "true",
    *,
    ttl: str | float = "5m",
    sliding: bool = False,
    tiers: Sequence[str] | None = None,
    max_entry_bytes: int | None = None,
    allow_sampling: bool = False,
    stream: bool = True,
    model: str = "",
    model_revision: str = "",
    prompt_template: str | None = None,
    name: str | None = None,
    ignore: Sequence[str] = (),
    serializer: str | Serializer = "json",
    store: CacheRuntime | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Cache a function's results while ``condition`` holds for the call.

    ``condition`` is a policy-language expression over the request view, or a Python callable taking the view
    (a dict of the call's arguments plus ``tenant``, ``model``, ``model_revision``) and returning a bool.
    ``ttl`` is a duration (``"10m"``) or seconds; ``sliding`` renews it on every hit. ``tiers`` restricts the
    tiers written and read (default: every tier of the store). ``model``/``model_revision``/``prompt_template``
    are part of the key. ``ignore`` names parameters left out of the key and view (``self``, a logger).
    ``store`` pins a runtime (default: the process runtime, see ``configure``).

    Raises ``ContractError`` at decoration time for an invalid contract or option.
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        return CachedFunction(
            fn,
            condition=condition,
            options=_options(ttl, sliding, tiers, max_entry_bytes, allow_sampling, stream),
            model=model,
            model_revision=model_revision,
            template=template_hash(prompt_template),
            name=name,
            ignore=frozenset(ignore),
            serializer=_serializer(serializer),
            runtime=store,
        ).wrapper

    return decorate


def _options(ttl, sliding, tiers, max_entry_bytes, allow_sampling, stream) -> _Options:
    try:
        seconds = parse_duration(ttl)
    except (DslError, ValueError, TypeError) as exc:
        raise ContractError(f"ttl: {exc}") from exc
    if tiers is not None:
        unknown = [t for t in tiers if t not in _VALID_TIERS]
        if unknown or not tiers:
            raise ContractError(f"tiers: unknown {unknown}; known: {list(_VALID_TIERS)}")
    if max_entry_bytes is not None and max_entry_bytes <= 0:
        raise ContractError("max_entry_bytes must be positive")
    return _Options(
        ttl=seconds,
        sliding=bool(sliding),
        tiers=tuple(TierName(t) for t in tiers) if tiers is not None else None,
        max_entry_bytes=max_entry_bytes,
        allow_sampling=bool(allow_sampling),
        stream=bool(stream),
    )


def _serializer(spec: str | Serializer) -> Serializer:
    if isinstance(spec, str):
        try:
            return SERIALIZERS[spec]
        except KeyError:
            raise ContractError(f"serializer: unknown {spec!r}; known: {sorted(SERIALIZERS)}") from None
    return spec


class CachedFunction:
    """The state behind one decorated function. ``wrapper`` is what the decorator returns."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        condition: str | Callable[[Mapping[str, Any]], bool],
        options: _Options,
        model: str,
        model_revision: str,
        template: str,
        name: str | None,
        ignore: frozenset[str],
        serializer: Serializer,
        runtime: CacheRuntime | None,
    ) -> None:
        self.fn = fn
        self.identity = name or f"{fn.__module__}.{fn.__qualname__}"
        self.options = options
        self.model = model
        self.model_revision = model_revision
        self.template = template
        self.ignore = ignore
        self.serializer = serializer
        self.runtime = runtime
        self.signature = _signature(fn)
        self.schema = self._schema()
        self.condition_source = condition if isinstance(condition, str) else getattr(condition, "__name__", "callable")
        if isinstance(condition, str):
            try:
                expr = compile_expression(condition, self.schema)
            except DslError as exc:
                raise ContractError(f"@cache_if on {self.identity}: {exc}") from exc
            self._test: Callable[[Mapping[str, Any]], bool] = expr.test
        elif callable(condition):
            self._test = _guarded(condition)
        else:
            raise ContractError(f"@cache_if condition must be an expression or a callable, got {condition!r}")
        self._has_var_kw = any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())
        self._tenant_param = "tenant" in self.signature.parameters
        self._memo: dict[Any, _Plan] = {}
        self._memo_lock = threading.Lock()  # guards clearing; lookups and inserts are single dict operations
        # Decoded str/bytes values of recent L1 hits, by entry identity: immutable, so safe to hand out again.
        self._decoded: dict[tuple[Namespace, CacheKey], tuple[Entry, Any]] = {}
        self.counters = _Counters()
        self._hot_hit = self._make_hot_hit()
        self._bind = self._make_binder()
        self._warned: set[tuple[str, str]] = set()
        if inspect.isasyncgenfunction(fn):
            self.kind, wrapper = "asyncgen", self._wrap_asyncgen()
        elif inspect.iscoroutinefunction(fn):
            self.kind, wrapper = "async", self._wrap_async()
        elif inspect.isgeneratorfunction(fn):
            self.kind, wrapper = "gen", self._wrap_gen()
        else:
            self.kind, wrapper = "sync", self._wrap_sync()
        functools.update_wrapper(wrapper, fn)
        wrapper.cache_info = self.cache_info  # type: ignore[attr-defined]
        wrapper.cache_key = self.cache_key  # type: ignore[attr-defined]
        wrapper.invalidate = self.invalidate  # type: ignore[attr-defined]
        wrapper.bypass = self.bypass  # type: ignore[attr-defined]
        wrapper.refresh = self.refresh  # type: ignore[attr-defined]
        wrapper.cached_function = self  # type: ignore[attr-defined]
        self.wrapper = wrapper

    # -- decoration time ---------------------------------------------------------------------------------

    def _schema(self) -> RequestSchema:
        fields: dict[str, FieldType] = {}
        for pname, param in self.signature.parameters.items():
            if pname in self.ignore or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            fields[pname] = _field_type(param.annotation, pname)
        fields["tenant"] = STANDARD_FIELDS["tenant"]
        fields.setdefault("model", STANDARD_FIELDS["model"])
        fields.setdefault("model_revision", STANDARD_FIELDS["model_revision"])
        unknown = self.ignore - set(self.signature.parameters)
        if unknown:
            raise ContractError(f"@cache_if on {self.identity}: ignore names unknown parameters {sorted(unknown)}")
        return RequestSchema(fields)

    # -- planning ----------------------------------------------------------------------------------------

    def _plan(self, rt: CacheRuntime, args: tuple, kwargs: dict, memo_key: tuple | None = None) -> _Plan:
        if memo_key is None:
            memo_key = _memo_key(args, kwargs, rt.generation)
        if memo_key is not None:
            plan = self._memo.get(memo_key)
            if plan is not None:
                return plan
        plan = self._plan_slow(rt, args, kwargs, _current_tenant.get())
        if memo_key is not None:
            with self._memo_lock:
                if len(self._memo) >= _MEMO_LIMIT:
                    self._memo.clear()
                self._memo[memo_key] = plan
        return plan

    def _bind_slow(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], bool]:
        """Any signature, through ``inspect``: ``(arguments, tenant passed explicitly)``. A call that does not
        fit the signature raises the same ``TypeError`` the function would."""
        bound = self.signature.bind(*args, **kwargs)
        explicit_tenant = bound.arguments.get("tenant") is not None
        bound.apply_defaults()
        arguments: dict[str, Any] = {}
        for pname, value in bound.arguments.items():
            param = self.signature.parameters[pname]
            if param.kind is param.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[pname] = value
        return arguments, explicit_tenant

    def _make_binder(self) -> Callable[[tuple, dict], tuple[dict[str, Any], bool]]:
        """A binder for the common signature (named parameters only, no ``*args``/``**kwargs``, no
        positional-only), several times cheaper than ``Signature.bind``; anything unusual goes to
        ``_bind_slow``, which also produces the proper ``TypeError`` for a call that does not fit."""
        params = self.signature.parameters.values()
        if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
            return self._bind_slow
        positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        names = frozenset(p.name for p in params)
        defaults = tuple((p.name, p.default) for p in params if p.default is not p.empty)
        slow = self._bind_slow

        def bind(args: tuple, kwargs: dict) -> tuple[dict[str, Any], bool]:
            if len(args) > len(positional):
                return slow(args, kwargs)
            out = dict(zip(positional, args, strict=False))  # fewer args than parameters is fine
            for name, value in kwargs.items():
                if name in out or name not in names:
                    return slow(args, kwargs)
                out[name] = value
            explicit_tenant = out.get("tenant") is not None
            if len(out) < len(names):
                for name, default in defaults:
                    if name not in out:
                        out[name] = default
                if len(out) < len(names):  # a required argument is missing
                    return slow(args, kwargs)
            return out, explicit_tenant

        return bind

    def _plan_slow(self, rt: CacheRuntime, args: tuple, kwargs: dict, tenant: Tenant) -> _Plan:
        arguments, explicit_tenant = self._bind(args, kwargs)
        explicit_tenant = explicit_tenant and self._tenant_param
        for pname in self.ignore:
            arguments.pop(pname, None)
        # The tenant is not an argument of the key but its namespace: an explicit `tenant` argument names it,
        # else the enclosing tenant_scope, else the parameter's default, else "default".
        if explicit_tenant:
            tenant = _tenant_of(arguments.pop("tenant"))
        elif self._tenant_param:
            default = arguments.pop("tenant", None)
            if tenant is DEFAULT_TENANT and default is not None:
                tenant = _tenant_of(default)
        ns = namespace_for(tenant.id)
        view = dict(arguments)
        view["tenant"] = tenant.view()
        view.setdefault("model", self.model)
        view.setdefault("model_revision", self.model_revision)

        try:
            allowed = self._test(view)
        except ExpressionEvalError as exc:
            log.warning("%s: contract could not be evaluated, call not cached: %s", self.identity, exc.message)
            return _Plan(None, ns, "contract", "contract-error")
        if allowed is not True:
            return _Plan(None, ns, "contract", "contract")

        opts = self.options
        rule = self.identity
        tiers = opts.tiers
        ttl, sliding, max_bytes, allow_sampling, stream_ok = (
            opts.ttl, opts.sliding, opts.max_entry_bytes, opts.allow_sampling, opts.stream,
        )
        if rt.policy is not None:
            decision = rt.policy.decide(view)
            rule = decision.rule
            if decision.skipped:
                # A rule that could not be evaluated might have said bypass: fail closed, never past it.
                self._warn_once(rt, decision.skipped)
                return _Plan(None, ns, decision.skipped[0], "rule-error")
            if not decision.cache:
                return _Plan(None, ns, rule, "rule")
            ttl, sliding, max_bytes = decision.ttl, decision.sliding, decision.max_entry_bytes
            allow_sampling, stream_ok = decision.allow_sampling, decision.stream
            tiers = tuple(TierName(t) for t in decision.tiers)

        temperature = arguments.get("temperature")
        if (
            not allow_sampling
            and isinstance(temperature, (int, float))
            and temperature > 0
            and arguments.get("seed") is None
        ):
            return _Plan(None, ns, rule, "sampling")

        available = rt.tier_names
        chosen = tuple(t for t in (tiers or available) if t in available)
        if not chosen:
            return _Plan(None, ns, rule, "no-tier")
        params = {k: v for k, v in arguments.items() if k in GENERATION_PARAMS}
        rest = {k: v for k, v in arguments.items() if k not in GENERATION_PARAMS}
        model = arguments.get("model", self.model) if isinstance(arguments.get("model"), str) else self.model
        try:
            key = derive_key(
                function=self.identity,
                model=model,
                revision=self.model_revision,
                template=self.template,
                params=normalise_params(params),
                ns=ns,
                args=rest,
            )
        except Uncacheable as exc:
            log.debug("%s: %s", self.identity, exc)
            return _Plan(None, ns, rule, "uncacheable-args")
        return _Plan(key, ns, rule, "", ttl, sliding, chosen, max_bytes, stream_ok)

    def _warn_once(self, rt: CacheRuntime, rules: tuple[str, ...]) -> None:
        for rule in rules:
            if (rt.policy_ref, rule) not in self._warned:
                self._warned.add((rt.policy_ref, rule))
                log.warning(
                    "%s: rule %s of %s cannot be evaluated for this function's calls (a field it does not "
                    "provide?); such calls are not cached", self.identity, rule, rt.policy_ref,
                )

    # -- events ------------------------------------------------------------------------------------------

    def _emit(self, rt: CacheRuntime, plan: _Plan, outcome: str, tier: str | None, size: int,
              seconds: float, saved_ms: float = 0.0, reason: str = "") -> None:
        rt.metrics.record(plan.rule, tier, outcome, seconds)
        # A plain tuple in AccessEvent field order (see controller._events).
        rt.events.record((
            rt.clock(), plan.key or "", plan.ns, plan.rule, rt.policy_ref, outcome, tier, size,
            seconds * 1000.0, saved_ms, self.identity, reason or plan.reason, None,
        ))

    def _make_hot_hit(self) -> Callable[[CacheRuntime, tuple, dict], tuple[_Plan | None, tuple | None, Any]]:
        """The L1 hit path: memoised plan, lock-free L1 read (``MemoryTier.peek``), no store round trip.

        The returned function gives ``(plan, memo_key, value)``; ``value`` is ``_MISSING`` when the call must
        take the full path (no memoised plan, a rule that does not read L1 first, or no plain live L1 entry),
        and the plan and memo key found so far are handed on so nothing is computed twice. It runs on every
        call, so everything it reads is bound here once (a closure variable is cheaper than an attribute).
        For sync and async functions; streams take the full path.
        """
        memo_get = self._memo.get
        decoded = self._decoded
        loads = self.serializer.loads
        counters = self.counters
        identity = self.identity
        tenant_get = _current_tenant.get
        issimple = _SIMPLE.issuperset
        buckets = LATENCY_BUCKETS

        def hot_hit(rt: CacheRuntime, args: tuple, kwargs: dict) -> tuple[_Plan | None, tuple | None, Any]:
            # Inlined _memo_key: argument types are part of the key (1, 1.0 and True hash alike).
            types_ = tuple(map(type, args))
            if kwargs:
                kw = tuple(kwargs.items())
                types_ += tuple(map(type, kwargs.values()))
            else:
                kw = ()
            if not issimple(types_):
                return None, None, _MISSING
            memo_key = (args, kw, types_, tenant_get(), rt.generation)
            plan = memo_get(memo_key)
            l1 = rt.l1
            if plan is None or not plan.l1_first or l1 is None:
                return plan, memo_key, _MISSING
            clock = rt.clock
            now = clock()
            entry = l1.peek(plan.ns, plan.key, now)
            if entry is None:
                return plan, memo_key, _MISSING
            slot = (plan.ns, plan.key)
            cached = decoded.get(slot)
            if cached is not None and cached[0] is entry:
                value = cached[1]
            else:
                payload = entry.value
                try:
                    value = loads(payload)
                except ValueError:
                    return plan, memo_key, _MISSING  # the full path drops and counts it
                if payload and payload[0] in _IMMUTABLE_TAGS:
                    if len(decoded) >= _MEMO_LIMIT:
                        decoded.clear()
                    decoded[slot] = (entry, value)
            counters.hits += 1
            seconds = clock() - now
            metrics = rt.metrics  # inlined CacheMetrics.record
            cells = metrics.decisions.get(plan.hit_labels) or metrics.cells(plan.hit_labels)
            cells[bisect_left(buckets, seconds)] += 1
            cells[-1] += seconds
            rt.events.record((
                now, plan.key, plan.ns, plan.rule, rt.policy_ref, "hit", L1, len(entry.value), seconds * 1000.0,
                entry.saved_ms, identity, "", None,
            ))
            return plan, memo_key, value

        return hot_hit

    # -- lookup and admission (shared by every function kind) ---------------------------------------------

    def _lookup(self, rt: CacheRuntime, plan: _Plan, started: float) -> tuple[bool, Any]:
        """(hit, value). A payload that does not decode is deleted and counted, and the call is a miss."""
        found = rt.store.get(plan.ns, plan.key, plan.tiers)
        entry = found.entry
        if entry is not None:
            try:
                value = load_chunks(entry.value) if self.kind in ("gen", "asyncgen") else self.serializer.loads(
                    entry.value
                )
            except ValueError as exc:  # UnicodeDecodeError is one; serializers raise nothing else
                log.warning("%s: undecodable payload in %s dropped: %s", self.identity, found.tier, exc)
                rt.metrics.tier_fault(found.tier or "", "undecodable")
                rt.store.delete(plan.ns, [plan.key])
            else:
                self.counters.hits += 1
                self._emit(rt, plan, "hit", found.tier, entry.size, time.perf_counter() - started, entry.saved_ms)
                return True, value
        self.counters.misses += 1
        self._emit(rt, plan, "miss", None, 0, time.perf_counter() - started)
        return False, None

    def _admit(self, rt: CacheRuntime, plan: _Plan, payload: bytes | None, saved_ms: float, reason: str = "") -> None:
        started = time.perf_counter()
        if payload is None or (plan.max_entry_bytes is not None and len(payload) > plan.max_entry_bytes):
            self.counters.rejects += 1
            size = 0 if payload is None else len(payload)
            self._emit(rt, plan, "reject", None, size, time.perf_counter() - started, saved_ms,
                       reason or "too-large")
            return
        now = rt.clock()
        entry = Entry(
            value=payload,
            expires_at=now + plan.ttl,
            created_at=now,
            rule=plan.rule,
            saved_ms=saved_ms,
            sliding_ttl=plan.ttl if plan.sliding else None,
        )
        rt.store.set(plan.ns, plan.key, entry, plan.tiers)
        self.counters.stores += 1
        for tier in plan.tiers:
            rt.metrics.stored(plan.rule, tier, len(payload))
        self._emit(rt, plan, "store", ",".join(plan.tiers), len(payload), time.perf_counter() - started, saved_ms)

    def _encode(self, value: Any) -> tuple[bytes | None, str]:
        try:
            return self.serializer.dumps(value), ""
        except Unserializable as exc:
            log.debug("%s: result not cached: %s", self.identity, exc)
            return None, "unserializable"

    def _bypass(self, rt: CacheRuntime, plan: _Plan, started: float) -> None:
        self.counters.bypasses += 1
        self._emit(rt, plan, "bypass", None, 0, time.perf_counter() - started)

    def _start(self, args: tuple, kwargs: dict) -> tuple[CacheRuntime, _Plan, float]:
        started = time.perf_counter()
        rt = self.runtime or current_runtime()
        return rt, self._plan(rt, args, kwargs), started

    def _offload(self, rt: CacheRuntime) -> bool:
        """Whether an async caller should run store calls in a thread (anything beyond process memory)."""
        return any(name != L1 for name in rt.store.tiers)

    # -- wrappers ----------------------------------------------------------------------------------------

    def _wrap_sync(self) -> Callable[..., Any]:
        fn = self.fn

        hot_hit = self._hot_hit
        runtime = self.runtime

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rt = runtime or current_runtime()
            plan, memo_key, value = hot_hit(rt, args, kwargs)
            if value is not _MISSING:
                return value
            started = time.perf_counter()
            if plan is None:
                plan = self._plan(rt, args, kwargs, memo_key)
            if plan.key is None:
                self._bypass(rt, plan, started)
                return fn(*args, **kwargs)
            hit, value = self._lookup(rt, plan, started)
            if hit:
                return value
            return self._compute(rt, plan, args, kwargs)

        return wrapper

    def _compute(self, rt: CacheRuntime, plan: _Plan, args: tuple, kwargs: dict) -> Any:
        t0 = time.perf_counter()
        value = self.fn(*args, **kwargs)
        saved_ms = (time.perf_counter() - t0) * 1000.0
        payload, reason = self._encode(value)
        self._admit(rt, plan, payload, saved_ms, reason)
        return value

    def _wrap_async(self) -> Callable[..., Any]:
        fn = self.fn

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            rt = self.runtime or current_runtime()
            plan, memo_key, value = self._hot_hit(rt, args, kwargs)
            if value is not _MISSING:
                return value
            started = time.perf_counter()
            if plan is None:
                plan = self._plan(rt, args, kwargs, memo_key)
            if plan.key is None:
                self._bypass(rt, plan, started)
                return await fn(*args, **kwargs)
            offload = self._offload(rt)
            if offload:
                hit, value = await asyncio.to_thread(self._lookup, rt, plan, started)
            else:
                hit, value = self._lookup(rt, plan, started)
            if hit:
                return value
            t0 = time.perf_counter()
            value = await fn(*args, **kwargs)
            saved_ms = (time.perf_counter() - t0) * 1000.0
            payload, reason = self._encode(value)
            if offload:
                await asyncio.to_thread(self._admit, rt, plan, payload, saved_ms, reason)
            else:
                self._admit(rt, plan, payload, saved_ms, reason)
            return value

        return wrapper

    def _stream_payload(self, plan: _Plan, chunks: list) -> tuple[bytes | None, str]:
        if not plan.stream_ok:
            return None, "stream-not-allowed"
        try:
            return dump_chunks(chunks), ""
        except Unserializable:
            return None, "unserializable"

    def _wrap_gen(self) -> Callable[..., Any]:
        fn = self.fn

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rt, plan, started = self._start(args, kwargs)
            if plan.key is None:
                self._bypass(rt, plan, started)
                yield from fn(*args, **kwargs)
                return
            hit, chunks = self._lookup(rt, plan, started)
            if hit:
                yield from chunks
                return
            recorded: list = []
            t0 = time.perf_counter()
            # A stream that raises or is closed early never reaches _admit: partial streams are not stored.
            for chunk in fn(*args, **kwargs):
                recorded.append(chunk)
                yield chunk
            payload, reason = self._stream_payload(plan, recorded)
            self._admit(rt, plan, payload, (time.perf_counter() - t0) * 1000.0, reason)

        return wrapper

    def _wrap_asyncgen(self) -> Callable[..., Any]:
        fn = self.fn

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            rt, plan, started = self._start(args, kwargs)
            if plan.key is None:
                self._bypass(rt, plan, started)
                async for chunk in fn(*args, **kwargs):
                    yield chunk
                return
            offload = self._offload(rt)
            if offload:
                hit, chunks = await asyncio.to_thread(self._lookup, rt, plan, started)
            else:
                hit, chunks = self._lookup(rt, plan, started)
            if hit:
                for chunk in chunks:
                    yield chunk
                return
            recorded: list = []
            t0 = time.perf_counter()
            async for chunk in fn(*args, **kwargs):
                recorded.append(chunk)
                yield chunk
            payload, reason = self._stream_payload(plan, recorded)
            saved_ms = (time.perf_counter() - t0) * 1000.0
            if offload:
                await asyncio.to_thread(self._admit, rt, plan, payload, saved_ms, reason)
            else:
                self._admit(rt, plan, payload, saved_ms, reason)

        return wrapper

    # -- per-call controls -------------------------------------------------------------------------------

    def cache_info(self) -> CacheInfo:
        c = self.counters
        return CacheInfo(c.hits, c.misses, c.bypasses, c.stores, c.rejects)

    def cache_key(self, *args: Any, **kwargs: Any) -> CacheKey | None:
        """The key this call would use, or None when it would bypass the cache."""
        rt = self.runtime or current_runtime()
        return self._plan(rt, args, kwargs).key

    def invalidate(self, *args: Any, **kwargs: Any) -> bool:
        """Delete this call's entry from every tier. True when some tier held it."""
        rt = self.runtime or current_runtime()
        plan = self._plan(rt, args, kwargs)
        return plan.key is not None and rt.store.delete(plan.ns, [plan.key]) > 0

    def bypass(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function without reading or writing the cache (an event with reason ``caller``)."""
        rt, plan, started = self._start(args, kwargs)
        self.counters.bypasses += 1
        self._emit(rt, plan, "bypass", None, 0, time.perf_counter() - started, reason="caller")
        return self.fn(*args, **kwargs)

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        """Recompute and store, ignoring what is cached (sync and async functions)."""
        rt, plan, started = self._start(args, kwargs)
        if plan.key is None:
            self._bypass(rt, plan, started)
            return self.fn(*args, **kwargs)
        if self.kind == "async":
            return self._refresh_async(rt, plan, args, kwargs)
        if self.kind != "sync":
            raise TypeError("refresh() is for sync and async functions; for streams, invalidate() then call")
        return self._compute(rt, plan, args, kwargs)

    async def _refresh_async(self, rt: CacheRuntime, plan: _Plan, args: tuple, kwargs: dict) -> Any:
        t0 = time.perf_counter()
        value = await self.fn(*args, **kwargs)
        payload, reason = self._encode(value)
        await asyncio.to_thread(self._admit, rt, plan, payload, (time.perf_counter() - t0) * 1000.0, reason)
        return value
