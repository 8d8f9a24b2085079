"""The request view's declared shape: which fields an expression may read, and their types.

An expression is compiled against a ``RequestSchema``; a name or attribute that the schema does not declare is
rejected at compile time, so at request time the evaluator never looks anything up that was not declared.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class Kind(enum.Enum):
    """Value types the language knows. ``ANY`` switches static checks off for that value."""

    INT = "int"
    FLOAT = "float"  # any number: int or float
    STR = "str"
    BOOL = "bool"
    LIST = "list"
    RECORD = "record"
    NONE = "none"
    ANY = "any"


@dataclass(frozen=True, slots=True)
class FieldType:
    """The type of a declared field. ``item`` is the element type of a list; ``fields`` the members of a record.

    ``optional`` fields may be ``None`` in a view (``seed`` is unset unless the caller fixes it).
    """

    kind: Kind
    item: FieldType | None = None
    fields: Mapping[str, FieldType] = field(default_factory=lambda: MappingProxyType({}))
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.fields, MappingProxyType):
            object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


INT = FieldType(Kind.INT)
FLOAT = FieldType(Kind.FLOAT)
STR = FieldType(Kind.STR)
BOOL = FieldType(Kind.BOOL)
ANY = FieldType(Kind.ANY)


def list_of(item: FieldType) -> FieldType:
    return FieldType(Kind.LIST, item=item)


def record(**fields: FieldType) -> FieldType:
    return FieldType(Kind.RECORD, fields=fields)


def optional(t: FieldType) -> FieldType:
    return FieldType(t.kind, item=t.item, fields=t.fields, optional=True)


@dataclass(frozen=True, slots=True)
class RequestSchema:
    """Top-level fields of a request view. Hashable, so compiled expressions can be cached per schema."""

    fields: Mapping[str, FieldType]

    def __post_init__(self) -> None:
        if not isinstance(self.fields, MappingProxyType):
            object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, _type_key(v)) for k, v in self.fields.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestSchema) and hash(self) == hash(other) and dict(self.fields) == dict(
            other.fields
        )

    def extend(self, extra: Mapping[str, FieldType]) -> RequestSchema:
        """A schema with ``extra`` fields added (an extra field replaces a standard one of the same name)."""
        return RequestSchema({**self.fields, **extra})


def _type_key(t: FieldType) -> tuple:
    return (
        t.kind.value,
        _type_key(t.item) if t.item else None,
        tuple(sorted((k, _type_key(v)) for k, v in t.fields.items())),
        t.optional,
    )


# The fields every request view has. A decorated function adds its own parameters; a policy may declare more.
STANDARD_FIELDS: Mapping[str, FieldType] = MappingProxyType(
    {
        "input_ids": list_of(INT),
        "prompt": STR,
        "model": STR,
        "model_revision": STR,
        "temperature": FLOAT,
        "top_k": INT,
        "top_p": FLOAT,
        "max_tokens": INT,
        "seed": optional(INT),
        "stream": BOOL,
        "tenant": record(id=STR, tier=STR),
    }
)

STANDARD_SCHEMA = RequestSchema(STANDARD_FIELDS)

# Type names accepted where a document declares extra fields (`fields: {route: str}` in a policy).
TYPE_NAMES: Mapping[str, FieldType] = MappingProxyType(
    {
        "int": INT,
        "float": FLOAT,
        "number": FLOAT,
        "str": STR,
        "bool": BOOL,
        "list": list_of(ANY),
        "list[int]": list_of(INT),
        "list[str]": list_of(STR),
        "any": ANY,
    }
)
