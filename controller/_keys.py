"""Cache keys and namespaces.

A key binds everything that could make two calls' answers differ: the function's identity, the model id and
revision, the prompt-template hash, the normalised generation parameters, the tenant namespace and the
canonicalised arguments. Each part is length-prefixed inside the hashed material, so no choice of values can
make one part's bytes read as another's, and two calls share a key only when every part is equal.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
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


class Uncacheable(TypeError):
    """An argument has no canonical form (an arbitrary object): the call is served uncached."""


def namespace_for(tenant_id: str) -> Namespace:
    """The namespace of a tenant. Readable ids map to themselves; any other id maps to ``h.<digest>``.

    The dot cannot occur in a readable id, so the two forms never collide.
    """
    if not isinstance(tenant_id, str) or not tenant_id:
        raise ValueError(f"tenant id must be a non-empty string, got {tenant_id!r}")
    if _SAFE_TENANT.fullmatch(tenant_id):
        return Namespace(tenant_id)
    return Namespace("h." + hashlib.blake2b(tenant_id.encode(), digest_size=16).hexdigest())


def template_hash(template: str | None) -> str:
    return "" if template is None else hashlib.sha256(template.encode()).hexdigest()[:32]


def normalise_params(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Generation parameters in a canonical order with "off" values dropped and floats rounded."""
    items = tuple((name, type(value), value) for name, value in params.items())
    try:
        return _normalised(items)  # calls repeat the same few settings: remember them
    except TypeError:  # an unhashable value (a list of stop strings)
        return _normalise(items)


@functools.lru_cache(maxsize=1024)
def _normalised(items: tuple[tuple[str, type, Any], ...]) -> tuple[tuple[str, Any], ...]:
    return _normalise(items)


def _normalise(items: tuple[tuple[str, type, Any], ...]) -> tuple[tuple[str, Any], ...]:
    out = []
    for name, _, value in sorted(items, key=lambda item: item[0]):
        if value is None:
            continue
        kind, off = GENERATION_PARAMS.get(name, (None, ()))
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(f"{float(value):.12g}") + 0.0  # + 0.0 turns -0.0 into 0.0
        if type(value) in (int, float, bool) and value in off:  # never `in` on an array: ambiguous truth
            continue
        out.append((name, _canon(value)))
    return tuple(out)


def _canon(value: Any, depth: int = 0) -> Any:
    """A type-tagged canonical form, compared through ``repr``.

    Sequences of any kind become lists; every other non-scalar becomes a tuple whose first item is its tag, so
    no list of strings can read like bytes, a set or a mapping. Mappings sort their keys.
    """
    if depth > 32:
        raise Uncacheable("argument nesting deeper than 32")
    t = type(value)
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        if math.isnan(value):
            return ("nan",)
        # -0.0 == 0.0 in Python, as in the plan memo: one argument, one key.
        return value + 0.0 if math.isfinite(value) else ("inf", value > 0)
    if t is bytes or t is bytearray:
        return ("b", bytes(value).hex())
    if isinstance(value, (list, tuple)):
        return [_canon(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return ("set", sorted((_canon(v, depth + 1) for v in value), key=repr))
    if isinstance(value, Mapping):
        items = sorted(((_canon(k, depth + 1), _canon(v, depth + 1)) for k, v in value.items()), key=repr)
        return ("map", items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Field by field, not dataclasses.asdict: that deep-copies (failing on locks and handles) and
        # drops the tags of nested dataclasses.
        fields = [(f.name, _canon(getattr(value, f.name), depth + 1)) for f in dataclasses.fields(value)]
        return ("dc", t.__module__, t.__qualname__, fields)
    dump = getattr(value, "model_dump", None)  # pydantic models
    if callable(dump):
        return ("pd", t.__module__, t.__qualname__, _canon(_call(dump, t), depth + 1))
    tolist = getattr(value, "tolist", None)  # numpy arrays and torch tensors
    if callable(tolist):
        return _canon(_call(tolist, t), depth + 1)
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
    canon = sorted((name, _canon(value)) for name, value in args.items())
    material = b"".join((
        _identity_part(function, model, revision, template),
        _framed(repr(params).encode()), _framed(ns.encode()), _framed(repr(canon).encode()),
    ))
    return CacheKey(hashlib.sha256(material).hexdigest())


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


@functools.lru_cache(maxsize=4096)
def _identity_part(function: str, model: str, revision: str, template: str) -> bytes:
    """The framed parts that are fixed per function and model: computed once, not on every miss."""
    return b"".join(_framed(s.encode()) for s in (function, model, revision, template))
