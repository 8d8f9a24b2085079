"""Cache keys and namespaces.

A key binds everything that could make two calls' answers differ: the function's identity, the model id and
revision, the prompt-template hash, the normalised generation parameters, the tenant namespace and the
canonicalised arguments. Each part is length-prefixed inside the hashed material, so no choice of values can
make one part's bytes read as another's, and two calls share a key only when every part is equal.

Which arguments are one key. An argument keys by its value and by the type a function can tell apart:

- ``1``, ``1.0`` and ``True`` are three keys; ``-0.0`` and ``0.0`` are one (they compare and hash alike, as in
  the plan memo); every NaN is one key.
- A list and a tuple of the same items are two keys; so are a set and a frozenset. A list subclass keys as a
  list, a tuple subclass (a named tuple) as a tuple, a set subclass as a set.
- A numpy scalar is not the Python number of the same value, and numpy values of two dtypes are two keys
  (``np.float32(0.5)``, ``np.float64(0.5)``, ``0.5``); an array keys by its dtype, shape and items, so it is
  neither a list nor an array of another dtype or shape. Other values exported through ``tolist()`` (torch
  tensors) key by their type and items.
- Mappings key by their items whatever their order or mapping type; ``bytes`` and ``bytearray`` of the same
  bytes are one key; dataclasses and pydantic models key by their type and fields.
- An integer of any size is a key (one past the 4300 digits Python turns into decimal text keys by its
  hexadecimal digits, so no setting of ``sys.set_int_max_str_digits`` changes a key).
- Anything else has no canonical form (``Uncacheable``): the call is served uncached. So is an argument whose
  own code raises while it is read (an attribute hook, a ``__class__`` property, a mapping's ``items()``), one
  nested deeper than 32 levels, and arguments that hold more than ``MAX_NODES`` values in all (every item of
  every container counted, each time it is met: a list holding another twice at each of 40 levels is 2**40).

Generation parameters (``GENERATION_PARAMS``) key by meaning instead, because the model decodes equal settings
alike: numbers as numbers of the parameter's kind (``temperature=0``, ``0.0`` and ``np.float32(0)`` are one
key), values that switch a parameter off are dropped, and a tuple of stop strings is the list of them.

Namespaces: a tenant id maps to a namespace (``namespace_for``) readable ids to themselves, any other to a
digest; a call made for no tenant gets ``ANONYMOUS_NS``, which no tenant id maps to, so the anonymous caller
and a tenant called ``"default"`` never share an entry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
import re
import sys
from collections.abc import Mapping
from typing import Any

from ._types import CacheKey, Namespace

_SAFE_TENANT = re.compile(r"[A-Za-z0-9_-]{1,100}")

# Generation parameters that change an answer: name -> (numeric kind or None, the values that switch it off).
# A value that switches a parameter off is dropped, so `top_k=0`, `top_k=-1` and no top_k share a key (they
# decode identically). Float parameters are compared as floats (`temperature=0` is `0.0`) at 12 significant
# digits, which merges representation noise (0.30000000000000004) but never a real setting (1e-7 stays 1e-7).
GENERATION_PARAMS: Mapping[str, tuple[type | None, tuple[Any, ...]]] = {
    "temperature": (float, ()),
    "top_k": (int, (0, -1)),
    "top_p": (float, (1.0,)),
    "min_p": (float, (0.0,)),
    "max_tokens": (int, ()),
    "seed": (int, ()),
    "stop": (None, ()),
    "repetition_penalty": (float, (1.0,)),
    "presence_penalty": (float, (0.0,)),
    "frequency_penalty": (float, (0.0,)),
}


MAX_NODES = 1 << 22
"""The most values the arguments of one call may hold, counted as canonicalisation meets them: past it the call
is served uncached. About four million (a second or so of work); a prompt's token ids are far fewer."""

# Ints up to this many bits key by their decimal repr, which Python refuses past 4300 digits (14,284 bits);
# larger ones key by their hexadecimal digits, which it never refuses.
_DECIMAL_BITS = 14_000


class Uncacheable(TypeError):
    """An argument has no canonical form (an arbitrary object): the call is served uncached."""


ANONYMOUS_NS = Namespace(".anonymous")
"""The namespace of a call made for no tenant: it starts with a dot, which no namespace of a tenant id does."""


def namespace_for(tenant_id: str) -> Namespace:
    """The namespace of a tenant. Readable ids map to themselves; any other id maps to ``h.<digest>``.

    The dot cannot occur in a readable id, so the two forms never collide, and neither starts with a dot, so
    no tenant id maps to ``ANONYMOUS_NS``.
    """
    if not isinstance(tenant_id, str):
        raise ValueError(f"tenant id must be a non-empty string, got {type(tenant_id).__qualname__}")
    tenant_id = exact_str(tenant_id)
    if not tenant_id:
        raise ValueError("tenant id must be a non-empty string, got ''")
    if _SAFE_TENANT.fullmatch(tenant_id):
        return Namespace(tenant_id)
    return Namespace("h." + hashlib.blake2b(_utf8(tenant_id), digest_size=16).hexdigest())


def exact_str(text: str) -> str:
    """``text`` as a plain ``str``: a subclass's characters, without its methods. A tenant id is used as text
    (formatted into storage keys, encoded into entry tags, compared in memo keys), and a subclass's own
    ``__format__``, ``encode`` or ``__eq__`` could make one tenant's id read as another's. ``TypeError`` for
    an object that is no ``str`` at all (whatever its ``__class__`` claims)."""
    return text if type(text) is str else str.__str__(text)


def template_hash(template: str | None) -> str:
    return "" if template is None else hashlib.sha256(_utf8(template)).hexdigest()[:32]


def _utf8(text: str) -> bytes:
    """UTF-8, with lone surrogates kept as their own bytes (a str may hold one; strict UTF-8 refuses it). Valid
    text encodes as plain UTF-8, and two different strings never encode alike."""
    return text.encode("utf-8", "surrogatepass")


def as_real(value: Any) -> float | None:
    """``value`` read as a real number: Python and numpy numbers, 0-d numpy arrays, ``Decimal`` and numeric
    strings; None for anything else (a complex number, a string that is no number, an array of several)."""
    try:
        return _real(value)
    except Exception:  # noqa: BLE001 - the value's own code (__class__, __float__, item()) raised
        return None  # no provable number: a temperature then counts as sampling (a counted bypass)


def _real(value: Any) -> float | None:
    kind = type(value)
    if kind is float:  # the common cases first: the checks below go through the numbers ABCs
        return value
    if kind is int or kind is bool:
        try:
            return float(value)
        except OverflowError:
            return None
    if value is None:
        return None
    np = sys.modules.get("numpy")  # not imported: no argument can be a numpy value
    if np is not None and isinstance(value, np.ndarray):
        if value.shape != ():
            return None
        value = value.item()
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return None
    if not isinstance(value, (numbers.Number, str)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # "hot", Decimal("sNaN"), a Fraction beyond float's range
        return None


def normalise_params(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Generation parameters in a canonical order with "off" values dropped and floats rounded.

    Raises ``Uncacheable`` for a value without a canonical form, or whose own code raises while it is read."""
    items = tuple((name, type(value), value) for name, value in params.items())
    if all(t in _MEMO_PARAM_TYPES for _, t, _ in items):
        return _normalised(items)  # calls repeat the same few settings: remember them
    try:
        return _normalise(items)
    except Uncacheable:
        raise
    except Exception as exc:  # noqa: BLE001 - the value's own code (__class__, __hash__, __float__) raised
        raise Uncacheable(f"a generation parameter could not be read: {type(exc).__name__}: {exc}") from exc


# Parameter values whose hash and equality are Python's own: only they key the memo of normalised settings.
_MEMO_PARAM_TYPES = frozenset((int, float, str, bool, type(None)))


@functools.lru_cache(maxsize=1024)
def _normalised(items: tuple[tuple[str, type, Any], ...]) -> tuple[tuple[str, Any], ...]:
    return _normalise(items)


def _normalise(items: tuple[tuple[str, type, Any], ...]) -> tuple[tuple[str, Any], ...]:
    out = []
    for name, _, value in sorted(items, key=lambda item: item[0]):
        if value is None:
            continue
        kind, off = GENERATION_PARAMS.get(name, (None, ()))
        value = _param_value(kind, value)
        if type(value) in (int, float, bool) and value in off:  # never `in` on an array: ambiguous truth
            continue
        out.append((name, _canon(value)))
    return tuple(out)


def _param_value(kind: type | None, value: Any) -> Any:
    """A generation parameter by meaning: a number as the parameter's kind (numpy scalars and 0-d arrays
    included), a tuple as a list; anything else as given."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, bool):
        return value
    try:
        if kind is float and isinstance(value, numbers.Real):
            return float(f"{float(value):.12g}") + 0.0  # + 0.0 turns -0.0 into 0.0
        if kind is int and isinstance(value, numbers.Integral):
            return int(value)
    except (TypeError, ValueError, OverflowError) as exc:  # a Fraction beyond float's range
        raise Uncacheable(f"generation parameter {value!r} is no {kind.__name__}: {exc}") from exc
    if isinstance(value, tuple):
        return list(value)
    return value


class _Budget:
    """How many more values canonicalisation may meet in one call's arguments (``MAX_NODES`` in all)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_NODES

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise Uncacheable(f"arguments holding more than {MAX_NODES} values")


def _canon(value: Any, depth: int = 0, budget: _Budget | None = None) -> Any:
    """A type-tagged canonical form, compared through ``repr`` (which rules make one key: the module docstring).

    A list becomes a list; every other non-scalar becomes a tuple whose first item is its tag, so no list of
    strings can read like bytes, a tuple, a set or a mapping. Mappings and sets sort their items. Raises
    ``Uncacheable`` past 32 levels of nesting, past ``budget`` (``MAX_NODES`` values by default), and when the
    value's own code raises.
    """
    if budget is None:
        budget = _Budget()
    budget.spend()
    if depth > 32:
        raise Uncacheable("argument nesting deeper than 32")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if value.bit_length() <= _DECIMAL_BITS else ("int", hex(value))
    if t is float:
        if math.isnan(value):
            return ("nan",)
        # -0.0 == 0.0 in Python, as in the plan memo: one argument, one key.
        return value + 0.0 if math.isfinite(value) else ("inf", value > 0)
    if t is bytes or t is bytearray:
        return ("b", bytes(value).hex())
    try:
        return _canon_object(value, t, depth, budget)
    except Uncacheable:
        raise
    except Exception as exc:  # noqa: BLE001 - an argument's own code (__getattr__, __class__, items()) raised
        raise Uncacheable(f"an argument of type {t.__qualname__} could not be read: {type(exc).__name__}") from exc


def _canon_object(value: Any, t: type, depth: int, budget: _Budget) -> Any:
    """``_canon`` of anything but None, bool, int, float, str, bytes and bytearray."""
    depth += 1
    if isinstance(value, list):
        return [_canon(v, depth, budget) for v in value]
    if isinstance(value, tuple):
        return ("tuple", [_canon(v, depth, budget) for v in value])
    if isinstance(value, (set, frozenset)):
        tag = "set" if isinstance(value, set) else "frozenset"
        return (tag, sorted((_canon(v, depth, budget) for v in value), key=repr))
    if isinstance(value, Mapping):
        items = sorted(((_canon(k, depth, budget), _canon(v, depth, budget)) for k, v in value.items()), key=repr)
        return ("map", items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Field by field, not dataclasses.asdict: that deep-copies (failing on locks and handles) and
        # drops the tags of nested dataclasses.
        fields = [(f.name, _canon(getattr(value, f.name), depth, budget)) for f in dataclasses.fields(value)]
        return ("dc", t.__module__, t.__qualname__, fields)
    dump = getattr(value, "model_dump", None)  # pydantic models
    if callable(dump):
        return ("pd", t.__module__, t.__qualname__, _canon(_call(dump, t), depth, budget))
    np = sys.modules.get("numpy")  # not imported: no argument can be a numpy value
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        # dtype.str names the kind, size and byte order (<f4); a structured or object dtype exports through
        # tolist() like any array, and what it holds must then have a canonical form itself.
        if isinstance(value, np.ndarray) and value.size > budget.left:
            raise Uncacheable(f"arguments holding more than {MAX_NODES} values")  # before tolist() copies it
        items = _canon(_call(value.tolist, t), depth, budget)
        if isinstance(value, np.generic):
            return ("np", value.dtype.str, items)
        return ("nd", value.dtype.str, list(value.shape), items)
    tolist = getattr(value, "tolist", None)  # torch tensors and other array types
    if callable(tolist):
        return ("tl", t.__module__, t.__qualname__, _canon(_call(tolist, t), depth, budget))
    raise Uncacheable(f"no canonical form for an argument of type {t.__qualname__}")


def _call(export: Any, t: type) -> Any:
    """An argument's own export method; whatever it raises makes the call uncacheable, never failed."""
    try:
        return export()
    except Exception as exc:  # noqa: BLE001 - third-party code at the boundary that must not fail a call
        raise Uncacheable(f"{t.__qualname__}.{export.__name__}() failed: {type(exc).__name__}: {exc}") from exc


def derive_key(
    *,
    function: str,
    model: str,
    revision: str,
    template: str,
    params: tuple[tuple[str, Any], ...],
    ns: Namespace,
    args: Mapping[str, Any],
) -> CacheKey:
    """The key of one call. Raises ``Uncacheable`` for arguments without a canonical form.

    The hashed material is the parts in a fixed order, each prefixed by its length: no part can bleed into
    the next, whatever bytes it holds.
    """
    budget = _Budget()
    canon = sorted((name, _canon(value, 0, budget)) for name, value in args.items())
    try:
        text = repr(params), repr(canon)
    except ValueError as exc:  # an int past sys.set_int_max_str_digits, if set below _DECIMAL_BITS
        raise Uncacheable(f"an argument cannot be written out: {exc}") from exc
    material = b"".join((
        _identity_part(function, model, revision, template),
        _framed(text[0].encode()), _framed(ns.encode()), _framed(text[1].encode()),
    ))
    return CacheKey(hashlib.sha256(material).hexdigest())


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


@functools.lru_cache(maxsize=4096)
def _identity_part(function: str, model: str, revision: str, template: str) -> bytes:
    """The framed parts that are fixed per function and model: computed once, not on every miss."""
    return b"".join(_framed(_utf8(s)) for s in (function, model, revision, template))
