"""Values at request time: which Python values the language accepts, how they compare, and the runtime bounds.

A view is caller data, so nothing about its values is trusted: reading a declared field checks the value
against the field's type, and operations on values whose type is not known statically (``Kind.ANY``) check
the value's kind first (``kind_of``). bool is never a number here, although Python treats it as one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ._schema import FieldType, Kind

MAX_INT = 2**63  # |int| bound for literals and for every integer result
MAX_STRING_BUILD = 64 * 1024  # longest string that '+' may build

NUMBER = frozenset({Kind.INT, Kind.FLOAT})
ALL_KINDS = frozenset(Kind) - {Kind.ANY}

# Exact Python types per kind: the fast path of every runtime check is one `type(x) in set` lookup.
_EXACT_TYPES: Mapping[Kind, frozenset[type]] = {
    Kind.INT: frozenset({int}),
    Kind.FLOAT: frozenset({int, float}),  # FLOAT is "a number"
    Kind.STR: frozenset({str}),
    Kind.BOOL: frozenset({bool}),
    Kind.LIST: frozenset({list, tuple}),
    Kind.RECORD: frozenset({dict, MappingProxyType}),
    Kind.NONE: frozenset({type(None)}),
}
_KIND_OF_TYPE: Mapping[type, Kind] = {
    bool: Kind.BOOL,
    int: Kind.INT,
    float: Kind.FLOAT,
    str: Kind.STR,
    type(None): Kind.NONE,
    list: Kind.LIST,
    tuple: Kind.LIST,
    dict: Kind.RECORD,
    MappingProxyType: Kind.RECORD,
}


class Fault(Exception):
    """A runtime failure detected by a helper that does not know where in the expression it is; the compiled
    closure that called the helper turns it into an ``ExpressionEvalError`` at its own position."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def kind_of(value: Any) -> Kind | None:
    """The language kind of a Python value, or None for a value the language has no kind for."""
    kind = _KIND_OF_TYPE.get(type(value))
    if kind is not None:
        return kind
    # Subclasses: str/int/float subclasses and other Mapping or Sequence implementations.
    for base, base_kind in ((bool, Kind.BOOL), (int, Kind.INT), (float, Kind.FLOAT), (str, Kind.STR)):
        if isinstance(value, base):
            return base_kind
    if isinstance(value, Mapping):
        return Kind.RECORD
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray, memoryview)):
        return Kind.LIST
    return None


def widen(kinds: frozenset[Kind]) -> frozenset[Kind]:
    """Kinds a value may have to satisfy ``kinds``: FLOAT (a number) admits INT, ANY admits everything."""
    if Kind.ANY in kinds:
        return ALL_KINDS
    if Kind.FLOAT in kinds:
        return kinds | {Kind.INT}
    return kinds


def exact_types(kinds: frozenset[Kind]) -> frozenset[type]:
    """Python types that certainly satisfy ``kinds`` (the fast path of a runtime check)."""
    return frozenset().union(*(_EXACT_TYPES[k] for k in widen(kinds)))


def accepted_kinds(t: FieldType) -> frozenset[Kind]:
    """Kinds a value of declared type ``t`` may have at runtime."""
    kinds = widen(frozenset({t.kind}))
    return kinds | {Kind.NONE} if t.optional else kinds


def describe_type(t: FieldType) -> str:
    """``int``, ``number``, ``list[int]``, ``record{id, tier}``, ``int or none``: for error messages."""
    if t.kind is Kind.LIST:
        text = (
            f"list[{describe_type(t.item)}]" if t.item is not None and t.item.kind is not Kind.ANY else "list"
        )
    elif t.kind is Kind.RECORD:
        text = "record{" + ", ".join(sorted(t.fields)) + "}" if t.fields else "record"
    elif t.kind is Kind.FLOAT:
        text = "number"
    else:
        text = t.kind.value
    return f"{text} or none" if t.optional else text


def describe_value(value: Any) -> str:
    kind = kind_of(value)
    return kind.value if kind is not None else f"unsupported type {type(value).__name__}"


def describe_kinds(kinds: frozenset[Kind]) -> str:
    names = sorted({"number" if k in NUMBER and Kind.FLOAT in kinds else k.value for k in kinds})
    return " or ".join(names)


def values_equal(a: Any, b: Any) -> bool:
    """Equality without Python's bool/number confusion (``true == 1`` is false) and with lists compared by
    items whatever their Python type (a list literal is a tuple, a view list is a list).

    Raises ``Fault`` for values the language does not know.
    """
    ka, kb = kind_of(a), kind_of(b)
    if ka is None or kb is None:
        raise Fault(f"cannot compare {describe_value(a)} with {describe_value(b)}")
    if ka in NUMBER and kb in NUMBER:
        return bool(a == b)
    if ka is not kb:
        return False
    if ka is Kind.LIST:
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if ka is Kind.RECORD:
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def member(item: Any, container: Any) -> bool:
    """``item in container``: substring for strings, element equality (``values_equal``) for lists."""
    kc = kind_of(container)
    if kc is Kind.STR:
        if kind_of(item) is not Kind.STR:
            raise Fault(f"'in' on a string needs a string on the left, got {describe_value(item)}")
        return item in container
    if kc is not Kind.LIST:
        raise Fault(f"'in' needs a list or a string on the right, got {describe_value(container)}")
    ki = kind_of(item)
    if ki is Kind.STR or ki is Kind.NONE:
        # Neither can be confused with another kind by Python's ==, so the C-speed test is exact.
        return item in container
    if ki in NUMBER:
        if item not in container:  # a cheap negative first: a strict match is also a Python match
            return False
        return any(x == item for x in container if type(x) is not bool)
    if ki is Kind.BOOL:
        return any(x is item for x in container)
    return any(values_equal(item, x) for x in container)


def check_number(value: Any) -> Any:
    """Return an arithmetic result if it is within bounds (|int| <= 2**63, finite float); raise ``Fault``."""
    if type(value) is int:
        if -MAX_INT <= value <= MAX_INT:
            return value
        raise Fault("integer result is out of range (|x| > 2**63)")
    if value - value == 0.0:  # false for inf and nan
        return value
    raise Fault("result is not a finite number")
