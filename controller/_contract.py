"""What a ``@cache_if`` function may cache, and what one call will do: the contract and its plans.

The dsl room parses and type-checks the contract's expression; this module gives it the request view the
function can provide (its parameters, typed from their annotations, plus ``tenant``, ``model`` and
``model_revision``) and turns each call into a ``Plan``: the key, the namespace and the rule's decision. Plans
are memoised per (simple arguments, tenant, runtime generation), so a repeated call skips binding, the
contract, the policy and hashing. A condition (expression or Python callable) must therefore be a pure
function of the view: it is evaluated once per distinct call, and again only when the runtime changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import inspect
import logging
import math
import threading
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, NamedTuple

from evocache.dsl import (
    STANDARD_FIELDS,
    Decision,
    DslError,
    ExpressionEvalError,
    FieldType,
    Kind,
    RequestSchema,
    compile_expression,
    SemanticSpec,
    parse_duration,
)

from ._keys import (
    ANONYMOUS_NS,
    GENERATION_PARAMS,
    Uncacheable,
    as_real,
    derive_key,
    exact_str,
    namespace_for,
    normalise_params,
)
from ._runtime import CacheRuntime
from ._semantic import TEXT_PARAMS, SemanticPlan
from .semantic._config import DEFAULT_JUDGE_BUDGET
from ._types import L1, CacheKey, Namespace, TierName
from .errors import ContractError

log = logging.getLogger("evocache.controller")

VALID_TIERS = ("l1", "l2", "l3")
ANY_TYPE = FieldType(Kind.ANY)
SIMPLE_TYPES = frozenset({str, int, float, bool, type(None), bytes})
# The plan memo holds its calls' arguments: bounded in plans and in argument bytes (prompts can be long).
MEMO_LIMIT = 8192
MEMO_BYTES = 32 << 20
# A plan keeps the decoded value of its last L1 hit only for payloads this small, so the memo never holds
# more than MEMO_LIMIT * DECODED_MAX_BYTES of values that L1 may have evicted since.
DECODED_MAX_BYTES = 4096
# Code that is not Python source: named by module and qualified name (str.upper, len, a module).
_BUILTIN_CODE = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
    types.ModuleType,
)


def function_identity(fn: Callable[..., Any], name: str | None) -> str:
    """The identity a function's keys bind: ``name`` if given; else module and qualified name, a digest of
    the function's code, and, for a closure, of what it captured.

    The code digest tells apart functions that share a qualified name (two lambdas of one module, the
    variants defined in two branches) and retires a function's entries when its code changes. A closure's
    captured data counts by its canonical form and captured functions by their own identity, so two closures
    from one factory never share entries; captured data without a canonical form (a lock, a client, a bound
    method) is a ``ContractError``: give such a function a ``name=`` that tells its variants apart.
    """
    if name:
        return name
    identity = f"{fn.__module__}.{fn.__qualname__}"
    try:
        captured = _captured(fn, depth=0)
        digest = derive_key(function=identity, model="", revision="", template=_code_digest(fn.__code__),
                            params=(), ns=Namespace("-"), args=captured)
    except Uncacheable as exc:
        raise ContractError(
            f"@cache_if on {identity}: the closure captures something without a canonical form ({exc}); "
            "pass name=... to identify this variant of the function"
        ) from exc
    return f"{identity}#{digest[:16]}"


def _code_digest(code: types.CodeType) -> str:
    """Bytecode, names and constants of ``code`` and the code nested in it: what the function computes."""
    parts = [code.co_code.hex(), repr(code.co_names), repr(code.co_varnames), repr(code.co_freevars)]
    for const in code.co_consts:
        parts.append(_code_digest(const) if isinstance(const, types.CodeType) else repr(const))
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _captured(fn: Callable[..., Any], depth: int) -> dict[str, Any]:
    """A closure's captured variables in canonical-ready form; functions stand for their own identity."""
    if depth > 4:
        raise Uncacheable("closures nested deeper than 4")
    out: dict[str, Any] = {}
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            value = cell.cell_contents
        except ValueError:  # not bound yet (a recursive reference to itself)
            continue
        if isinstance(value, types.FunctionType):
            out[var] = ("fn", value.__module__, value.__qualname__, _code_digest(value.__code__),
                        _captured(value, depth + 1))
        elif isinstance(value, _BUILTIN_CODE):
            name = getattr(value, "__qualname__", None) or value.__name__
            out[var] = ("builtin", getattr(value, "__module__", None) or "", name)
        elif isinstance(value, type):
            out[var] = ("class", value.__module__, value.__qualname__)
        elif isinstance(value, types.MethodType):
            raise Uncacheable(f"{var!r} is a bound method, whose object has no canonical form")
        else:
            out[var] = value
    return out


def _approx_bytes(args: tuple, kwargs: dict) -> int:
    size = 64
    for value in (*args, *kwargs.values()):
        if type(value) is str or type(value) is bytes:
            size += len(value)
    return size


# --- tenants ---------------------------------------------------------------------------------------------


class Tenant(NamedTuple):
    """Who a call is for. A named tuple: it is part of every memo key, and tuples hash in C."""

    id: str = "default"
    tier: str = "default"

    def view(self) -> dict[str, str]:
        return {"id": self.id, "tier": self.tier}


DEFAULT_TENANT = Tenant()
# None outside any tenant_scope: "no scope" must stay distinguishable from a scope for the tenant "default",
# because only the former lets a `tenant` parameter's default name the tenant. Part of every memo key.
current_tenant: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("evocache_tenant", default=None)


@contextlib.contextmanager
def tenant_scope(tenant_id: str, tier: str = "default") -> Iterator[None]:
    """Calls inside the block are made for ``tenant_id`` (unless a ``tenant`` argument says otherwise)."""
    namespace_for(tenant_id)  # validates
    token = current_tenant.set(Tenant(exact_str(tenant_id), tier))
    try:
        yield
    finally:
        current_tenant.reset(token)


def _tenant_of(value: Any) -> Tenant:
    if isinstance(value, Tenant):
        return Tenant(exact_str(value.id), value.tier)
    if isinstance(value, str):
        return Tenant(exact_str(value))
    if isinstance(value, Mapping) and isinstance(value.get("id"), str):
        return Tenant(exact_str(value["id"]), str(value.get("tier", "default")))
    raise TypeError(f"tenant must be a tenant id, a Tenant or a mapping with 'id', got {type(value).__qualname__}")


# --- the request view the function can provide ----------------------------------------------------------

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


def signature_of(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature with annotations resolved where they can be (``from __future__ import annotations``
    makes them strings); one that names something undefined keeps its strings, which count as ``any``."""
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, SyntaxError, TypeError):
        return inspect.signature(fn)


def _without(signature: inspect.Signature, supplied: str | None, identity: str) -> inspect.Signature:
    """The signature callers see: without ``supplied``, the parameter the cache fills in (``call_param``),
    which must be a named parameter of the function."""
    if supplied is None:
        return signature
    param = signature.parameters.get(supplied)
    if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
        raise ContractError(f"@cache_if on {identity}: call_param {supplied!r} is not a named parameter of the "
                            f"function; parameters: {list(signature.parameters)}")
    params = list(signature.parameters.values())
    after = params[params.index(param) + 1:]
    if param.kind is param.POSITIONAL_OR_KEYWORD and any(p.kind is p.POSITIONAL_OR_KEYWORD for p in after):
        raise ContractError(f"@cache_if on {identity}: call_param {supplied!r} is passed by keyword: make it "
                            "keyword-only (after *) or the last positional parameter")
    return signature.replace(parameters=[p for p in params if p is not param])


def _guarded(predicate: Callable[[Mapping[str, Any]], bool]) -> Callable[[Mapping[str, Any]], bool]:
    """A user predicate whose failures read like an expression's: the call is served uncached, never failed."""

    def test(view: Mapping[str, Any]) -> bool:
        try:
            return predicate(view)
        except Exception as exc:  # noqa: BLE001 - the user's own code, at the boundary that must not fail a call
            raise ExpressionEvalError(f"predicate raised {type(exc).__name__}: {exc}", "<callable>") from exc

    return test


def _samples(temperature: Any) -> bool:
    """Whether a call at this temperature may sample: unless it is provably greedy (absent, or a number <= 0,
    read by ``as_real``: numpy scalars, 0-d arrays, ``Decimal``, numeric strings). A temperature that reads
    as no number (an object, ``"hot"``, an array of several) or as NaN is not provably greedy."""
    if temperature is None:
        return False
    value = as_real(temperature)
    return value is None or not value <= 0.0


@dataclass(frozen=True, slots=True)
class Admission:
    """What the decorator decides beside ``ttl`` when no policy is in force (a policy's rule decides these
    instead): ``sliding`` renews the ttl on every hit; ``tiers`` restricts the tiers written and read (default:
    every tier of the store); ``max_entry_bytes`` rejects larger results; ``allow_sampling`` caches calls that
    may sample; ``stream=False`` leaves streams uncached.

    Checked when made: a bad value is a ``ContractError`` naming it (a misspelt field, Python's ``TypeError``).
    """

    sliding: bool = False
    tiers: tuple[TierName, ...] | None = None
    max_entry_bytes: int | None = None
    allow_sampling: bool = False
    stream: bool = True

    def __post_init__(self) -> None:
        for flag, value in (("sliding", self.sliding), ("allow_sampling", self.allow_sampling),
                            ("stream", self.stream)):
            if not isinstance(value, bool):
                raise ContractError(f"admission: {flag} must be a bool, got {value!r}")
        tiers = self.tiers
        if tiers is not None:
            if isinstance(tiers, str) or not isinstance(tiers, Sequence):
                raise ContractError(f"admission: tiers must be a list of tier names, got {tiers!r}")
            unknown = [t for t in tiers if t not in VALID_TIERS]
            if unknown or not tiers:
                raise ContractError(f"admission: tiers: unknown {unknown}; known: {list(VALID_TIERS)}")
            object.__setattr__(self, "tiers", tuple(TierName(t) for t in tiers))
        size = self.max_entry_bytes
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, Integral) or size <= 0:
                raise ContractError(f"admission: max_entry_bytes must be a positive int or None, got {size!r}")
            object.__setattr__(self, "max_entry_bytes", int(size))

    @classmethod
    def of(cls, value: Admission | Mapping[str, Any] | None) -> Admission:
        """``admission=`` as given to ``cache_if``: an ``Admission``, a mapping of its fields, or None."""
        return _options_of(cls, "admission", value)


@dataclass(frozen=True, slots=True)
class SemanticOptions:
    """Semantic matching for one function (for a stream, answers are chunk lists: the judge compares those).

    ``max_error``, ``mode``, ``explore``, ``threshold``: the decorator's own setting, the fields of a policy
    rule's ``semantic:`` (``controller._semantic``), used when no policy is in force; ``max_error=None`` (or 0)
    leaves matching off unless a rule turns it on. ``text`` names the prompt parameter (default: ``prompt``,
    ``query`` or ``text``); ``text_forms`` names parameters that carry the same prompt in another form (its token
ids), so they are left out of the semantic boundary with it. ``judge(new_answer, cached_answer) -> bool`` says whether two answers are
    equivalent (default ``==``): it is how the cache learns which prompts share an answer. ``judge_links``
    bounds the other answer clusters a miss's answer is judged against (None: all of them, up to 9; 0: the
    candidate only); ``judge_budget`` the judge calls per semantic lookup on average (default 2; at least 1,
    a miss's own verdict; None: no bound), for a judge that is costly (a model call).

    Checked when made: a bad value is a ``ContractError`` naming it (a misspelt field, a ``TypeError``).
    """

    max_error: float | None = None
    mode: str | None = None
    explore: float | None = None
    threshold: float | None = None
    text: str | None = None
    text_forms: tuple[str, ...] = ()
    judge: Callable[[Any, Any], bool] | None = None
    judge_links: int | None = None
    judge_budget: float | None = DEFAULT_JUDGE_BUDGET
    spec: SemanticSpec | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        written = {"max_error": self.max_error, "mode": self.mode, "explore": self.explore,
                   "threshold": self.threshold}
        if self.max_error is None:
            given = [k for k, v in written.items() if v is not None]
            if given:
                raise ContractError(f"semantic: {given} need a max_error")
        else:
            try:
                spec = SemanticSpec.model_validate({k: v for k, v in written.items() if v is not None})
            except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
                raise ContractError(f"semantic: {exc}") from exc
            object.__setattr__(self, "spec", spec.resolved())
        if self.text is not None and not isinstance(self.text, str):
            raise ContractError(f"semantic: text must be a parameter name, got {self.text!r}")
        forms = self.text_forms
        if isinstance(forms, str) or not all(isinstance(f, str) for f in forms):
            raise ContractError(f"semantic: text_forms must be a sequence of parameter names, got {forms!r}")
        object.__setattr__(self, "text_forms", tuple(forms))
        if self.judge is not None and not callable(self.judge):
            raise ContractError(f"semantic: judge must be callable, got {self.judge!r}")
        links = self.judge_links
        if links is not None:
            if isinstance(links, bool) or not isinstance(links, Integral) or links < 0:
                raise ContractError(f"semantic: judge_links must be an int >= 0 or None, got {links!r}")
            object.__setattr__(self, "judge_links", int(links))
        budget = self.judge_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, Real) or not 1 <= budget < math.inf:
                raise ContractError(
                    f"semantic: judge_budget must be a number of judge calls per lookup >= 1, or None, got {budget!r}"
                )
            object.__setattr__(self, "judge_budget", float(budget))

    @classmethod
    def of(cls, value: SemanticOptions | Mapping[str, Any] | None) -> SemanticOptions:
        """``semantic=`` as given to ``cache_if``: a ``SemanticOptions``, a mapping of its fields
        (``{"max_error": 0.02, "judge": same_answer}``), or None."""
        return _options_of(cls, "semantic", value)


def _options_of(cls: type, keyword: str, value: Any) -> Any:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise TypeError(f"{keyword}: unknown option(s) {unknown}; known: {known}")
        return cls(**value)
    raise TypeError(
        f"{keyword}= takes {cls.__name__}(...) or a mapping of its fields, got {type(value).__qualname__}"
    )


@dataclass(frozen=True, slots=True)
class Options:
    """The decorator's own decision, used when no policy is in force: its ttl, admission and semantic setting."""

    ttl: float
    sliding: bool
    tiers: tuple[TierName, ...] | None
    max_entry_bytes: int | None
    allow_sampling: bool
    stream: bool
    semantic: SemanticSpec | None = None  # resolved (SemanticSpec.resolved); off unless given or a rule says so

    @classmethod
    def validated(
        cls, ttl: str | float, admission: Admission = Admission(), semantic: SemanticSpec | None = None
    ) -> Options:
        """Options from the decorator's arguments; ``ContractError`` names the bad one."""
        try:
            seconds = parse_duration(ttl)
        except (DslError, ValueError, TypeError) as exc:
            raise ContractError(f"ttl: {exc}") from exc
        return cls(
            ttl=seconds,
            sliding=admission.sliding,
            tiers=admission.tiers,
            max_entry_bytes=admission.max_entry_bytes,
            allow_sampling=admission.allow_sampling,
            stream=admission.stream,
            semantic=semantic,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """What one call will do: computed once per (arguments, tenant, runtime generation), then memoised.

    ``key`` is ``None`` for a bypass, with ``reason`` saying why (``contract``, ``contract-error``, ``rule``,
    ``rule-error``, ``sampling``, ``no-tier``, ``uncacheable-args``); a ``rule`` or ``sampling`` bypass has
    ``would_key``, the key it would have if it were cached (what its access event names). ``decision`` is what the policy in force
    decided for the call's view, every section resolved (``kv`` included, which an engine reads from the
    call's outcome), also when the contract or the rule bypasses; None without a policy, or when no view
    could be built (a bad tenant). The policy decides once per call: nothing else asks it again.
    """

    key: CacheKey | None
    ns: Namespace
    rule: str
    reason: str
    ttl: float = 0.0
    sliding: bool = False
    tiers: tuple[TierName, ...] = ()
    max_entry_bytes: int | None = None
    stream_ok: bool = True
    # For the L1 hit path: the metric cells an L1 hit of this plan counts in (the runtime's metrics: a plan
    # lives only as long as its runtime generation). Derived: the L1 slot and whether L1 is asked first.
    hit_cells: list[float] | None = field(default=None, compare=False)
    # After an exact miss: the semantic lookup this call may make (None: exact matching only).
    semantic: SemanticPlan | None = field(default=None, compare=False)
    # (entry, value): the last L1 entry this plan decoded and its value, kept when the value is immutable
    # (str, bytes) so a hit on the same entry object hands it out again. The one field that changes after
    # construction: the L1 hit path swaps the whole pair (one attribute store, so readers see either pair).
    decoded: tuple[Any, Any] = field(default=(None, None), compare=False)
    decision: Decision | None = field(default=None, compare=False)
    # For the L1 hit path: the tally its hits of this tenant's calls count in for the rule's SLO breaker
    # (None: the rule has no p99 objective; controller._slo.SloBreakers.l1_tally).
    slo_hits: list[float] | None = field(default=None, compare=False)
    would_key: CacheKey | None = None
    slot: tuple[Namespace, CacheKey] | None = field(init=False, default=None)
    # (rule, ns): what the hit path looks for among the SLO breakers tripped to bypass.
    tenant_rule: tuple[str, Namespace] | None = field(init=False, default=None)
    l1_first: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.key is not None:
            object.__setattr__(self, "slot", (self.ns, self.key))
            object.__setattr__(self, "tenant_rule", (self.rule, self.ns))
            object.__setattr__(self, "l1_first", bool(self.tiers) and self.tiers[0] == L1 and self.hit_cells is not None)


def memo_key(args: tuple, kwargs: dict, generation: int) -> tuple | None:
    """The plan memo's key for a call whose arguments are all simple immutable values, else None.

    Argument types are part of it: 1, 1.0 and True are equal and hash alike but key differently. (-0.0 and
    0.0 are one argument here as in ``controller._keys``.) The L1 hit path inlines this; keep them alike.
    """
    types_ = tuple(map(type, args))
    if kwargs:
        kw = tuple(kwargs.items())
        types_ += tuple(map(type, kwargs.values()))
    else:
        kw = ()
    if SIMPLE_TYPES.issuperset(types_):
        return (args, kw, types_, current_tenant.get(), generation)
    return None


# --- the contract ------------------------------------------------------------------------------------------


class Contract:
    """One function's contract: its request view, its condition, its options and its memoised plans.

    Raises ``ContractError`` at construction (decoration time) for a condition that names a field the
    function cannot provide, a type error in it, or an ``ignore`` naming no parameter.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        condition: str | Callable[[Mapping[str, Any]], bool],
        options: Options,
        *,
        identity: str,
        model: str,
        model_revision: str,
        template: str,
        ignore: frozenset[str],
        supplied: str | None = None,
        semantic_text: str | None = None,
        semantic_text_forms: tuple[str, ...] = (),
    ) -> None:
        self.identity = identity
        self.options = options
        self.model = model
        self.model_revision = model_revision
        self.template = template
        self.ignore = ignore
        self.signature = _without(signature_of(fn), supplied, identity)
        self.schema = self._schema()
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
        self._tenant_param = "tenant" in self.signature.parameters
        self.semantic_text = self._semantic_text(semantic_text)
        for form in semantic_text_forms:
            if form not in self.signature.parameters or form in self.ignore or form == self.semantic_text:
                raise ContractError(
                    f"@cache_if on {self.identity}: semantic text_forms {form!r} is not another parameter the "
                    f"key sees; parameters: {[p for p in self.signature.parameters if p not in self.ignore]}"
                )
        # The prompt and its other forms: what a semantic neighbour may differ in.
        self._prompt_params = frozenset((self.semantic_text, *semantic_text_forms))
        # Generation parameters go into the key normalised; with **kwargs any of them may arrive.
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())
        self._generation_params = tuple(
            name for name in GENERATION_PARAMS if has_var_kw or name in self.signature.parameters
        )
        self.memo: dict[Any, Plan] = {}
        self._memo_bytes = 0
        self._memo_lock = threading.Lock()  # guards clearing; lookups and inserts are single dict operations
        self._bind = self._make_binder()
        self._warned: set[tuple[str, str]] = set()

    def _semantic_text(self, name: str | None) -> str | None:
        """The parameter whose value is the prompt for semantic matching; ``ContractError`` for a name the
        function does not have (or ignores)."""
        params = self.signature.parameters
        if name is None:
            found = next((p for p in TEXT_PARAMS if p in params and p not in self.ignore), None)
            if found is None and self.options.semantic is not None:
                raise ContractError(
                    f"@cache_if on {self.identity}: semantic matching needs the prompt: name its parameter with "
                    f"semantic={{'text': ...}} (none of {list(TEXT_PARAMS)} is a parameter)"
                )
            return found
        if name not in params or name in self.ignore or name == "tenant":
            raise ContractError(
                f"@cache_if on {self.identity}: semantic text {name!r} is not a parameter the key "
                f"sees; parameters: {[p for p in params if p not in self.ignore]}"
            )
        return name

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

    def plan(self, rt: CacheRuntime, args: tuple, kwargs: dict, key: tuple | None = None) -> Plan:
        """The plan of one call, memoised when its arguments allow (``key``: its memo key, if known)."""
        if key is None:
            key = memo_key(args, kwargs, rt.generation)
        if key is not None:
            plan = self.memo.get(key)
            if plan is not None:
                return plan
        plan = self._plan(rt, args, kwargs, current_tenant.get())
        if key is not None:
            size = _approx_bytes(args, kwargs)
            with self._memo_lock:
                if len(self.memo) >= MEMO_LIMIT or self._memo_bytes + size > MEMO_BYTES:
                    self.memo.clear()
                    self._memo_bytes = 0
                self.memo[key] = plan
                self._memo_bytes += size
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

    def _plan(self, rt: CacheRuntime, args: tuple, kwargs: dict, scope: Tenant | None) -> Plan:
        arguments, explicit_tenant = self._bind(args, kwargs)
        explicit_tenant = explicit_tenant and self._tenant_param
        for pname in self.ignore:
            arguments.pop(pname, None)
        # The tenant is not an argument of the key but its namespace: an explicit `tenant` argument names it,
        # else the enclosing tenant_scope, else the parameter's default, else "default".
        # A call made for no tenant has the view of tenant "default" but a namespace of its own, which no
        # tenant id can name: tenant "default" never reads the anonymous caller's entries, nor they its.
        given = arguments.pop("tenant", None) if self._tenant_param else None
        try:
            if explicit_tenant or (scope is None and given is not None):
                tenant = _tenant_of(given)
                ns = namespace_for(tenant.id)
            elif scope is not None:
                tenant, ns = scope, namespace_for(scope.id)
            else:
                tenant, ns = DEFAULT_TENANT, ANONYMOUS_NS
        except Exception as exc:  # noqa: BLE001 - a TypeError or ValueError, or the argument's own code raised
            # The function may accept what the cache cannot scope: serve it, uncached.
            log.warning("%s: tenant argument not usable for caching (%s); call not cached", self.identity, exc)
            return Plan(None, ANONYMOUS_NS, "contract", "bad-tenant")
        view = dict(arguments)
        view["tenant"] = tenant.view()
        view.setdefault("model", self.model)
        view.setdefault("model_revision", self.model_revision)

        # The policy decides once, before the contract's verdict, so the call's outcome carries the rule's
        # resolved sections (kv reuse applies to calls the response cache may not store).
        decision = rt.policy.decide(view) if rt.policy is not None else None
        try:
            allowed = self._test(view)
        except ExpressionEvalError as exc:
            log.warning("%s: contract could not be evaluated, call not cached: %s", self.identity, exc.message)
            return Plan(None, ns, "contract", "contract-error", decision=decision)
        if allowed is not True:
            return Plan(None, ns, "contract", "contract", decision=decision)

        opts = self.options
        rule = self.identity
        tiers = opts.tiers
        ttl, sliding, max_bytes, allow_sampling, stream_ok = (
            opts.ttl, opts.sliding, opts.max_entry_bytes, opts.allow_sampling, opts.stream,
        )
        semantic_spec = opts.semantic
        if decision is not None:
            rule = decision.rule
            if decision.skipped:
                # A rule that could not be evaluated might have said bypass: fail closed, never past it.
                self._warn_once(rt, decision.skipped)
                return Plan(None, ns, decision.skipped[0], "rule-error", decision=decision)
            if not decision.cache:
                return Plan(None, ns, rule, "rule", decision=decision, would_key=self._would_key(arguments, ns))
            ttl, sliding, max_bytes = decision.ttl, decision.sliding, decision.max_entry_bytes
            allow_sampling, stream_ok = decision.allow_sampling, decision.stream
            tiers = tuple(TierName(t) for t in decision.tiers)
            semantic_spec = decision.semantic

        if not allow_sampling and arguments.get("seed") is None and _samples(arguments.get("temperature")):
            return Plan(None, ns, rule, "sampling", decision=decision, would_key=self._would_key(arguments, ns))

        available = rt.tier_names
        chosen = tuple(t for t in (tiers or available) if t in available)
        if not chosen:
            return Plan(None, ns, rule, "no-tier", decision=decision)
        try:
            key, normalised, rest, model = self._key(arguments, ns)
        except Uncacheable as exc:
            log.debug("%s: %s", self.identity, exc)
            return Plan(None, ns, rule, "uncacheable-args", decision=decision)
        semantic = None
        if semantic_spec is not None:
            parts = dict(
                function=self.identity, model=model, revision=self.model_revision, template=self.template,
                params=normalised, ns=ns,
            )
            semantic = self._semantic_plan(rt, rule, parts, rest, semantic_spec, chosen)
        # The L1 hit path needs a MemoryTier as L1 (its lock-free peek); any other "l1" takes the full path.
        hit_cells = rt.metrics.cells((rule, L1, "hit")) if chosen[0] == L1 and rt.l1 is not None else None
        slo_hits = rt.slo.l1_tally(rule, ns) if hit_cells is not None else None
        return Plan(key, ns, rule, "", ttl, sliding, chosen, max_bytes, stream_ok, hit_cells, semantic,
                    decision=decision, slo_hits=slo_hits)

    def _key(self, arguments: dict[str, Any], ns: Namespace) -> tuple[CacheKey, Any, dict[str, Any], str]:
        """The call's key, with its normalised generation parameters, its other arguments and its model;
        ``Uncacheable`` when an argument has no canonical form."""
        rest = dict(arguments)
        params = {name: rest.pop(name) for name in self._generation_params if name in rest}
        model = arguments.get("model", self.model) if isinstance(arguments.get("model"), str) else self.model
        normalised = normalise_params(params)
        key = derive_key(
            function=self.identity, model=model, revision=self.model_revision, template=self.template,
            params=normalised, ns=ns, args=rest,
        )
        return key, normalised, rest, model

    def _would_key(self, arguments: dict[str, Any], ns: Namespace) -> CacheKey | None:
        """The key a call its rule (or its sampling) keeps out of the cache would have: the call's event
        carries it, so the policy loop can tell how often such calls repeat. None when none can be made."""
        try:
            return self._key(arguments, ns)[0]
        except Uncacheable:
            return None

    def _semantic_plan(
        self, rt: CacheRuntime, rule: str, parts: dict[str, Any], rest: dict[str, Any], spec: SemanticSpec,
        tiers: tuple[TierName, ...],
    ) -> SemanticPlan | None:
        """The semantic lookup of a call whose rule allows one: the prompt, and the boundary = the key of every
        other part of the call (so a neighbour differs from this call in its prompt alone)."""
        name = self.semantic_text
        text = rest.get(name) if name is not None else None
        if not isinstance(text, str):
            if (rt.policy_ref, rule, "semantic") not in self._warned:
                self._warned.add((rt.policy_ref, rule, "semantic"))
                log.warning(
                    "%s: rule %s asks for semantic matching, but the call has no str prompt (semantic text %r); "
                    "exact matching only", self.identity, rule, name,
                )
            return None
        others = {k: v for k, v in rest.items() if k not in self._prompt_params}
        boundary = derive_key(**parts, args=others)  # cannot raise: a subset of what just hashed
        return SemanticPlan(text, boundary, spec, tuple(tiers))

    def _warn_once(self, rt: CacheRuntime, rules: tuple[str, ...]) -> None:
        for rule in rules:
            if (rt.policy_ref, rule) not in self._warned:
                self._warned.add((rt.policy_ref, rule))
                log.warning(
                    "%s: rule %s of %s cannot be evaluated for this function's calls (a field it does not "
                    "provide?); such calls are not cached", self.identity, rule, rt.policy_ref,
                )
