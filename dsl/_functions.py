"""The functions an expression may call: a plain dict of ``FunctionSpec``, nothing else is callable.

Each spec declares the kinds of its arguments; the compiler checks arity and the kinds it knows statically and
inserts runtime checks only for arguments whose kind it does not know (``any`` fields, optional fields). The
``result`` hook computes the static result type and enforces rules that a per-argument kind cannot say
(``min`` takes one list or several numbers; ``contains`` on a string needs a string).

``matches(text, pattern)`` takes its pattern as a string literal, compiled once at compile time. Python's
``re`` backtracks and has no time limit, so patterns that could backtrack catastrophically are rejected and
the rest run under a size bound:

- at most 200 characters;
- no repeated group (``*``, ``+``, ``{n,}``, ``{m,n}`` with n > 1) that contains a variable quantifier or an
  alternation, at any depth: ``(a+)+``, ``(a?){20}``, ``(a|aa)+``, ``((ab)*c)+`` are rejected (exponential);
  write ``[ab]*`` for ``(a|b)*``; ``(ab){3}`` and ``(?:a{2})+`` are fine;
- no backreferences (``\\1``, ``(?P=name)``), conditional groups, or the verbose flag ``(?x)``;
- a size bound for what remains polynomial (``.*a.*b`` is cubic on an adversarial text): without nested
  repetition a search tries, at each start position, at most every combination of quantifier counts, so its
  work is at most ``starts * (L + 1) ** unbounded * choices`` for a text of L characters (``starts`` is 1 when
  the pattern is anchored with ``^``/``\\A``, else L + 1; ``choices`` multiplies the ranges of bounded
  quantifiers and the alternatives). Compilation finds the longest L whose bound stays under
  ``MATCH_WORK_BUDGET`` steps; ``matches`` on a longer text is an ``ExpressionEvalError``. A pattern without
  unbounded quantifiers may search millions of characters; an unanchored ``\\w+x`` about 4,400; a pattern
  that could not search 256 characters is rejected at compile time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ._schema import BOOL, FLOAT, INT, STR, FieldType, Kind
from ._values import MAX_INT, NUMBER, Fault, check_number, describe_type, describe_value, kind_of, member

MAX_PATTERN_CHARS = 200
# Work bound of one matches() call, in backtracking steps (about 2 ns each in `re`: some 40 ms at worst).
MATCH_WORK_BUDGET = 20_000_000
# A pattern that could not search even this many characters within the budget is rejected at compile time.
MIN_SEARCHABLE_TEXT = 256

_NUM = NUMBER
_STR = frozenset({Kind.STR})
_ANY = frozenset({Kind.ANY})


class SignatureError(Exception):
    """Raised by a ``result`` hook: the arguments break a rule of the function. ``argument`` is the 0-based
    index of the argument to blame."""

    def __init__(self, message: str, argument: int) -> None:
        super().__init__(message)
        self.message = message
        self.argument = argument


class PatternError(Exception):
    """A ``matches`` pattern is invalid or unsafe."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One allow-listed function.

    ``params`` holds the accepted kinds of each argument (``Kind.FLOAT`` means any number, ``Kind.ANY`` any
    value); with ``variadic`` the last parameter repeats, so the function takes ``len(params)`` or more
    arguments. ``impl`` receives the evaluated arguments (already checked against ``params``) and raises
    ``Fault`` for a runtime failure. ``pattern_argument`` is the argument that must be a regex string literal.
    """

    name: str
    params: tuple[frozenset[Kind], ...]
    result: Callable[[Sequence[FieldType]], FieldType]
    impl: Callable[..., Any] = field(repr=False)
    signature: str
    variadic: bool = False
    pattern_argument: int | None = None

    def accepts(self, count: int) -> bool:
        return count >= len(self.params) if self.variadic else count == len(self.params)

    def param(self, index: int) -> frozenset[Kind]:
        return self.params[min(index, len(self.params) - 1)]


# -- result hooks (static types) ----------------------------------------------------------------------------


def _returns(t: FieldType) -> Callable[[Sequence[FieldType]], FieldType]:
    return lambda args: t


def _same_number(args: Sequence[FieldType]) -> FieldType:
    return INT if args[0].kind is Kind.INT else FLOAT


def _extreme_type(name: str) -> Callable[[Sequence[FieldType]], FieldType]:
    def result(args: Sequence[FieldType]) -> FieldType:
        if len(args) == 1 and args[0].kind is Kind.LIST:
            item = args[0].item
            if item is None or item.kind is Kind.ANY:
                return FLOAT
            if item.kind not in NUMBER:
                raise SignatureError(f"{name}() of a list needs numbers, got {describe_type(args[0])}", 0)
            return INT if item.kind is Kind.INT else FLOAT
        for i, t in enumerate(args):
            if len(args) > 1 and t.kind is Kind.LIST:
                raise SignatureError(
                    f"{name}() takes one list or several numbers, not a list among others", i
                )
        return INT if all(t.kind is Kind.INT for t in args) else FLOAT

    return result


def _contains_type(args: Sequence[FieldType]) -> FieldType:
    container, item = args
    if container.kind is Kind.STR and item.kind not in (Kind.STR, Kind.ANY):
        raise SignatureError(
            f"contains() on a string needs a string to look for, got {describe_type(item)}", 1
        )
    return BOOL


# -- implementations (runtime) ------------------------------------------------------------------------------


def _extreme(name: str, pick: Callable[..., Any]) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        if len(args) == 1:
            (only,) = args
            if kind_of(only) is Kind.LIST:
                if len(only) == 0:
                    raise Fault(f"{name}() of an empty list")
                value = pick(only)
            else:
                value = only
        else:
            if any(kind_of(a) is Kind.LIST for a in args):
                raise Fault(f"{name}() takes one list or several numbers, not a list among others")
            value = pick(args)
        # The items of a list are not checked when the view is read; the one picked is checked here.
        if type(value) is int or type(value) is float or kind_of(value) in NUMBER:
            return value
        raise Fault(f"{name}() needs numbers, got {describe_value(value)}")

    return impl


def _abs(x: Any) -> Any:
    return check_number(abs(x))


def _to_int(x: Any) -> int:
    if kind_of(x) is Kind.STR:
        text = x.strip()
        if len(text) > 24:
            raise Fault(f"int() of a {len(text)}-character string is out of range")
        try:
            return check_number(int(text, 10))
        except ValueError:
            raise Fault(f"int() cannot convert {text[:40]!r}") from None
    value = int(x)  # a view's inf or nan raises OverflowError or ValueError here, which the call converts
    if -MAX_INT <= value <= MAX_INT:
        return value
    raise Fault("int() result is out of range (|x| > 2**63)")


def _to_float(x: Any) -> float:
    if kind_of(x) is Kind.STR:
        text = x.strip()
        if len(text) > 400:
            raise Fault(f"float() of a {len(text)}-character string")
        try:
            value = float(text)
        except ValueError:
            raise Fault(f"float() cannot convert {text[:40]!r}") from None
        return check_number(value)
    return check_number(float(x))


def _to_str(x: Any) -> str:
    return str(x) if kind_of(x) is not Kind.STR else x


def _contains(container: Any, item: Any) -> bool:
    return member(item, container)


def _matches(text: str, pattern: SafePattern) -> bool:
    if len(text) > pattern.max_text:
        raise Fault(
            f"matches() text of {len(text)} characters is longer than this pattern may search "
            f"({pattern.max_text}); "
            "anchor the pattern with '^' or use fewer unbounded quantifiers"
        )
    return pattern.regex.search(text) is not None


FUNCTIONS: Mapping[str, FunctionSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            FunctionSpec(
                "len", (frozenset({Kind.STR, Kind.LIST}),), _returns(INT), len, "len(str | list) -> int"
            ),
            FunctionSpec(
                "min",
                (_NUM | {Kind.LIST},),
                _extreme_type("min"),
                _extreme("min", min),
                "min(number, ...) | min(list) -> number",
                variadic=True,
            ),
            FunctionSpec(
                "max",
                (_NUM | {Kind.LIST},),
                _extreme_type("max"),
                _extreme("max", max),
                "max(number, ...) | max(list) -> number",
                variadic=True,
            ),
            FunctionSpec("abs", (_NUM,), _same_number, _abs, "abs(number) -> number"),
            FunctionSpec("lower", (_STR,), _returns(STR), str.lower, "lower(str) -> str"),
            FunctionSpec("upper", (_STR,), _returns(STR), str.upper, "upper(str) -> str"),
            FunctionSpec(
                "startswith", (_STR, _STR), _returns(BOOL), str.startswith, "startswith(str, str) -> bool"
            ),
            FunctionSpec(
                "endswith", (_STR, _STR), _returns(BOOL), str.endswith, "endswith(str, str) -> bool"
            ),
            FunctionSpec(
                "contains",
                (frozenset({Kind.STR, Kind.LIST}), _ANY),
                _contains_type,
                _contains,
                "contains(str | list, any) -> bool",
            ),
            FunctionSpec(
                "matches",
                (_STR, _STR),
                _returns(BOOL),
                _matches,
                "matches(str, 'pattern') -> bool",
                pattern_argument=1,
            ),
            FunctionSpec("int", (_NUM | _STR,), _returns(INT), _to_int, "int(number | str) -> int"),
            FunctionSpec("float", (_NUM | _STR,), _returns(FLOAT), _to_float, "float(number | str) -> float"),
            FunctionSpec("str", (_NUM | _STR,), _returns(STR), _to_str, "str(number | str) -> str"),
        )
    }
)


# -- regex safety -------------------------------------------------------------------------------------------

_BRACE = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")
_GROUP_OPENERS = ("(?:", "(?=", "(?!", "(?<=", "(?<!", "(?>")


@dataclass(frozen=True, slots=True)
class SafePattern:
    """A compiled ``matches`` pattern and the longest text it may search (its work bound: see the module)."""

    regex: re.Pattern[str]
    max_text: int


@dataclass(slots=True)
class _Group:
    variable: bool = False  # contains a quantifier with a variable count, at any depth
    alternation: bool = False  # contains '|', at any depth


@dataclass(slots=True)
class _Shape:
    """What the scan learns about a pattern: the inputs of its work bound."""

    unbounded: int = 0  # quantifiers without an upper bound: * + {n,}
    choices: int = 1  # product of (range + 1) over bounded variable quantifiers, times the alternatives
    multiline: bool = False
    top_alternation: bool = False


def compile_pattern(pattern: str) -> SafePattern:
    """Compile a ``matches`` pattern, or raise ``PatternError`` if it is invalid or could backtrack
    catastrophically (see the module docstring for the rules and the work bound)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"pattern of {len(pattern)} characters is longer than {MAX_PATTERN_CHARS}")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise PatternError(f"invalid pattern: {exc.msg}") from None
    shape = _scan(pattern)
    anchored = pattern.startswith(("^", "\\A")) and not shape.top_alternation and not shape.multiline
    max_text = _max_text(anchored, shape)
    if max_text < MIN_SEARCHABLE_TEXT:
        raise PatternError(
            f"pattern is too costly to run: it could only search texts of {max_text} characters "
            f"(use fewer unbounded quantifiers or anchor it with '^')"
        )
    return SafePattern(compiled, max_text)


def _work(length: int, anchored: bool, shape: _Shape) -> int:
    """Upper bound of the backtracking steps of a search over ``length`` characters: each start position tries
    at most every combination of quantifier counts and alternatives (no group repeats, so none multiplies)."""
    starts = 1 if anchored else length + 1
    return starts * shape.choices * (length + 1) ** shape.unbounded


def _max_text(anchored: bool, shape: _Shape) -> int:
    """The longest text whose work bound stays within ``MATCH_WORK_BUDGET`` (binary search)."""
    low, high = 0, MATCH_WORK_BUDGET
    while low < high:
        mid = (low + high + 1) // 2
        if _work(mid, anchored, shape) <= MATCH_WORK_BUDGET:
            low = mid
        else:
            high = mid - 1
    return low


def _scan(p: str) -> _Shape:
    """Scan a pattern that ``re`` accepted: track groups, reject a repeated group that holds a variable
    quantifier or an alternation and the constructs listed in the module docstring, and measure its shape."""
    stack = [_Group()]
    shape = _Shape()
    last_group: _Group | None = None  # the group that ended right before the current character, if any
    i = 0
    while i < len(p):
        ch = p[i]
        closed = None
        if ch == "\\":
            if p[i + 1 : i + 2] in tuple("123456789"):
                raise PatternError("backreferences are not allowed in patterns")
            i += 2
        elif ch == "[":
            i = _skip_class(p, i)
        elif ch == "(":
            i = _open_group(p, i, stack, shape)
        elif ch == ")":
            closed = stack.pop()
            stack[-1].variable |= closed.variable
            stack[-1].alternation |= closed.alternation
            i += 1
        elif ch == "|":
            stack[-1].alternation = True
            shape.top_alternation |= len(stack) == 1
            shape.choices *= 2  # at most doubles the paths, wherever it sits
            i += 1
        elif ch in "*+?" or (ch == "{" and _BRACE.match(p, i)):
            end, low, high = _quantifier(p, i)
            repeats = high is None or high > 1
            if repeats and last_group is not None and (last_group.variable or last_group.alternation):
                raise PatternError(
                    "nested quantifier: a repeated group may contain neither a variable quantifier nor '|' "
                    "(it could backtrack catastrophically)"
                )
            if high is None:
                shape.unbounded += 1
            elif high > low:
                shape.choices *= high - low + 1
            if high is None or high > low:
                stack[-1].variable = True
            shape.choices = min(shape.choices, MATCH_WORK_BUDGET + 1)
            i = end
        else:
            i += 1
        last_group = closed
    return shape


def _skip_class(p: str, i: int) -> int:
    """Index just after the character class that starts at ``p[i] == '['``."""
    i += 1
    if p[i : i + 1] == "^":
        i += 1
    if p[i : i + 1] == "]":  # a ']' first in a class is literal
        i += 1
    while p[i] != "]":
        i += 2 if p[i] == "\\" else 1
    return i + 1


def _open_group(p: str, i: int, stack: list[_Group], shape: _Shape) -> int:
    if p.startswith("(?P=", i) or p.startswith("(?(", i):
        raise PatternError("backreferences and conditional groups are not allowed in patterns")
    if p.startswith("(?#", i):
        return p.index(")", i) + 1  # a comment: nothing inside counts
    if p.startswith("(?P<", i):
        stack.append(_Group())
        return p.index(">", i) + 1
    for opener in _GROUP_OPENERS:
        if p.startswith(opener, i):
            stack.append(_Group())
            return i + len(opener)
    if p.startswith("(?", i):
        # Inline flags: '(?i)' applies to the whole pattern, '(?i:...)' opens a group.
        j = i + 2
        while p[j] not in ":)":
            j += 1
        flags = p[i + 2 : j]
        if "x" in flags:
            raise PatternError("the verbose flag (?x) is not allowed in patterns")
        shape.multiline |= "m" in flags.split("-")[0]
        if p[j] == ")":
            return j + 1
        stack.append(_Group())
        return j + 1
    stack.append(_Group())
    return i + 1


def _quantifier(p: str, i: int) -> tuple[int, int, int | None]:
    """End of the quantifier at ``p[i]`` (with its lazy '?' or possessive '+' suffix) and its count range
    (``None`` as the upper end when it is unbounded)."""
    if p[i] == "{":
        match = _BRACE.match(p, i)
        assert match is not None
        low_text, comma, high_text = match.groups()
        low = int(low_text or 0)
        high = int(high_text) if high_text else (None if comma else low)
        end = match.end()
    else:
        low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[p[i]]
        end = i + 1
    if p[end : end + 1] in ("?", "+"):
        end += 1
    return end, low, high
