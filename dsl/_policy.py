"""Policy documents: the validated, immutable, versioned rules that decide what is cached and how.

A document is YAML (see ``examples/policies/``). ``parse_policy`` / ``load_policy`` read it safely,
validate it into a frozen ``Policy`` and compile every rule's ``when`` against the standard request schema
extended with the document's ``fields``. Every problem found, schema or expression, is reported in one
``PolicyError`` whose issues name file, line, column and field path (``rules[0].ttl``); a document either
loads whole or not at all.

``Policy.decide(view)`` picks the first rule whose ``when`` holds and returns a ``Decision`` with the rule's
values merged over the defaults.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from os import PathLike
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal, NewType, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    Strict,
    ValidationError,
    ValidationInfo,
    WrapSerializer,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from ._compiler import compile_expression
from ._duration import format_duration, parse_duration
from ._functions import MAX_PROGRAM_SIZE
from ._schema import ANY, STANDARD_FIELDS, STANDARD_SCHEMA, TYPE_NAMES, FieldType, RequestSchema
from ._source import read_policy_text
from ._yaml import LocatedDocument, Path, format_path, load_located
from .errors import ExpressionError, ExpressionEvalError, PolicyError, PolicyIssue, brief

if TYPE_CHECKING:
    from ._compiler import Expression

PolicyRef = NewType("PolicyRef", str)  # "chat-prod@7": what replicas report and access events carry

TIERS = ("l1", "l2", "l3")
# Longest ttl: 10 years. Every tier stores it as an expiry (Redis as milliseconds from now, which overflows
# near 2**63 ms and then fails every write), and no cached answer is meant to outlive this.
MAX_TTL = 3650 * 86_400.0
# Versions are counters; this keeps one a signed 32-bit integer in every store and wire format.
MAX_VERSION = 2**31 - 1
DEFAULT_RULE = "default"  # Decision.rule when no rule matched; so no rule may be called this
DEFAULT_TENANT = "default"  # the tenants entry that holds for every tenant without one of its own
# A policy is a few dozen rules, and a decision may test every one: a request must not wait on thousands.
# parse_policy refuses more before validating any; the model's own bound covers Policy.model_validate.
MAX_RULES = 1000


# --- value types ------------------------------------------------------------------------------------------


def _check_name(value: str) -> str:
    # Names end up in refs ("name@7"), diff paths ("rules[name].ttl") and metric labels: keep them plain.
    if not (0 < len(value) <= 64 and value[0].isascii() and value[0].isalnum()) or not all(
        c.isascii() and (c.isalnum() or c in "-_.") for c in value
    ):
        raise ValueError(
            f"invalid name {brief(value)}: use letters, digits, '-', '_' and '.', starting with a "
            "letter or digit, at most 64 characters"
        )
    return value


def _check_identifier(value: str) -> str:
    if not (value.isascii() and value.isidentifier()) or keyword.iskeyword(value):
        raise ValueError(f"invalid name {brief(value)}: expected an identifier such as lru or s3fifo")
    return value


def _check_tier(value: str) -> str:
    if value not in TIERS:
        raise ValueError(f"unknown tier {brief(value)}; known tiers: {', '.join(TIERS)}")
    return value


def _normalise_tiers(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ValueError(f"list at least one tier ({', '.join(TIERS)})")
    if len(set(value)) != len(value):
        raise ValueError(f"tier listed twice in {list(value)}")
    # Lookups always go l1 → l2 → l3, so the written order carries no meaning; sorting keeps diffs quiet.
    return tuple(sorted(value, key=TIERS.index))


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"a ttl must be positive; got {brief(value)}")
    if seconds > MAX_TTL:
        raise ValueError(f"a ttl may be at most {format_duration(MAX_TTL)} (10 years); got {brief(value)}")
    return seconds


def _check_field_name(value: str) -> str:
    _check_identifier(value)
    if value in STANDARD_FIELDS:
        raise ValueError(f"{brief(value)} is a standard request field; declare only extra fields")
    return value


def _check_type_name(value: str) -> str:
    if value not in TYPE_NAMES:
        raise ValueError(f"unknown type {brief(value)}; known types: {', '.join(TYPE_NAMES)}")
    return value


def _bool_condition(value: object) -> object:
    # `when: true` reads as a YAML boolean; as a condition it means the expression `true` (a catch-all rule).
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def _frozen_mapping(value: dict[str, Any]) -> Mapping[str, Any]:
    # Sorted: the order of tenants or declared fields carries no meaning, so it must not show in a diff.
    return MappingProxyType(dict(sorted(value.items())))


def _dump_mapping(value: Mapping[str, Any], handler: Any) -> Any:
    return handler(dict(value))


Name = Annotated[str, Strict(), AfterValidator(_check_name)]
Identifier = Annotated[str, Strict(), AfterValidator(_check_identifier)]
Tier = Annotated[str, Strict(), AfterValidator(_check_tier)]
Tiers = Annotated[tuple[Tier, ...], AfterValidator(_normalise_tiers)]
Duration = Annotated[
    float,
    BeforeValidator(_positive_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
Bool = Annotated[bool, Strict()]
Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]  # strict float still takes ints; it refuses strings and booleans
Share = Annotated[Number, Field(ge=0, le=1)]
CacheMode = Literal["response", "bypass"]
# The directives a caller may give one call (HTTP Cache-Control, a gateway's body object): serve without
# storing, store without serving, a bound on the served entry's age, a shorter ttl for what it stores.
ClientControl = Literal["no-store", "no-cache", "max-age", "ttl"]
CLIENT_CONTROLS: tuple[str, ...] = ("no-store", "no-cache", "max-age", "ttl")
FieldName = Annotated[str, Strict(), AfterValidator(_check_field_name)]
TypeName = Annotated[str, Strict(), AfterValidator(_check_type_name)]
FrozenMapping = WrapSerializer(_dump_mapping)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- the document -----------------------------------------------------------------------------------------


SEMANTIC_EXPLORE = 0.05  # fraction of would-be semantic hits that also call the model when a rule says nothing
MAX_SEMANTIC_ERROR = 0.5  # beyond this a "bound" would allow serving more wrong answers than right ones


class SemanticSpec(_Model):
    """Semantic matching: reuse the answer to a similar prompt while the error rate stays below ``max_error``.

    ``mode: bounded`` (the default) decides with a model of the error learned online from judge observations,
    exploring a fraction ``explore`` of would-be hits; ``mode: static`` serves any neighbour at cosine
    similarity >= ``threshold`` (for comparison; ``max_error`` is then only the bound it is measured against).
    ``max_error: 0`` switches semantic matching off (so a rule can override defaults that switch it on).
    ``mode`` and ``explore`` stay None when not written, so the normalised document shows only what was
    written; ``Decision`` carries the resolved spec (``resolved()``).
    """

    max_error: Annotated[Number, Field(ge=0, le=MAX_SEMANTIC_ERROR)]
    mode: Literal["bounded", "static"] | None = None
    explore: Annotated[Number, Field(ge=0, le=0.5)] | None = None
    threshold: Annotated[Number, Field(gt=0, le=1)] | None = None

    @field_validator("threshold")
    @classmethod
    def _threshold_only_static(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("mode", "static") != "static":
            raise ValueError("threshold applies only to mode: static (mode: bounded learns its own cut-off)")
        return value

    @model_validator(mode="after")
    def _static_needs_threshold(self) -> SemanticSpec:
        if self.mode == "static" and self.threshold is None:
            raise ValueError("mode: static needs a threshold (a cosine similarity in (0, 1])")
        return self

    def resolved(self) -> SemanticSpec | None:
        """This spec as a request runs it: None when it switches matching off (``max_error: 0``), else with
        ``mode`` and ``explore`` filled in (``bounded``, ``SEMANTIC_EXPLORE``) where not written."""
        if self.max_error == 0:
            return None
        if self.mode is not None and self.explore is not None:
            return self
        return self.model_copy(update={
            "mode": self.mode or "bounded",
            "explore": SEMANTIC_EXPLORE if self.explore is None else self.explore,
        })


KV_RECOMPUTE_TOKENS = 16  # leading tokens of each reused chunk recomputed when a rule says nothing (EPIC)
# Token counts a kv section states; a signed 32-bit integer, as versions, in every store and wire format.
MAX_KV_TOKENS = 2**31 - 1
KvTokens = Annotated[Int, Field(ge=0, le=MAX_KV_TOKENS)]
_KV_CHUNK_FIELDS = ("recompute_tokens", "recompute_fraction")  # meaningful with reuse: chunks only


def _kv_reuse(value: object) -> object:
    # `reuse: off` reads as the YAML boolean false; `none` is the earlier spelling of off.
    if value is False or value == "none":
        return "off"
    return value


KvReuse = Literal["prefix", "chunks", "off"]


class KvSpec(_Model):
    """KV cache reuse: which cached keys and values a request may reuse and fill, and where they live.

    ``reuse: prefix`` reuses the blocks of a cached prefix at the same positions (exact); ``chunks`` also
    reuses a cached chunk (a message, a document) at another position by re-rotating its keys (RoPE shift),
    an approximation that recomputes the first ``recompute_tokens`` tokens of each reused chunk and a share
    ``recompute_fraction`` of its tokens chosen by the cache; ``off`` switches reuse off (``none``, the
    earlier spelling, reads as ``off``). ``tiers``: where KV blocks may live (default: the decision's tiers).
    A prompt shorter than ``min_tokens`` neither uses nor fills the KV cache. ``shared_prefixes`` salts a
    request's first block with a namespace shared by every tenant instead of the tenant's own.

    ``rope_shift`` is the earlier spelling of the mode: ``true`` reads as ``reuse: chunks`` (also beside
    ``reuse: prefix``, the only mode there was), ``false`` as ``reuse: prefix``; beside ``reuse: off`` it
    changes nothing, and ``rope_shift: false`` beside ``reuse: chunks`` is an error. The normalised document
    shows the ``reuse`` it implies; a resolved spec states it (True for chunks, else False).
    ``recompute_tokens`` and ``recompute_fraction`` other than 0 with a reuse other than chunks are errors.

    Every field stays None when not written, so the normalised document shows only what was written;
    ``over`` merges a rule's spec over the defaults' and ``resolved`` fills in the rest.
    """

    reuse: Annotated[KvReuse, BeforeValidator(_kv_reuse)] | None = None
    rope_shift: Bool | None = None
    tiers: Tiers | None = None
    min_tokens: KvTokens | None = None
    shared_prefixes: Bool | None = None
    recompute_tokens: KvTokens | None = None
    recompute_fraction: Share | None = None

    @field_validator("rope_shift")
    @classmethod
    def _rope_shift_matches_reuse(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is False and info.data.get("reuse") == "chunks":
            raise ValueError(
                "rope_shift: false contradicts reuse: chunks, which reuses a chunk at another position by "
                "re-rotating its keys; write reuse: prefix for exact prefix reuse alone"
            )
        return value

    @field_validator(*_KV_CHUNK_FIELDS)
    @classmethod
    def _only_for_chunks(cls, value: float | None, info: ValidationInfo) -> float | None:
        # A reuse left out is inherited, so only Policy can tell (_kv_issues); an invalid reuse or rope_shift
        # is absent from info.data and reported alone.
        if "reuse" not in info.data or "rope_shift" not in info.data:
            return value
        reuse, rope_shift = info.data["reuse"], info.data["rope_shift"]
        if rope_shift is not None and reuse != "off":
            reuse = "chunks" if rope_shift else "prefix"
        if value and reuse is not None and reuse != "chunks":
            raise ValueError(_kv_chunks_only(info.field_name or "", reuse))
        return value

    @model_validator(mode="after")
    def _reuse_from_rope_shift(self) -> KvSpec:
        if self.rope_shift is not None and self.reuse != "off":
            object.__setattr__(self, "reuse", "chunks" if self.rope_shift else "prefix")
        return self

    def over(self, base: KvSpec | None) -> KvSpec:
        """This spec's written fields over ``base``'s: a rule's ``kv`` over the defaults'."""
        if base is None:
            return self
        written = self.model_dump(exclude_none=True)
        return base.model_copy(update=written) if written else base

    def resolved(self, tiers: tuple[str, ...]) -> KvSpec | None:
        """This spec as a request runs it: None when reuse is off, else with every field filled in: ``reuse``
        ``prefix``, ``tiers`` the decision's ``tiers``, ``min_tokens`` 0, ``shared_prefixes`` false,
        ``rope_shift`` whether ``reuse`` is ``chunks``, and for chunks ``recompute_tokens``
        ``KV_RECOMPUTE_TOKENS`` and ``recompute_fraction`` 0 (for prefix both 0: nothing is recomputed)."""
        reuse = self.reuse or "prefix"
        if reuse == "off":
            return None
        chunks = reuse == "chunks"
        return self.model_copy(update={
            "reuse": reuse,
            "rope_shift": chunks,
            "tiers": tiers if self.tiers is None else self.tiers,
            "min_tokens": self.min_tokens or 0,
            "shared_prefixes": bool(self.shared_prefixes),
            "recompute_tokens": 0 if not chunks else (
                KV_RECOMPUTE_TOKENS if self.recompute_tokens is None else self.recompute_tokens
            ),
            "recompute_fraction": (self.recompute_fraction or 0.0) if chunks else 0.0,
        })


def _kv_chunks_only(field: str, reuse: str) -> str:
    return f"{field} applies only to reuse: chunks (it recomputes part of a reused chunk); reuse is {reuse}"


SLO_WINDOW = 60.0  # seconds of measurements a rule is judged on, when its slo says nothing
SLO_MIN_SAMPLES = 20  # fewer measurements than this in the window judge nothing
SLO_COOL_DOWN = 30.0  # seconds a tripped rule runs in safe mode before it is probed
SLO_PROBE = 0.1  # fraction of a half-open rule's requests that run normally, as probes
# Tenants whose own breakers must be open at once before a rule trips for every tenant: one tenant (or two
# keys of one customer) cannot switch off what the others are served.
SLO_RULE_WIDE_TENANTS = 3
MAX_RULE_WIDE_TENANTS = 1000  # the controller keeps at least this many tenants' breakers per rule
MAX_SLO_SPAN = 86_400.0  # a window or cool-down longer than a day would judge, or punish, yesterday's traffic
MAX_SLO_SAMPLES = 1_000_000


def _slo_span(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be a positive duration; got {brief(value)}")
    if seconds > MAX_SLO_SPAN:
        raise ValueError(f"may be at most {format_duration(MAX_SLO_SPAN)}; got {brief(value)}")
    return seconds


SloSpan = Annotated[
    float,
    BeforeValidator(_slo_span),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
TripTo = Literal["semantic-off", "bypass"]


class SloSpec(_Model):
    """Service objectives: the policy loop watches them during a canary, and the controller enforces them per
    rule and tenant (``controller._slo``).

    Over the last ``window`` of one tenant's requests of a rule, with at least ``min_samples`` measurements,
    the tenant's breaker of the rule trips when the share of wrong answers among its semantic verdicts exceeds
    ``max_error_rate`` or the p99 of its lookup latency exceeds ``p99_ms``. A tripped breaker runs that
    tenant's requests of the rule in safe mode for ``cool_down`` (``trip_to``: ``semantic-off`` keeps exact
    caching and drops semantic lookups, ``bypass`` skips the cache), then a fraction ``probe`` of them run
    normally until their measurements say whether it closes or opens again. While at least
    ``rule_wide_tenants`` tenants' breakers of a rule are open, the rule runs in safe mode for every tenant.
    The policy's ``slo`` applies to every rule; a rule's own ``slo`` overrides it field by field.

    Every field stays None when not written, so the normalised document shows only what was written;
    ``over`` merges a rule's spec over the policy's and ``resolved`` fills in the defaults (``SLO_*``).
    """

    p99_ms: Annotated[Number, Field(gt=0, allow_inf_nan=False)] | None = None
    max_error_rate: Share | None = None
    window: SloSpan | None = None
    min_samples: Annotated[Int, Field(ge=1, le=MAX_SLO_SAMPLES)] | None = None
    cool_down: SloSpan | None = None
    trip_to: TripTo | None = None
    probe: Annotated[Number, Field(gt=0, le=1)] | None = None
    rule_wide_tenants: Annotated[Int, Field(ge=1, le=MAX_RULE_WIDE_TENANTS)] | None = None

    @property
    def objectives(self) -> bool:
        """Whether this spec sets an objective to enforce (``p99_ms`` or ``max_error_rate``)."""
        return self.p99_ms is not None or self.max_error_rate is not None

    def over(self, base: SloSpec) -> SloSpec:
        """This spec's written fields over ``base``'s: a rule's ``slo`` over the policy's."""
        written = self.model_dump(exclude_none=True)
        return base.model_copy(update=written) if written else base

    def resolved(self) -> SloSpec:
        """This spec with every field but the objectives filled in (``SLO_WINDOW``, ``SLO_MIN_SAMPLES``,
        ``SLO_COOL_DOWN``, ``semantic-off``, ``SLO_PROBE``, ``SLO_RULE_WIDE_TENANTS``) where not written."""
        return self.model_copy(update={
            "window": SLO_WINDOW if self.window is None else self.window,
            "min_samples": SLO_MIN_SAMPLES if self.min_samples is None else self.min_samples,
            "cool_down": SLO_COOL_DOWN if self.cool_down is None else self.cool_down,
            "trip_to": self.trip_to or "semantic-off",
            "probe": SLO_PROBE if self.probe is None else self.probe,
            "rule_wide_tenants": (
                SLO_RULE_WIDE_TENANTS if self.rule_wide_tenants is None else self.rule_wide_tenants
            ),
        })


class Defaults(_Model):
    """Values for requests no rule matches, and for every setting a matching rule leaves out."""

    cache: CacheMode = "response"
    ttl: Duration = 300.0
    tiers: Tiers = ("l1",)
    max_entry_bytes: Annotated[Int, Field(gt=0)] | None = None
    allow_sampling: Bool = False
    stream: Bool = True
    semantic: SemanticSpec | None = None
    kv: KvSpec | None = None
    client_controls: tuple[ClientControl, ...] | None = None  # None: every one of CLIENT_CONTROLS


class Rule(_Model):
    """One rule: when ``when`` holds for a request, the rule's settings apply; the ones it leaves out (None)
    come from ``defaults``. ``sliding`` (renew the ttl on every hit) is off unless a rule turns it on."""

    name: Name
    when: Annotated[str, BeforeValidator(_bool_condition), Strict(), Field(min_length=1)]
    cache: CacheMode | None = None
    ttl: Duration | None = None
    sliding: Bool | None = None
    tiers: Tiers | None = None
    max_entry_bytes: Annotated[Int, Field(gt=0)] | None = None
    allow_sampling: Bool | None = None
    stream: Bool | None = None
    semantic: SemanticSpec | None = None
    kv: KvSpec | None = None
    slo: SloSpec | None = None  # over the policy's slo, field by field (SloSpec.over)
    client_controls: tuple[ClientControl, ...] | None = None  # the directives a caller may give ([]: none)

    @model_validator(mode="before")
    @classmethod
    def _count(cls, data: Any, info: ValidationInfo) -> Any:
        check = _load_check(info)
        if check is not None:
            check.rule_index += 1
        return data

    @field_validator("name")
    @classmethod
    def _unique_name(cls, value: str, info: ValidationInfo) -> str:
        if value == DEFAULT_RULE:
            raise ValueError(f"{DEFAULT_RULE!r} is reserved: it names the defaults in decisions")
        check = _load_check(info)
        if check is not None:
            first = check.rule_names.setdefault(value, check.rule_index)
            if first != check.rule_index:
                raise ValueError(f"duplicate rule name {value!r} (first used by rules[{first}])")
        return value

    @field_validator("when")
    @classmethod
    def _compile_when(cls, value: str, info: ValidationInfo) -> str:
        check = _load_check(info)
        if check is not None:
            try:
                compile_expression(value, check.schema)
            except ExpressionError as exc:
                raise PydanticCustomError(
                    "expression", "{message}", {"message": exc.message, "error": exc}
                ) from None
        # Trailing newlines from `|` blocks are not part of the condition; leading text is kept as written
        # so that error columns still match the document.
        return value.rstrip()


class TenantSpec(_Model):
    """A tenant's shares of the L1 and L2 capacity (1.0: no quota), its weight against other tenants, its
    request rate: ``rate`` requests per second, ``burst`` at once (a token bucket; default ``max(1, rate)``,
    filled in when a rate is written), and ``max_prompt_tokens``, the most tokens its prompts may hold (the
    serving ingress refuses a longer one before any replica works on it; None: no bound of its own). No
    ``rate``: the tenant is not rate-limited, and a ``burst`` without one is an error."""

    l1_share: Share = 1.0
    l2_share: Share = 1.0
    weight: Annotated[Number, Field(gt=0)] = 1.0
    rate: Annotated[Number, Field(gt=0, allow_inf_nan=False)] | None = None
    burst: Annotated[Number, Field(ge=1, allow_inf_nan=False)] | None = None
    max_prompt_tokens: Annotated[Int, Field(ge=1)] | None = None

    @field_validator("burst")
    @classmethod
    def _burst_needs_rate(cls, value: float | None, info: ValidationInfo) -> float | None:
        # "rate" is absent from info.data when it was written but invalid: that is reported at rate alone.
        if value is not None and "rate" in info.data and info.data["rate"] is None:
            raise ValueError("burst needs a rate (requests per second) to refill it")
        return value

    @model_validator(mode="after")
    def _default_burst(self) -> TenantSpec:
        if self.rate is not None and self.burst is None:
            object.__setattr__(self, "burst", max(1.0, self.rate))
        return self


_MODEL_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,122}\.json")


def _check_model_file(value: str) -> str:
    if not _MODEL_FILE.fullmatch(value):
        raise ValueError(
            f"model {brief(value)} is not a model file name: letters, digits, '.', '_' and '-' ending in "
            "'.json', at most 128 characters, no directory (the store's l1.models directory holds it)"
        )
    return value


ModelFile = Annotated[str, Strict(), AfterValidator(_check_model_file)]


class EvictionSpec(_Model):
    """Eviction policy per tier, by name; ``fallback`` serves while a learned policy is unavailable. Names are
    only checked to be identifiers here: the controller checks them against its registry.

    ``model``: the file of a trained model for ``l1: learned`` to start from (a name in the store's
    ``l1.models`` directory, as ``evocache agent`` writes them); without it a learned policy starts from
    nothing and ``fallback`` decides until it has trained."""

    l1: Identifier | None = None
    l2: Identifier | None = None
    l3: Identifier | None = None
    fallback: Identifier = "lru"
    model: ModelFile | None = None

    @field_validator("model")
    @classmethod
    def _model_needs_learned(cls, value: str | None, info: ValidationInfo) -> str | None:
        # "l1" is absent from info.data when it was written but invalid: that is reported at l1 alone.
        if value is not None and "l1" in info.data and info.data["l1"] != "learned":
            raise ValueError(f"a model is a learned policy's: it needs l1: learned, not l1: {info.data['l1']}")
        return value

    def per_tier(self) -> dict[str, str]:
        """``{tier: policy name}`` for the tiers this spec sets (``fallback`` is not a tier)."""
        return {tier: name for tier in TIERS if (name := getattr(self, tier)) is not None}


class AutoApprove(_Model):
    """Changes small enough for the policy loop to roll out without a person (each still goes through replay
    evidence, a canary and the SLO watch). A change of a kind left unset here waits for a person.

    ``ttl_change``: the largest relative change of a rule's ttl. ``semantic_error_change``: the largest
    absolute change of a rule's ``semantic.max_error`` (and a static threshold's move). ``bypass``: may turn a
    rule whose traffic never hits to ``cache: bypass``. ``eviction``: may change an eviction policy.
    ``tenant_share_change``: the largest absolute change of a tenant's ``l1_share``/``l2_share``.
    ``min_tokens_change``: the largest relative change of a rule's KV ``min_tokens``. ``min_gain``: the least
    hit-ratio gain (absolute, the lower end of its confidence interval) a change must show in replay.
    """

    ttl_change: Annotated[Number, Field(ge=0)] | None = None
    semantic_error_change: Annotated[Number, Field(ge=0, le=MAX_SEMANTIC_ERROR)] | None = None
    bypass: Bool = False
    eviction: Bool = False
    tenant_share_change: Share | None = None
    min_tokens_change: Annotated[Number, Field(ge=0)] | None = None
    min_gain: Share = 0.0


class CanarySpec(_Model):
    """How the loop rolls out an approved change: ``fraction`` of requests (by key, the policy store's canary)
    for at least ``windows`` windows. Over the same windows, it is rolled back when it breaks the policy's SLOs,
    or its hit ratio is shown (the whole bootstrap interval) to be more than ``max_drop`` (a share of the base's
    hit ratio) below the base's, by the live split or by a replay of those windows under both policies;
    promoted when the canary has seen ``min_requests`` requests and that replay shows a gain whose interval
    ends no more than ``max_drop`` below zero. A canary still short of either after ``max_windows`` windows is
    inconclusive: it is withdrawn and waits for a person."""

    fraction: Annotated[Number, Field(gt=0, le=1)] = 0.2
    windows: Annotated[Int, Field(ge=1, le=100)] = 1
    max_windows: Annotated[Int, Field(ge=1, le=1000)] = 4
    max_drop: Share = 0.05
    min_requests: Annotated[Int, Field(ge=1)] = 50

    @model_validator(mode="after")
    def _windows_in_order(self) -> CanarySpec:
        if self.max_windows < self.windows:
            raise ValueError(f"max_windows ({self.max_windows}) must be >= windows ({self.windows})")
        return self


class Guardrails(_Model):
    """What the policy loop may do with this policy: what it may roll out alone (``auto_approve``), how it
    rolls out (``canary``), the most a semantic error bound may become (``max_semantic_error``), the ttl range
    it may propose (``ttl_min``/``ttl_max``), and the exponent of the confidence-based ttl
    (``ttl = base x confidence ^ confidence_alpha``, 1 when unset)."""

    auto_approve: AutoApprove | None = None
    canary: CanarySpec | None = None
    max_semantic_error: Annotated[Number, Field(gt=0, le=MAX_SEMANTIC_ERROR)] | None = None
    ttl_min: Duration | None = None
    ttl_max: Duration | None = None
    confidence_alpha: Annotated[Number, Field(ge=0, le=10)] | None = None

    @property
    def rollout(self) -> CanarySpec:
        """``canary``, or the defaults when the policy sets none."""
        return self.canary if self.canary is not None else CanarySpec()

    @property
    def alpha(self) -> float:
        """``confidence_alpha``, 1 when unset."""
        return 1.0 if self.confidence_alpha is None else float(self.confidence_alpha)

    @model_validator(mode="after")
    def _ttl_range(self) -> Guardrails:
        if self.ttl_min is not None and self.ttl_max is not None and self.ttl_min > self.ttl_max:
            raise ValueError(f"ttl_min ({self.ttl_min:g} s) must not exceed ttl_max ({self.ttl_max:g} s)")
        return self


class Policy(_Model):
    """A validated policy document. Immutable; equal (and hashed) by ``content_hash``.

    Build one with ``parse_policy`` or ``load_policy``, which report positions.
    ``Policy.model_validate(data)`` also works and checks the same things, but its errors carry no positions.
    """

    name: Name = Field(alias="policy")
    version: Annotated[Int, Field(ge=1, le=MAX_VERSION)]
    fields: Annotated[dict[FieldName, TypeName], AfterValidator(_frozen_mapping), FrozenMapping] = Field(
        default_factory=lambda: MappingProxyType({})
    )
    defaults: Defaults = Defaults()
    rules: Annotated[tuple[Rule, ...], Field(max_length=MAX_RULES)] = ()
    tenants: Annotated[dict[Name, TenantSpec], AfterValidator(_frozen_mapping), FrozenMapping] = Field(
        default_factory=lambda: MappingProxyType({})
    )
    eviction: EvictionSpec = EvictionSpec()
    slo: SloSpec = SloSpec()
    guardrails: Guardrails = Guardrails()

    _schema: RequestSchema = PrivateAttr()
    _plan: tuple[tuple[Expression, Decision], ...] = PrivateAttr()
    _fallthrough: Decision = PrivateAttr()
    _hash: str | None = PrivateAttr(default=None)
    _slos: Mapping[str, SloSpec] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _prepare(self) -> Policy:
        schema = _schema_for(self.fields)
        errors: list[InitErrorDetails] = _kv_issues(self.defaults, self.rules)
        seen: dict[str, int] = {}
        plan = []
        for i, rule in enumerate(self.rules):
            first = seen.setdefault(rule.name, i)
            if first != i:
                message = f"duplicate rule name {rule.name!r} (first used by rules[{first}])"
                errors.append(_line_error("value_error", message, ("rules", i, "name"), rule.name))
            try:
                plan.append((compile_expression(rule.when, schema), _resolve(self.defaults, rule)))
            except ExpressionError as exc:
                errors.append(_line_error("expression", exc.message, ("rules", i, "when"), rule.when, exc))
        if not errors:
            plan = self._share_budgets(plan, schema, errors)
        if errors:
            # Reached only when built without parse_policy (which checks all this while validating fields),
            # or for a constant matches() text longer than the policy's shared allowance.
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        self._schema = schema
        self._plan = tuple(plan)
        self._fallthrough = _resolve(self.defaults, None)
        return self

    def _share_budgets(
        self,
        plan: list[tuple[Expression, Decision]],
        schema: RequestSchema,
        errors: list[InitErrorDetails],
    ) -> list[tuple[Expression, Decision]]:
        """The plan with the bounded operations of every rule sharing one budget of each kind, since one
        decision may test every rule: each ``matches`` call may search ``match_allowance(P)`` bytes, P the
        program size of all the policy's patterns, and each operation that reads a whole text or list
        ``scan_allowance(S)`` characters or items, S their number (docs/policy-language.md, "Patterns" and
        "Bounds")."""
        total = sum(condition.pattern_size for condition, _ in plan)
        scans = sum(condition.scans for condition, _ in plan)
        shared, so_far = [], 0
        for i, (condition, decision) in enumerate(plan):
            before, so_far = so_far, so_far + condition.pattern_size
            if total <= MAX_PROGRAM_SIZE:
                size = total
            elif before <= MAX_PROGRAM_SIZE < so_far:
                # Over the limit only the rule whose patterns cross it is compiled again, counting the
                # patterns of the rules before it: its compile error is at the pattern that crosses.
                size = so_far
            else:
                size = 0  # within the limit, or after the rule that crossed it: nothing to report
            widened = (condition.pattern_size and size > condition.pattern_size) or (
                condition.scans and scans > condition.scans
            )
            if widened and (size or total <= MAX_PROGRAM_SIZE):
                try:
                    condition = compile_expression(
                        condition.source, schema, shared_pattern_size=size, shared_scans=scans
                    )
                except ExpressionError as exc:
                    errors.append(
                        _line_error("expression", exc.message, ("rules", i, "when"), condition.source, exc)
                    )
            shared.append((condition, decision))
        return shared

    @property
    def schema(self) -> RequestSchema:  # type: ignore[override]  # BaseModel.schema is pydantic-v1 legacy
        """The request schema the rules were compiled against: the standard fields plus ``fields``."""
        return self._schema

    @property
    def content_hash(self) -> str:
        """sha256 (hex) of the normalised document (``policy_to_dict``, as canonical JSON)."""
        if self._hash is None:  # computed on first use, outside validation, so a bug here is not an "issue"
            canonical = json.dumps(
                policy_to_dict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False
            )
            self._hash = hashlib.sha256(canonical.encode()).hexdigest()
        return self._hash

    @property
    def ref(self) -> PolicyRef:
        return PolicyRef(f"{self.name}@{self.version}")

    @property
    def slos(self) -> Mapping[str, SloSpec]:
        """``{rule name: resolved SloSpec}`` of every rule whose slo (its own over the policy's, field by
        field) sets an objective, and ``"default"`` (requests no rule matches) when the policy's does: what
        the controller enforces, each rule measured on its own."""
        if self._slos is None:
            slos = {DEFAULT_RULE: self.slo}
            for rule in self.rules:
                slos[rule.name] = self.slo if rule.slo is None else rule.slo.over(self.slo)
            self._slos = MappingProxyType(
                {name: spec.resolved() for name, spec in slos.items() if spec.objectives}
            )
        return self._slos

    def decide(self, view: Mapping[str, Any]) -> Decision:
        """The decision for one request view: the first rule whose ``when`` holds, merged over the defaults;
        the defaults alone (rule ``"default"``) if none holds.

        A ``when`` that fails to evaluate on this view (``ExpressionEvalError``: a value of the wrong type, a
        bound exceeded) does not fail the request: that rule counts as not matching, the search goes on, and
        the rule's name is listed in ``Decision.skipped`` so the caller can log and count it. Nothing else is
        caught.
        """
        skipped: list[str] = []
        for condition, decision in self._plan:
            try:
                matched = condition.test(view)
            except ExpressionEvalError:
                skipped.append(decision.rule)
                continue
            if matched:
                return replace(decision, skipped=tuple(skipped)) if skipped else decision
        if skipped:
            return replace(self._fallthrough, skipped=tuple(skipped))
        return self._fallthrough

    def decision_for(self, rule: str) -> Decision:
        """The decision of the rule named ``rule`` (its settings over the defaults), whatever a request would
        match: what replay applies to traffic that a trace says matched that rule. A name no rule has (and
        ``"default"``) gives the defaults alone."""
        for _, decision in self._plan:
            if decision.rule == rule:
                return decision
        return self._fallthrough

    def tenant(self, name: str | None) -> TenantSpec | None:
        """The settings of tenant ``name`` (its quotas, weight, rate and prompt bound): its own entry under
        ``tenants``, else the ``default`` entry, else None (the policy sets nothing for it: no quota, no rate
        limit, no prompt bound). ``None`` for ``name`` (a caller that knows no tenant) gives the ``default``
        entry too. The one reading of the section: the controller's tiers, the replay simulator and the serving
        ingress's prompt bound all ask here."""
        own = self.tenants.get(name) if name is not None else None
        return own if own is not None else self.tenants.get(DEFAULT_TENANT)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.content_hash == self.content_hash

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Pickled (Ray, multiprocessing, deepcopy) as its normalised document, which validates back to an
        # equal policy; the compiled rules and read-only mappings are rebuilt on the other side.
        return (Policy.model_validate, (policy_to_dict(self),))

    def __copy__(self) -> Policy:
        return self  # immutable: a copy would be indistinguishable

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Policy:
        return self

    def __hash__(self) -> int:
        return hash(self.content_hash)

    def __repr__(self) -> str:
        return f"Policy({self.ref}, {len(self.rules)} rules, {self.content_hash[:12]})"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy decides for one request, with every value resolved (the rule's over the defaults).

    ``cache`` is False for ``cache: bypass``. ``semantic`` is None when semantic matching is off, else the
    rule's ``semantic`` resolved (``SemanticSpec.resolved``: ``mode`` and ``explore`` filled in);
    ``kv`` is None when KV reuse is off (no ``kv`` in the rule or the defaults, or ``reuse: off``), else the
    rule's ``kv`` over the defaults', field by field, resolved (``KvSpec.resolved``: every field filled in,
    ``tiers`` from the decision's where not written). ``skipped`` names the rules before this one whose
    ``when`` could not be evaluated on the view (see ``Policy.decide``). ``client_controls``: the per-call
    directives a caller may give this call (``controller.CacheControl``); the others are ignored.
    """

    rule: str
    cache: bool
    ttl: float
    sliding: bool
    tiers: tuple[str, ...]
    max_entry_bytes: int | None
    allow_sampling: bool
    stream: bool
    semantic: SemanticSpec | None
    kv: KvSpec | None
    skipped: tuple[str, ...] = ()
    client_controls: tuple[str, ...] = CLIENT_CONTROLS


def _resolve(defaults: Defaults, rule: Rule | None) -> Decision:
    def pick(name: str) -> Any:
        value = getattr(rule, name) if rule is not None else None
        return getattr(defaults, name) if value is None else value

    semantic: SemanticSpec | None = pick("semantic")
    kv = defaults.kv if rule is None or rule.kv is None else rule.kv.over(defaults.kv)
    tiers = pick("tiers")
    return Decision(
        rule=rule.name if rule is not None else DEFAULT_RULE,
        cache=pick("cache") == "response",
        ttl=pick("ttl"),
        sliding=bool(rule is not None and rule.sliding),
        tiers=tiers,
        max_entry_bytes=pick("max_entry_bytes"),
        allow_sampling=pick("allow_sampling"),
        stream=pick("stream"),
        semantic=None if semantic is None else semantic.resolved(),
        kv=None if kv is None else kv.resolved(tiers),
        client_controls=CLIENT_CONTROLS if pick("client_controls") is None else tuple(pick("client_controls")),
    )


def _kv_issues(defaults: Defaults, rules: tuple[Rule, ...]) -> list[InitErrorDetails]:
    """The chunk-only fields (``recompute_*``) of each kv section that leaves ``reuse`` out, checked against
    the reuse it inherits (the defaults' over nothing: ``prefix``). A section that writes ``reuse`` was
    checked as it was validated."""
    sections = [(("defaults", "kv"), defaults.kv, None)]
    sections += [(("rules", i, "kv"), rule.kv, defaults.kv) for i, rule in enumerate(rules)]
    errors = []
    for loc, spec, base in sections:
        if spec is None or spec.reuse is not None:
            continue
        inherited = base.reuse if base is not None else None
        reuse = inherited or "prefix"
        for name in _KV_CHUNK_FIELDS:
            value = getattr(spec, name)
            if value and reuse != "chunks":
                said = f"{reuse} (the defaults')" if inherited else f"{reuse} (not written)"
                message = _kv_chunks_only(name, said)
                errors.append(_line_error("value_error", message, (*loc, name), value, ValueError(message)))
    return errors


def _schema_for(fields: Mapping[str, str]) -> RequestSchema:
    if not fields:
        return STANDARD_SCHEMA
    return STANDARD_SCHEMA.extend({name: TYPE_NAMES[type_name] for name, type_name in fields.items()})


def _line_error(
    kind: str, message: str, loc: Path, value: Any, exc: Exception | None = None
) -> InitErrorDetails:
    ctx: dict[str, Any] = {"message": message}
    if exc is not None:
        ctx["error"] = exc
    return InitErrorDetails(type=PydanticCustomError(kind, "{message}", ctx), loc=loc, input=value)


# --- loading ----------------------------------------------------------------------------------------------

_CHECK = "evocache.dsl.policy"  # key of the load check in pydantic's validation context


@dataclass(slots=True)
class _LoadCheck:
    """State shared by the validators while ``parse_policy`` validates one document, so that expression and
    duplicate-name errors are found alongside every other error, each at its own path."""

    schema: RequestSchema
    rule_names: dict[str, int]
    rule_index: int = -1  # index of the rule being validated (rules are validated in order)


def _load_check(info: ValidationInfo) -> _LoadCheck | None:
    context = info.context
    return context.get(_CHECK) if isinstance(context, dict) else None


def _provisional_schema(raw_fields: object) -> RequestSchema:
    """The schema to check expressions against while ``fields`` itself may be invalid: a declared name whose
    type is wrong still counts as declared (type ANY), so the expression is not blamed for it as well."""
    if not isinstance(raw_fields, dict):
        return STANDARD_SCHEMA
    extra: dict[str, FieldType] = {}
    for name, type_name in raw_fields.items():
        if isinstance(name, str) and name not in STANDARD_FIELDS:
            extra[name] = TYPE_NAMES.get(type_name, ANY) if isinstance(type_name, str) else ANY
    return STANDARD_SCHEMA.extend(extra) if extra else STANDARD_SCHEMA


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """Validate a policy document given as YAML text. ``source`` names it in issues (a file name).

    Raises ``PolicyError`` with every issue found (YAML, schema, expressions), each with its line, column and
    field path, in document order. Raises ``TypeError`` if ``text`` is not a str.
    """
    doc = load_located(text, source)
    if not isinstance(doc.data, dict):
        got = "an empty document" if doc.data is None else f"a {type(doc.data).__name__}"
        pos = doc.locate(())
        raise PolicyError(
            [
                PolicyIssue(
                    source,
                    pos and pos.line,
                    pos and pos.column,
                    "",
                    f"a policy document is a mapping with `policy` and `version`; got {got}",
                )
            ]
        )
    rules = doc.data.get("rules")
    if isinstance(rules, list) and len(rules) > MAX_RULES:
        # Before validation, which otherwise goes through every rule when some are invalid.
        pos = doc.locate(("rules", MAX_RULES))
        message = f"a policy has at most {MAX_RULES} rules; this one has {len(rules)}"
        raise PolicyError(
            [PolicyIssue(source, pos and pos.line, pos and pos.column, f"rules[{MAX_RULES}]", message)]
        )
    check = _LoadCheck(_provisional_schema(doc.data.get("fields")), {})
    try:
        return Policy.model_validate(doc.data, context={_CHECK: check})
    except ValidationError as exc:
        raise PolicyError(_issues(exc, doc)) from None


def load_policy(path: str | PathLike[str]) -> Policy:
    """Load and validate the policy document at ``path``: a regular file of UTF-8 YAML, at most
    ``MAX_POLICY_BYTES`` long (see ``_source.read_policy_text``).

    Raises ``PolicyError`` for an invalid document (including a file too large or not UTF-8),
    ``PolicyFileError`` for a path that is not a regular file (a FIFO, a device), and ``OSError``
    (``FileNotFoundError``, ...) when the file cannot be opened; ``PolicyFileError`` is an ``OSError`` too.
    """
    return parse_policy(read_policy_text(path), str(path))


# --- mapping pydantic errors back to the document -------------------------------------------------------

_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _issues(exc: ValidationError, doc: LocatedDocument) -> list[PolicyIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        on_key = err["type"] == "extra_forbidden"
        if loc and loc[-1] == "[key]":  # a dict key failed: pydantic puts the key, then "[key]"
            loc, on_key = loc[:-1], True
        ctx = err.get("ctx") or {}
        expression_error = ctx.get("error")
        if isinstance(expression_error, ExpressionError):
            issues.append(_expression_issue(expression_error, loc, doc))
            continue
        pos = doc.locate(loc, key=on_key)
        issues.append(
            PolicyIssue(
                doc.source, pos and pos.line, pos and pos.column, format_path(loc), _message(err, loc)
            )
        )
    issues.sort(key=lambda i: (i.line is None, i.line or 0, i.column or 0))
    return issues


def _message(err: Any, loc: Path) -> str:
    kind = err["type"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        known = _known_fields(loc[:-1])
        return f"unknown field {brief(loc[-1])}" + (f"; known fields: {', '.join(known)}" if known else "")
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}; got {_describe(err['input'])}"
    # Constraint errors ("Input should be less than or equal to 1"): pydantic's wording, in ours.
    message = err["msg"].replace("Input should be", "must be", 1)
    value = err["input"]
    return message if isinstance(value, dict | list) else f"{message}; got {_describe(value)}"


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"{type(value).__name__} {brief(value)}"


def _known_fields(loc: Path) -> list[str]:
    """Field names of the model at ``loc`` (walking Policy's annotations), for unknown-field hints."""
    model: Any = Policy
    for part in loc:
        if isinstance(part, int) or model is None:
            continue  # a list index or a dict key: the item type was already taken
        info = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        model = _item_model(info.annotation) if info is not None else None
    if model is None:
        return []
    return [f.alias or n for n, f in model.model_fields.items()]


def _item_model(annotation: Any) -> Any:
    # Unwrap Optional[X], tuple[X, ...], dict[K, X] and Annotated[...] down to a model class, if there is one.
    stack = [annotation]
    while stack:
        t = stack.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        stack.extend(get_args(t))
    return None


def _expression_issue(exc: ExpressionError, loc: Path, doc: LocatedDocument) -> PolicyIssue:
    """Shift the expression's line and column by where its scalar sits in the file."""
    lines = exc.source.split("\n")
    line = min(max(exc.line, 1), len(lines))
    index = sum(len(text) + 1 for text in lines[: line - 1]) + max(exc.column, 1) - 1
    pos = doc.scalar_position(loc, index) or doc.locate(loc)
    caret = str(exc).partition("\n")[
        2
    ]  # the expression line and its caret, as the expression error draws them
    message = f"{exc.message}\n{caret}" if caret else exc.message
    return PolicyIssue(doc.source, pos and pos.line, pos and pos.column, format_path(loc), message)


# --- the normalised document ------------------------------------------------------------------------------


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """The normalised document as plain JSON-compatible data: keys in schema order, defaults filled in,
    durations spelled the normalised way (``1h30m``), tiers in lookup order, tenants and fields sorted.
    Settings a rule leaves to the defaults are left out."""
    return policy.model_dump(mode="json", by_alias=True, exclude_none=True)


class _Dumper(yaml.SafeDumper):
    """Block style with indented lists; a list of plain scalars (tiers) on one line."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(isinstance(item, str | int | float | bool) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def policy_to_yaml(policy: Policy) -> str:
    """The normalised document as YAML text: what ``evocache policy show`` prints and diffs compare. Parsing
    it gives back an equal policy."""
    return yaml.dump(
        policy_to_dict(policy),
        Dumper=_Dumper,
        sort_keys=False,
        allow_unicode=True,
        default_flow_style=False,
        width=1_000_000,
    )
