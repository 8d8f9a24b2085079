"""The functions an expression may call: a plain dict of ``FunctionSpec``, nothing else is callable.

Each spec declares the kinds of its arguments; the compiler checks arity and the kinds it knows statically and
inserts runtime checks only for arguments whose kind it does not know (``any`` fields, optional fields). The
``result`` hook computes the static result type and enforces rules that a per-argument kind cannot say
(``min`` takes one list or several numbers; ``contains`` on a string needs a string).

``matches(text, pattern)`` takes its pattern as a string literal, compiled once at compile time by RE2
(google-re2), which matches in time linear in the text whatever the pattern: there is no backtracking to
bound. The pattern syntax is RE2's (no backreferences, no lookaround, no possessive or atomic groups, no
comments or verbose mode); a pattern RE2 cannot compile is an ``ExpressionCompileError`` at the literal.
Three bounds remain, all in docs/policy-language.md, "Patterns":

- the compiled program has at most ``MAX_PROGRAM_SIZE`` instructions (``a{1000}`` is 1,000 of them, a
  Unicode class such as ``\\pL`` about 1,200), and RE2 compiles within ``PATTERN_MAX_MEM`` bytes;
- the compiled pattern and its automaton cache then use at most ``pattern_memory(program size)``: 1 KiB per
  instruction, at least ``PATTERN_MIN_MEM``;
- a search costs at most about one step per program instruction per byte of text (RE2's automaton falls
  back to simulating every instruction on texts that defeat its cache). The patterns evaluated together
  share one ``MATCH_WORK_BUDGET``: those of one expression, and in a policy those of every rule, since one
  decision may test them all. Each may search at most ``MATCH_WORK_BUDGET // P`` bytes of UTF-8, where P is
  the sum of their program sizes (``match_allowance``), and never more than ``MAX_MATCH_BYTES``. A longer
  text is an ``ExpressionEvalError``, which ``Policy.decide`` treats as the rule not holding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import functools
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import re2

from ._schema import BOOL, FLOAT, INT, STR, FieldType, Kind
from ._values import MAX_INT, NUMBER, Fault, check_number, describe_type, describe_value, kind_of, member

# Work bound of one matches() call, in program instructions times bytes of text: RE2 simulating its whole
# program on every byte costs some 9 ns per unit, so about 0.3 s at worst; its cached automaton, the usual
# case, reads a byte in about 1 ns whatever the program.
MATCH_WORK_BUDGET = 2**25
MAX_MATCH_BYTES = 2**22  # 4 MiB of UTF-8: the longest text any pattern may search
MAX_PROGRAM_SIZE = 2**13  # so that every accepted pattern may search at least 4 KiB
# Characters or items that the operations which read a whole text or list (lower, upper, contains, `in`,
# min/max of a list, int/float of a text) may read in one decision, shared by those of a policy: about 0.2 s
# at the 0.8 ns a character they cost. See docs/policy-language.md, "Bounds".
MAX_SCAN_WORK = 2**28
# A list item costs some 256 times a character: compared in Python (two lists of the request), about 350 ns.
SCAN_ITEM_COST = 256
PATTERN_MAX_MEM = 8 << 20  # RE2's memory to compile a pattern (its default): a larger one is refused
# RE2's memory for a compiled pattern and its automaton cache, by program size: the patterns of a policy (at
# most MAX_PROGRAM_SIZE instructions in all) hold at most PATTERN_MAX_MEM, plus PATTERN_MIN_MEM for each small
# one. A smaller cache makes RE2 fall back sooner to running the program, which the work budget counts; see
# docs/policy-language.md, "Patterns", for what 8 MiB per pattern cost.
PATTERN_MEM_PER_INSTRUCTION = PATTERN_MAX_MEM // MAX_PROGRAM_SIZE  # 1 KiB
PATTERN_MIN_MEM = 32 << 10

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
    ``Fault`` for a runtime failure. ``pattern_argument`` is the argument that must be a regex string literal;
    ``scanned`` the argument whose whole text or list the call reads (its length is bounded at run time).
    """

    name: str
    params: tuple[frozenset[Kind], ...]
    result: Callable[[Sequence[FieldType]], FieldType]
    impl: Callable[..., Any] = field(repr=False)
    signature: str
    variadic: bool = False
    pattern_argument: int | None = None
    scanned: int | None = None

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
    return pattern.search(text)


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
                scanned=0,
            ),
            FunctionSpec(
                "max",
                (_NUM | {Kind.LIST},),
                _extreme_type("max"),
                _extreme("max", max),
                "max(number, ...) | max(list) -> number",
                variadic=True,
                scanned=0,
            ),
            FunctionSpec("abs", (_NUM,), _same_number, _abs, "abs(number) -> number"),
            FunctionSpec("lower", (_STR,), _returns(STR), str.lower, "lower(str) -> str", scanned=0),
            FunctionSpec("upper", (_STR,), _returns(STR), str.upper, "upper(str) -> str", scanned=0),
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
                scanned=0,
            ),
            FunctionSpec(
                "matches",
                (_STR, _STR),
                _returns(BOOL),
                _matches,
                "matches(str, 'pattern') -> bool",
                pattern_argument=1,
            ),
            FunctionSpec(
                "int", (_NUM | _STR,), _returns(INT), _to_int, "int(number | str) -> int", scanned=0
            ),
            FunctionSpec(
                "float", (_NUM | _STR,), _returns(FLOAT), _to_float, "float(number | str) -> float", scanned=0
            ),
            FunctionSpec("str", (_NUM | _STR,), _returns(STR), _to_str, "str(number | str) -> str"),
        )
    }
)


# -- patterns -----------------------------------------------------------------------------------------------


def pattern_memory(program_size: int) -> int:
    """The memory RE2 may use for a compiled pattern of ``program_size`` instructions and its automaton cache."""
    return max(PATTERN_MIN_MEM, program_size * PATTERN_MEM_PER_INSTRUCTION)


def _pattern_options(max_mem: int) -> re2.Options:
    options = re2.Options()
    options.max_mem = max_mem
    options.never_capture = True  # only whether it matches counts: no submatch bookkeeping
    options.log_errors = False  # a rejected pattern is reported as a compile error, not logged to stderr
    return options


def scan_allowance(scans: int) -> int:
    """The longest text or list, in characters or items, that each of ``scans`` operations sharing one scan
    budget may read: ``MAX_SCAN_WORK // scans``."""
    return MAX_SCAN_WORK // max(scans, 1)


def match_allowance(program_size: int) -> int:
    """The longest text, in UTF-8 bytes, that each of a set of patterns sharing one work budget may search:
    ``MATCH_WORK_BUDGET // program_size`` (the sum of their program sizes), at most ``MAX_MATCH_BYTES``."""
    return min(MAX_MATCH_BYTES, MATCH_WORK_BUDGET // max(program_size, 1))


@dataclass(frozen=True, slots=True)
class SafePattern:
    """A compiled ``matches`` pattern: its RE2 program size and the longest text, in UTF-8 bytes, it may search
    (alone: ``match_allowance(program_size)``; sharing the budget with others: ``sharing``)."""

    regex: re2._Regexp
    program_size: int
    max_bytes: int
    shared_size: int = 0  # the program size of every pattern sharing its budget, 0 when alone

    def sharing(self, program_size: int) -> SafePattern:
        """This pattern searching at most ``match_allowance(program_size)`` bytes, where ``program_size`` is
        the sum over every pattern that shares the budget with it (this one included)."""
        if program_size <= self.program_size:
            return self
        return replace(self, max_bytes=match_allowance(program_size), shared_size=program_size)

    def search(self, text: str) -> bool:
        """Whether the pattern matches anywhere in ``text``. Raises ``Fault`` for a text longer than
        ``max_bytes``. A lone surrogate in ``text`` does not fail the call: it is searched as an invalid UTF-8
        sequence, which ``.`` and negated classes match."""
        if len(text) > self.max_bytes:  # a character is at least one byte: too long without encoding it
            raise self._too_long(len(text), "characters")
        data = text.encode("utf-8", "surrogatepass")
        if len(data) > self.max_bytes:
            raise self._too_long(len(data), "bytes of UTF-8")
        return self.regex.search(data) is not None

    def _too_long(self, size: int, unit: str) -> Fault:
        shared = (
            f"; it shares its work budget with patterns of {self.shared_size - self.program_size} more"
            if self.shared_size
            else ""
        )
        return Fault(
            f"matches() text of {size} {unit} is longer than this pattern may search ({self.max_bytes} bytes; "
            f"its program has {self.program_size} instructions{shared})"
        )


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> SafePattern:
    """Compile a ``matches`` pattern with RE2, or raise ``PatternError`` if RE2 rejects it (its syntax, its
    memory) or its program is larger than ``MAX_PROGRAM_SIZE``. The result searches at most
    ``match_allowance(program_size)`` bytes. Cached: a compiled RE2 pattern is immutable and thread-safe."""
    try:
        pattern.encode("utf-8")  # RE2 reads UTF-8: a lone surrogate would fail its binding's encoding
    except UnicodeEncodeError as exc:
        raise PatternError(
            f"invalid pattern: a lone surrogate (U+{ord(pattern[exc.start]):04X}) is not text (in the text "
            "searched, '.' and negated classes match one)"
        ) from None
    try:
        regex = re2.compile(pattern, _pattern_options(PATTERN_MAX_MEM))
    except re2.error as exc:
        message = _re2_message(exc)
        if message.startswith("pattern too large"):
            raise PatternError(
                f"pattern is too large: RE2 cannot compile it within {PATTERN_MAX_MEM} bytes"
            ) from None
        if message.startswith("invalid repetition size"):
            hint = "a count is at most 1000, and nested counts multiply: (a{100}){10} is the most"
        else:
            hint = "patterns use RE2 syntax: no backreferences, lookaround or comments"
        raise PatternError(f"invalid pattern: {message} ({hint})") from None
    size = regex.programsize
    if size > MAX_PROGRAM_SIZE:
        raise PatternError(
            f"pattern is too large: it compiles to {size} instructions; the limit is {MAX_PROGRAM_SIZE}"
        )
    # Compiled again within the memory its size is allowed (at most PATTERN_MAX_MEM, within which it compiled).
    regex = re2.compile(pattern, _pattern_options(pattern_memory(size)))
    return SafePattern(regex, size, match_allowance(size))


def _re2_message(exc: re2.error) -> str:
    detail = exc.args[0] if exc.args else ""  # RE2's own message, as bytes
    return detail.decode("utf-8", "backslashreplace") if isinstance(detail, bytes) else str(detail)
