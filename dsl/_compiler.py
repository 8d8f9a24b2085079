"""Compiler: syntax tree + ``RequestSchema`` -> a tree of closures, type-checked on the way; ``Expression``.

Every node becomes one closure ``fn(view) -> value``. All decisions (which operator, which checks, which
constant) are made here, once, so evaluation does no dispatch on strings or node types: a compiled
``512 <= len(input_ids) <= 2048 and top_k <= 10`` is four nested closure calls around C operators.

Static types come from the schema and flow bottom-up. Where both sides of an operation have known kinds a
mismatch is an ``ExpressionCompileError``; where a kind is not known (``any`` fields) or a value may be none
(optional fields), a runtime check is inserted and a mismatch is an ``ExpressionEvalError``. Values read from
the view are checked against their declared type when read, so every later step can trust the static type.
A node whose operands are all constant is evaluated at compile time; an evaluation error there (``1 // 0``,
``[1][3]``) becomes an ``ExpressionCompileError`` at the same position.

The language, in short:

- literals: ints, floats, 'str' and "str" (escapes \\n \\t \\" \\' \\\\ only), true/false/none (or
  True/False/None), lists ``[1, 2, "a"]``; a list value is a tuple at runtime;
- ``or``, ``and``, ``not`` take bools only (``top_k and x`` is an error, not a truthiness test);
- ``== != < <= > >=`` chain as in Python; ``==`` never equates a bool with a number; ordering needs two
  numbers or two strings; comparing a none with anything by ``==`` is allowed (``seed == none``);
- ``in``/``not in``: list membership or substring; ``+`` adds numbers or joins strings (at most 64 KiB);
  ``- * / // %`` on numbers; unary ``-``. There is no ``**`` and no string or list repetition; every integer
  result stays within |x| <= 2**63 and every float result is finite;
- ``tenant.tier``: members of a record the schema declares; ``input_ids[0]``: an int index into a list;
- calls: only the functions in ``FUNCTIONS``, by name;
- bounds: 4096 characters of source, nesting depth 32, string literals of 1024 characters, 256 list items;
  at run time the ``matches`` calls share one work budget and the operations that read a whole text or list
  another (``compile_expression``).
"""

from __future__ import annotations

import difflib
import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._ast import (
    Attribute,
    Binary,
    BoolOp,
    Call,
    Compare,
    CompareOp,
    Index,
    ListExpr,
    Literal,
    Name,
    Node,
    Unary,
)
from ._ast import start as start_of
from ._functions import (
    FUNCTIONS,
    MAX_PROGRAM_SIZE,
    SCAN_ITEM_COST,
    FunctionSpec,
    PatternError,
    SignatureError,
    compile_pattern,
    match_allowance,
    scan_allowance,
)
from ._parser import parse
from ._schema import ANY, BOOL, FLOAT, INT, STANDARD_SCHEMA, STR, FieldType, Kind, RequestSchema, list_of
from ._values import (
    MAX_STRING_BUILD,
    NUMBER,
    Fault,
    accepted_kinds,
    check_number,
    describe_kinds,
    describe_type,
    describe_value,
    exact_types,
    kind_of,
    member,
    values_equal,
    widen,
)
from .errors import ExpressionCompileError, ExpressionEvalError

View = Mapping[str, Any]
Fn = Callable[[View], Any]

NONE_TYPE = FieldType(Kind.NONE)
_BOOL_KINDS = frozenset({Kind.BOOL})
_STR_KINDS = frozenset({Kind.STR})
_LIST_KINDS = frozenset({Kind.LIST})
_INT_KINDS = frozenset({Kind.INT})
_ORDERED = NUMBER | _STR_KINDS
_LITERAL_TYPES: Mapping[type, FieldType] = {
    bool: BOOL,
    int: INT,
    float: FLOAT,
    str: STR,
    type(None): NONE_TYPE,
}
_ARITHMETIC: Mapping[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
}
_ORDERING: Mapping[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
# Python errors an operation on checked values can still raise (overflow of a float conversion, a recursive
# list compared with itself); they become ExpressionEvalError. Anything else is a bug and propagates.
_EXPECTED = (TypeError, ValueError, OverflowError, ZeroDivisionError, RecursionError)


@dataclass(frozen=True, slots=True)
class Expression:
    """A compiled expression. Build it with ``compile_expression``.

    ``fields`` are the top-level request fields it reads; ``result_type`` is its static type (``Kind.ANY``
    where it depends on an ``any`` field); ``pattern_size`` is the sum of the RE2 program sizes of its
    ``matches`` calls (0 without any), and ``shared_pattern_size`` the total that their work budget is shared
    with; ``scans`` is the number of its operations that read a whole text or list of the request, and
    ``shared_scans`` the number that their scan budget is shared with (see ``compile_expression``).
    """

    source: str
    fields: frozenset[str]
    result_type: FieldType = field(repr=False)
    pattern_size: int = field(repr=False)
    shared_pattern_size: int = field(repr=False)
    scans: int = field(repr=False)
    shared_scans: int = field(repr=False)
    _fn: Fn = field(repr=False, compare=False)
    _start: tuple[int, int] = field(repr=False, compare=False)

    def evaluate(self, view: Mapping[str, Any]) -> Any:
        """The value of the expression on a request view (a list comes back as a tuple or as the view's list).

        Raises ``ExpressionEvalError`` for a field missing from the view, a value of the wrong type, a bound
        exceeded, a division by zero or an index out of range; nothing else. A ``view`` that is not a Mapping
        is a caller bug and raises ``TypeError``.
        """
        if type(view) is not dict and not isinstance(view, Mapping):
            raise TypeError(f"a request view must be a Mapping, got {type(view).__name__}")
        return self._fn(view)

    def test(self, view: Mapping[str, Any]) -> bool:
        """``evaluate``, for a condition: a result that is not a bool raises ``ExpressionEvalError``."""
        if type(view) is not dict and not isinstance(view, Mapping):
            raise TypeError(f"a request view must be a Mapping, got {type(view).__name__}")
        result = self._fn(view)
        if result is True or result is False:
            return result
        raise ExpressionEvalError(
            f"a condition must give a bool, this one gave {describe_value(result)}", self.source, *self._start
        )


def compile_expression(
    source: str,
    schema: RequestSchema = STANDARD_SCHEMA,
    *,
    shared_pattern_size: int = 0,
    shared_scans: int = 0,
) -> Expression:
    """Compile ``source`` against ``schema``; results are cached per (source, schema, shared sizes).

    The ``matches`` calls of one expression share one work budget: each may search at most
    ``match_allowance(P)`` bytes, where P is the sum of their program sizes (``Expression.pattern_size``).
    The operations that read a whole text or list of the request (lower, upper, contains, ``in`` on a value
    that is not a literal, min/max, int/float) share another: each may read at most ``scan_allowance(S)``
    characters or items, S their number (``Expression.scans``). ``shared_pattern_size`` and
    ``shared_scans`` widen P and S to other expressions evaluated along with this one (a policy passes the
    sums over all its rules, since one decision may test every rule); a value below the expression's own
    counts as that.

    Raises ``ExpressionSyntaxError`` for malformed text and ``ExpressionCompileError`` for unknown names,
    fields or functions, type errors visible without a request, and bounds broken by literals (both carry the
    line and column of the offending token). A ``source`` that is not a str or a ``schema`` that is not a
    RequestSchema raises ``TypeError``.
    """
    if not isinstance(source, str):
        raise TypeError(f"an expression must be a str, got {type(source).__name__}")
    if not isinstance(schema, RequestSchema):
        raise TypeError(f"schema must be a RequestSchema, got {type(schema).__name__}")
    for name, value in (("shared_pattern_size", shared_pattern_size), ("shared_scans", shared_scans)):
        if type(value) is not int or value < 0:
            raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    return _compile_cached(source, schema, shared_pattern_size, shared_scans)


@functools.lru_cache(maxsize=2048)
def _compile_cached(
    source: str, schema: RequestSchema, shared_pattern_size: int, shared_scans: int
) -> Expression:
    tree = parse(source)
    found: list[tuple[int, int, int]] = []
    scans = _bounded_operations(tree, found)
    patterns = sorted(found)
    own = sum(size for _, _, size in patterns)
    shared = max(own, shared_pattern_size)
    if shared > MAX_PROGRAM_SIZE:
        # Point at the pattern whose program crosses the limit (the patterns before this expression's first
        # count as written before it).
        total = shared - own
        for line, column, size in patterns:
            total += size
            if total > MAX_PROGRAM_SIZE:
                raise ExpressionCompileError(
                    f"the matches() patterns up to this one share a work budget and compile to {total} "
                    f"instructions in all; the limit is {MAX_PROGRAM_SIZE}, so that each may search at least "
                    f"{match_allowance(MAX_PROGRAM_SIZE)} bytes",
                    source,
                    line,
                    column,
                )
    shared_scan_count = max(scans, shared_scans)
    compiler = _Compiler(source, schema, shared, scan_allowance(shared_scan_count), shared_scan_count)
    code = compiler.compile(tree)
    return Expression(
        source,
        frozenset(compiler.fields),
        code.type,
        own,
        shared,
        scans,
        shared_scan_count,
        code.fn,
        start_of(tree),
    )


def _bounded_operations(tree: Node, patterns: list[tuple[int, int, int]]) -> int:
    """The operations of ``tree`` that share a budget, found before anything is compiled (so that each knows
    the budget it shares): the line, column and program size of each ``matches`` pattern, one per call,
    appended to ``patterns``, and the number of operations that read a whole text or list, returned. A
    pattern that does not compile is left out here; compiling the call reports it at its position."""
    scans = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Call):
            spec = FUNCTIONS.get(node.callee.name) if isinstance(node.callee, Name) else None
            index = None if spec is None else spec.pattern_argument
            if index is not None and index < len(node.args):
                pattern = node.args[index]
                if isinstance(pattern, Literal) and isinstance(pattern.value, str):
                    try:
                        size = compile_pattern(pattern.value).program_size
                        patterns.append((pattern.line, pattern.column, size))
                    except PatternError:
                        pass
            scans += spec is not None and spec.scanned is not None
            stack.append(node.callee)
            stack.extend(node.args)
        else:
            if isinstance(node, Compare):
                # Membership, and an equality that may compare two lists item by item.
                scans += sum(
                    op.symbol in ("in", "not in", "==", "!=") and not isinstance(right, Literal | ListExpr)
                    for op, right in zip(node.ops, node.operands[1:], strict=True)
                )
            stack.extend(_children(node))
    return scans


def _children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, ListExpr):
        return node.items
    if isinstance(node, Attribute):
        return (node.target,)
    if isinstance(node, Index):
        return (node.target, node.index)
    if isinstance(node, Unary):
        return (node.operand,)
    if isinstance(node, Binary):
        return (node.left, node.right)
    if isinstance(node, BoolOp | Compare):
        return node.operands
    return ()  # Literal, Name


# -- compiled code ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Code:
    """One compiled node: its closure, its static type, and its value when it is constant."""

    fn: Fn
    type: FieldType
    const: bool = False
    value: Any = None


def _constant(value: Any, type_: FieldType) -> _Code:
    def const(view: View) -> Any:
        return value

    return _Code(const, type_, True, value)


@dataclass(frozen=True, slots=True)
class _Where:
    """A position in the source, captured by closures that may fail at request time."""

    source: str
    line: int
    column: int

    def error(self, message: str) -> ExpressionEvalError:
        return ExpressionEvalError(message, self.source, self.line, self.column)


def _family(kind: Kind) -> Kind:
    return Kind.FLOAT if kind in NUMBER else kind


def _known(t: FieldType) -> bool:
    return t.kind is not Kind.ANY


def _trusted(t: FieldType, kinds: frozenset[Kind]) -> bool:
    """Whether every runtime value of static type ``t`` certainly has one of ``kinds`` (no check needed)."""
    return accepted_kinds(t) <= widen(kinds)


class _Compiler:
    def __init__(
        self, source: str, schema: RequestSchema, pattern_size: int, scan_limit: int, scans: int
    ) -> None:
        self.source = source
        self.schema = schema
        self.pattern_size = pattern_size  # the total program size the matches work budget is shared by
        self.scan_limit = scan_limit  # the longest text or list an operation that reads one whole may read
        self.scans = scans  # the number of such operations that share the scan budget
        self.fields: set[str] = set()

    def compile(self, node: Node) -> _Code:
        return _COMPILE[type(node)](self, node)

    # -- helpers ---------------------------------------------------------------------------------------------

    def error(self, message: str, line: int, column: int) -> ExpressionCompileError:
        return ExpressionCompileError(message, self.source, line, column)

    def where(self, line: int, column: int) -> _Where:
        return _Where(self.source, line, column)

    def finish(self, fn: Fn, type_: FieldType, operands: Sequence[_Code]) -> _Code:
        """Wrap a closure; fold it into a constant now when all its operands are constant."""
        if not all(op.const for op in operands):
            return _Code(fn, type_)
        try:
            value = fn({})
        except ExpressionEvalError as exc:
            raise ExpressionCompileError(exc.message, self.source, exc.line, exc.column) from None
        return _constant(value, type_)

    def require(self, code: _Code, kinds: frozenset[Kind], what: str, node: Node) -> None:
        """Compile error unless ``code`` may have one of ``kinds``."""
        if _known(code.type) and code.type.kind not in widen(kinds):
            raise self.error(
                f"{what} must be {describe_kinds(kinds)}, got {describe_type(code.type)}", *start_of(node)
            )

    def guard(self, code: _Code, kinds: frozenset[Kind], what: str, node: Node) -> Fn:
        """``code.fn``, with a runtime kind check in front unless the static type guarantees ``kinds``."""
        if _trusted(code.type, kinds):
            return code.fn
        fn, fast, allowed = code.fn, exact_types(kinds), widen(kinds)
        where, expected = self.where(*start_of(node)), describe_kinds(kinds)

        def guarded(view: View) -> Any:
            value = fn(view)
            if type(value) in fast or kind_of(value) in allowed:
                return value
            raise where.error(f"{what} must be {expected}, got {describe_value(value)}")

        return guarded

    def checker(self, t: FieldType, where: _Where, what: str) -> Callable[[Any], Any] | None:
        """A function that checks a value read from the view against its declared type; None for ``any``."""
        if t.kind is Kind.ANY:
            return None
        fast, allowed, expected = exact_types(frozenset({t.kind})), accepted_kinds(t), describe_type(t)
        if t.optional:
            fast = fast | {type(None)}

        def check(value: Any) -> Any:
            if type(value) in fast or kind_of(value) in allowed:
                return value
            raise where.error(f"{what} must be {expected}, got {describe_value(value)}")

        return check

    # -- leaves ----------------------------------------------------------------------------------------------

    def literal(self, node: Literal) -> _Code:
        return _constant(node.value, _LITERAL_TYPES[type(node.value)])

    def list_expr(self, node: ListExpr) -> _Code:
        items = [self.compile(item) for item in node.items]
        fns = [item.fn for item in items]

        def build(view: View) -> tuple[Any, ...]:
            return tuple([fn(view) for fn in fns])

        return self.finish(build, list_of(_join([item.type for item in items])), items)

    def name(self, node: Name) -> _Code:
        name = node.name
        if name.startswith("__"):
            raise self.error("names starting with '__' are not allowed", node.line, node.column)
        declared = self.schema.fields.get(name)
        if declared is None:
            if name in FUNCTIONS:
                raise self.error(
                    f"'{name}' is a function: call it, as in {FUNCTIONS[name].signature}",
                    node.line,
                    node.column,
                )
            raise self.error(
                _unknown(f"unknown name '{name}'", name, self.schema.fields, "known fields"),
                node.line,
                node.column,
            )
        self.fields.add(name)
        where = self.where(node.line, node.column)
        check = self.checker(declared, where, f"field '{name}'")
        missing = f"the request view has no field '{name}'"
        if check is None:

            def read_any(view: View) -> Any:
                try:
                    return view[name]
                except KeyError:
                    raise where.error(missing) from None

            return _Code(read_any, declared)
        fast = exact_types(frozenset({declared.kind})) | ({type(None)} if declared.optional else set())

        def read(view: View) -> Any:
            try:
                value = view[name]
            except KeyError:
                raise where.error(missing) from None
            if type(value) in fast:
                return value
            return check(value)

        return _Code(read, declared)

    # -- postfix forms ---------------------------------------------------------------------------------------

    def attribute(self, node: Attribute) -> _Code:
        name = node.name
        if name.startswith("__"):
            raise self.error("attribute names starting with '__' are not allowed", node.line, node.column)
        target = self.compile(node.target)
        path = _path(node.target)
        record = target.type
        if record.kind is not Kind.RECORD or not record.fields:
            raise self.error(
                f"{path} is {describe_type(record)}, not a record with declared members: "
                f"'.{name}' is not allowed",
                node.line,
                node.column,
            )
        declared = record.fields.get(name)
        if declared is None:
            raise self.error(
                _unknown(f"{path} has no member '{name}'", name, record.fields, "known members"),
                node.line,
                node.column,
            )
        where = self.where(node.line, node.column)
        check = self.checker(declared, where, f"{path}.{name}") or (lambda value: value)
        get, missing = target.fn, f"{path} has no member '{name}' in this request"

        def read_member(view: View) -> Any:
            try:
                value = get(view)[name]
            except KeyError:
                raise where.error(missing) from None
            return check(value)

        return _Code(read_member, declared)

    def index(self, node: Index) -> _Code:
        target, index = self.compile(node.target), self.compile(node.index)
        self.require(target, _LIST_KINDS, "an indexed value", node.target)
        self.require(index, _INT_KINDS, "a list index", node.index)
        get_list = self.guard(target, _LIST_KINDS, "an indexed value", node.target)
        get_index = self.guard(index, _INT_KINDS, "a list index", node.index)
        item = target.type.item if target.type.kind is Kind.LIST and target.type.item is not None else ANY
        where = self.where(node.line, node.column)
        check = self.checker(item, where, "a list item") or (lambda value: value)

        def subscript(view: View) -> Any:
            items, i = get_list(view), get_index(view)
            try:
                value = items[i]
            except IndexError:
                raise where.error(f"index {i} is out of range for a list of {len(items)} items") from None
            return check(value)

        return self.finish(subscript, item, [target, index])

    def call(self, node: Call) -> _Code:
        callee = node.callee
        if not isinstance(callee, Name):
            raise self.error(
                f"only the allow-listed functions can be called ({', '.join(sorted(FUNCTIONS))})",
                node.line,
                node.column,
            )
        name = callee.name
        spec = FUNCTIONS.get(name)
        if spec is None:
            if name.startswith("__"):
                raise self.error("names starting with '__' are not allowed", callee.line, callee.column)
            raise self.error(
                _unknown(f"unknown function '{name}'", name, FUNCTIONS, "known functions"),
                callee.line,
                callee.column,
            )
        if not spec.accepts(len(node.args)):
            count = len(spec.params)
            wanted = f"{'at least ' if spec.variadic else ''}{count} argument{'' if count == 1 else 's'}"
            raise self.error(
                f"{name}() takes {wanted}, got {len(node.args)}: {spec.signature}", callee.line, callee.column
            )
        args = [self.argument(spec, i, arg) for i, arg in enumerate(node.args)]
        try:
            result = spec.result([a.type for a in args])
        except SignatureError as exc:
            raise self.error(exc.message, *start_of(node.args[exc.argument])) from None
        fns = [
            self.guard(arg, spec.param(i), f"argument {i + 1} of {name}()", node.args[i])
            for i, arg in enumerate(args)
        ]
        impl = spec.impl
        if spec.scanned is not None:
            impl = _scanning(impl, spec.scanned, self.scan_limit, self.scans, f"{name}()")
        where = self.where(callee.line, callee.column)
        return self.finish(_call_closure(spec.name, impl, fns, where), result, args)

    def argument(self, spec: FunctionSpec, i: int, node: Node) -> _Code:
        if i == spec.pattern_argument:
            if not isinstance(node, Literal) or not isinstance(node.value, str):
                raise self.error(f"the pattern of {spec.name}() must be a string literal", *start_of(node))
            try:
                return _constant(compile_pattern(node.value).sharing(self.pattern_size), STR)
            except PatternError as exc:
                raise self.error(exc.message, node.line, node.column) from None
        code = self.compile(node)
        self.require(code, spec.param(i), f"argument {i + 1} of {spec.name}()", node)
        return code

    # -- operators -------------------------------------------------------------------------------------------

    def unary(self, node: Unary) -> _Code:
        operand = self.compile(node.operand)
        where = self.where(node.line, node.column)
        if node.op == "not":
            self.require(operand, _BOOL_KINDS, "the operand of 'not'", node.operand)
            get = self.guard(operand, _BOOL_KINDS, "the operand of 'not'", node.operand)

            def negation(view: View) -> bool:
                return not get(view)

            return self.finish(negation, BOOL, [operand])
        self.require(operand, NUMBER, "the operand of '-'", node.operand)
        get = self.guard(operand, NUMBER, "the operand of '-'", node.operand)

        def minus(view: View) -> Any:
            return _bounded(-get(view), where)

        return self.finish(minus, INT if operand.type.kind is Kind.INT else FLOAT, [operand])

    def binary(self, node: Binary) -> _Code:
        left, right = self.compile(node.left), self.compile(node.right)
        op, where = node.op, self.where(node.line, node.column)
        lt, rt = left.type, right.type
        allowed = _ORDERED if op == "+" else NUMBER
        for code in (left, right):
            if _known(code.type) and code.type.kind not in widen(allowed):
                hint = " (string and list repetition are not supported)" if op == "*" else ""
                raise self.error(
                    f"'{op}' needs {'numbers or strings' if op == '+' else 'numbers'}, "
                    f"got {describe_type(lt)} and {describe_type(rt)}{hint}",
                    node.line,
                    node.column,
                )
        if op == "+" and _known(lt) and _known(rt) and _family(lt.kind) is not _family(rt.kind):
            raise self.error(
                f"'+' cannot join {describe_type(lt)} and {describe_type(rt)}", node.line, node.column
            )
        kinds = {lt.kind, rt.kind}
        if op == "+" and Kind.STR in kinds:
            fn = _concat(
                self.guard(left, _STR_KINDS, "the left operand of '+'", node.left),
                self.guard(right, _STR_KINDS, "the right operand of '+'", node.right),
                where,
            )
            return self.finish(fn, STR, [left, right])
        if op == "+" and kinds == {Kind.ANY}:
            fn = _dynamic_add(
                self.guard(left, _ORDERED, "the left operand of '+'", node.left),
                self.guard(right, _ORDERED, "the right operand of '+'", node.right),
                where,
            )
            return self.finish(fn, ANY, [left, right])
        fn = _arithmetic(
            _ARITHMETIC[op],
            self.guard(left, NUMBER, f"the left operand of '{op}'", node.left),
            self.guard(right, NUMBER, f"the right operand of '{op}'", node.right),
            where,
        )
        result = INT if kinds == {Kind.INT} and op != "/" else FLOAT
        return self.finish(fn, result, [left, right])

    def bool_op(self, node: BoolOp) -> _Code:
        operands = [self.compile(o) for o in node.operands]
        what = f"an operand of '{node.op}'"
        for code, child in zip(operands, node.operands, strict=True):
            self.require(code, _BOOL_KINDS, what, child)
        fns = [
            self.guard(code, _BOOL_KINDS, what, child)
            for code, child in zip(operands, node.operands, strict=True)
        ]
        fn = _conjunction(fns) if node.op == "and" else _disjunction(fns)
        return self.finish(fn, BOOL, operands)

    def compare(self, node: Compare) -> _Code:
        operands = [self.compile(o) for o in node.operands]
        steps = [self.comparison(op, operands[i], operands[i + 1]) for i, op in enumerate(node.ops)]
        return self.finish(_chain(operands, steps), BOOL, operands)

    def comparison(self, op: CompareOp, left: _Code, right: _Code) -> Callable[[Any, Any], bool]:
        """Type-check one link of a comparison chain and choose the function that performs it."""
        where = self.where(op.line, op.column)
        return _COMPARISONS[op.symbol](self, op, left.type, right.type, right, where)

    def equality(self, op: CompareOp, lt: FieldType, rt: FieldType, right: _Code, where: _Where) -> Callable:
        if (
            _known(lt)
            and _known(rt)
            and Kind.NONE not in (lt.kind, rt.kind)
            and _family(lt.kind) is not _family(rt.kind)
        ):
            raise self.error(
                f"'{op.symbol}' compares {describe_type(lt)} with {describe_type(rt)}", op.line, op.column
            )
        equal = op.symbol == "=="
        if Kind.NONE in (lt.kind, rt.kind):
            return (
                operator.is_ if equal else operator.is_not
            )  # none is a singleton: identity is exact and safe
        if _family(lt.kind) == _family(rt.kind) and _family(lt.kind) in (Kind.FLOAT, Kind.STR, Kind.BOOL):
            return operator.eq if equal else operator.ne
        step = _checked(values_equal, where, negate=not equal)
        if right.const:
            return step  # values_equal compares lengths first: a literal list bounds the work
        # Two lists of the request are compared item by item, in Python: a scan of each.
        return _scanned_step(step, self.scan_limit, self.scans, f"'{op.symbol}'", where, both=True)

    def ordering(self, op: CompareOp, lt: FieldType, rt: FieldType, right: _Code, where: _Where) -> Callable:
        for t in (lt, rt):
            if _known(t) and t.kind not in _ORDERED:
                raise self.error(
                    f"'{op.symbol}' needs numbers or strings, got {describe_type(t)}", op.line, op.column
                )
        if _known(lt) and _known(rt) and _family(lt.kind) is not _family(rt.kind):
            raise self.error(
                f"'{op.symbol}' cannot compare {describe_type(lt)} with {describe_type(rt)}",
                op.line,
                op.column,
            )
        compare = _ORDERING[op.symbol]
        if _trusted(lt, _ORDERED) and _trusted(rt, _ORDERED):
            return compare
        return _checked_order(compare, op.symbol, where)

    def membership(
        self, op: CompareOp, lt: FieldType, rt: FieldType, right: _Code, where: _Where
    ) -> Callable:
        inside = op.symbol == "in"
        if _known(rt) and rt.kind not in (Kind.LIST, Kind.STR):
            raise self.error(
                f"'{op.symbol}' needs a list or a string on the right, got {describe_type(rt)}",
                op.line,
                op.column,
            )
        if rt.kind is Kind.STR and _known(lt) and lt.kind is not Kind.STR:
            raise self.error(
                f"'{op.symbol}' on a string needs a string on the left, got {describe_type(lt)}",
                op.line,
                op.column,
            )
        item = rt.item if rt.kind is Kind.LIST and rt.item is not None else ANY
        if (
            rt.kind is Kind.LIST
            and _known(lt)
            and _known(item)
            and Kind.NONE not in (lt.kind, item.kind)
            and _family(lt.kind) is not _family(item.kind)
        ):
            raise self.error(
                f"'{op.symbol}' looks for {describe_type(lt)} among items of type {describe_type(item)}",
                op.line,
                op.column,
            )
        scalar = _trusted(lt, NUMBER) or _trusted(lt, _STR_KINDS)
        if scalar and right.const and rt.kind is Kind.LIST and _hashable_like(right.value, lt):
            members = frozenset(right.value)
            return (lambda a, b: a in members) if inside else (lambda a, b: a not in members)
        if scalar and (
            (rt.kind is Kind.STR and _trusted(rt, _STR_KINDS) and lt.kind is Kind.STR)
            or (_trusted(rt, _LIST_KINDS) and _known(item) and _family(item.kind) is _family(lt.kind))
        ):
            # Both sides are plain values of one family: Python's own 'in' is exact here.
            step = (lambda a, b: a in b) if inside else (lambda a, b: a not in b)
        else:
            step = _checked(lambda a, b: member(a, b), where, negate=not inside)
        if right.const:
            return step
        return _scanned_step(step, self.scan_limit, self.scans, f"'{op.symbol}'", where)


_COMPILE: dict[type, Callable[[_Compiler, Any], _Code]] = {
    Literal: _Compiler.literal,
    ListExpr: _Compiler.list_expr,
    Name: _Compiler.name,
    Attribute: _Compiler.attribute,
    Index: _Compiler.index,
    Call: _Compiler.call,
    Unary: _Compiler.unary,
    Binary: _Compiler.binary,
    BoolOp: _Compiler.bool_op,
    Compare: _Compiler.compare,
}

_COMPARISONS: dict[str, Callable[..., Callable[[Any, Any], bool]]] = {
    "==": _Compiler.equality,
    "!=": _Compiler.equality,
    **{symbol: _Compiler.ordering for symbol in _ORDERING},
    "in": _Compiler.membership,
    "not in": _Compiler.membership,
}


# -- closure builders ---------------------------------------------------------------------------------------


def _bounded(value: Any, where: _Where) -> Any:
    try:
        return check_number(value)
    except Fault as fault:
        raise where.error(fault.message) from None


def _combine(op: Callable[[Any, Any], Any], a: Any, b: Any, where: _Where) -> Any:
    """``op(a, b)`` on two numbers, with every failure and an out-of-range result as ExpressionEvalError."""
    try:
        result = op(a, b)
    except ZeroDivisionError as exc:
        raise where.error("division by zero") from exc
    except OverflowError as exc:
        raise where.error("result is out of range") from exc
    return _bounded(result, where)


def _join_strings(a: str, b: str, where: _Where) -> str:
    # Checked before joining, so an oversized result is never built.
    if len(a) + len(b) > MAX_STRING_BUILD:
        raise where.error(
            f"'+' would build a string of {len(a) + len(b)} characters (limit {MAX_STRING_BUILD})"
        )
    return a + b


def _arithmetic(op: Callable[[Any, Any], Any], left: Fn, right: Fn, where: _Where) -> Fn:
    return lambda view: _combine(op, left(view), right(view), where)


def _concat(left: Fn, right: Fn, where: _Where) -> Fn:
    return lambda view: _join_strings(left(view), right(view), where)


def _dynamic_add(left: Fn, right: Fn, where: _Where) -> Fn:
    def dynamic_add(view: View) -> Any:
        a, b = left(view), right(view)
        ka, kb = kind_of(a), kind_of(b)
        if ka is Kind.STR and kb is Kind.STR:
            return _join_strings(a, b, where)
        if ka in NUMBER and kb in NUMBER:
            return _combine(operator.add, a, b, where)
        raise where.error(f"'+' cannot join {describe_value(a)} and {describe_value(b)}")

    return dynamic_add


def _conjunction(fns: list[Fn]) -> Fn:
    # Operands are bools (checked statically or by their guards), so Python's 'and' returns a bool.
    if len(fns) == 2:
        a, b = fns
        return lambda view: a(view) and b(view)
    if len(fns) == 3:
        a, b, c = fns
        return lambda view: a(view) and b(view) and c(view)

    def conjunction(view: View) -> bool:
        for fn in fns:
            if not fn(view):
                return False
        return True

    return conjunction


def _disjunction(fns: list[Fn]) -> Fn:
    if len(fns) == 2:
        a, b = fns
        return lambda view: a(view) or b(view)
    if len(fns) == 3:
        a, b, c = fns
        return lambda view: a(view) or b(view) or c(view)

    def disjunction(view: View) -> bool:
        for fn in fns:
            if fn(view):
                return True
        return False

    return disjunction


def _checked(test: Callable[[Any, Any], bool], where: _Where, *, negate: bool) -> Callable[[Any, Any], bool]:
    def checked(a: Any, b: Any) -> bool:
        try:
            return test(a, b) is not negate
        except Fault as fault:
            raise where.error(fault.message) from None
        except RecursionError as exc:
            raise where.error("values are nested too deeply to compare") from exc

    return checked


def _checked_order(
    compare: Callable[[Any, Any], bool], symbol: str, where: _Where
) -> Callable[[Any, Any], bool]:
    def checked_order(a: Any, b: Any) -> bool:
        ka, kb = kind_of(a), kind_of(b)
        if (ka in NUMBER and kb in NUMBER) or (ka is Kind.STR and kb is Kind.STR):
            return compare(a, b)
        raise where.error(f"'{symbol}' cannot compare {describe_value(a)} with {describe_value(b)}")

    return checked_order


def _chain(operands: list[_Code], steps: list[Callable[[Any, Any], bool]]) -> Fn:
    """The closure of a comparison chain; common shapes get a closure of their own (this is the hot path)."""
    if len(steps) == 1:
        (step,) = steps
        left, right = operands
        if right.const:
            get, constant = left.fn, right.value
            return lambda view: step(get(view), constant)
        if left.const:
            get, constant = right.fn, left.value
            return lambda view: step(constant, get(view))
        get_left, get_right = left.fn, right.fn
        return lambda view: step(get_left(view), get_right(view))
    if len(steps) == 2 and operands[0].const and operands[2].const:
        low, get, high = operands[0].value, operands[1].fn, operands[2].value
        first, second = steps

        def between(view: View) -> bool:
            value = get(view)
            return first(low, value) and second(value, high)

        return between
    fns = [code.fn for code in operands]
    links = list(zip(steps, fns[1:], strict=True))
    head = fns[0]

    def chain(view: View) -> bool:
        a = head(view)
        for step, fn in links:
            b = fn(view)
            if not step(a, b):
                return False
            a = b
        return True

    return chain


_SCANNED = frozenset({Kind.STR, Kind.LIST})


def _too_long_to_scan(value: Any, limit: int, scans: int, what: str) -> Fault | None:
    """The fault for a text longer than ``limit`` characters, the scan allowance, or a list longer than
    ``limit // SCAN_ITEM_COST`` items; None for any other value."""
    kind = kind_of(value)
    if kind not in _SCANNED:
        return None
    unit, allowed = ("characters", limit) if kind is Kind.STR else ("items", limit // SCAN_ITEM_COST)
    if len(value) <= allowed:
        return None
    return Fault(
        f"{what} would read {len(value)} {unit}; each of the {max(scans, 1)} operations that share this scan "
        f"budget may read {allowed} (see docs/policy-language.md, 'Bounds')"
    )


def _scanning(impl: Callable[..., Any], index: int, limit: int, scans: int, what: str) -> Callable[..., Any]:
    """``impl`` with the length of its argument ``index`` checked against the scan allowance first."""

    def scanning(*args: Any) -> Any:
        fault = _too_long_to_scan(args[index], limit, scans, what)
        if fault is not None:
            raise fault
        return impl(*args)

    return scanning


def _scanned_step(
    step: Callable[[Any, Any], bool], limit: int, scans: int, what: str, where: _Where, *, both: bool = False
) -> Callable[[Any, Any], bool]:
    """A membership test with the length of its container (``both``: of both operands) checked against the
    scan allowance first."""

    def scanned(a: Any, b: Any) -> bool:
        fault = _too_long_to_scan(b, limit, scans, what) or (both and _too_long_to_scan(a, limit, scans, what))
        if fault:
            raise where.error(fault.message)
        return step(a, b)

    return scanned


def _call_closure(name: str, impl: Callable[..., Any], fns: list[Fn], where: _Where) -> Fn:

    def failed(exc: BaseException) -> ExpressionEvalError:
        if isinstance(exc, Fault):
            return where.error(exc.message)
        return where.error(f"{name}() failed: {exc}")

    if len(fns) == 1:
        (arg,) = fns

        def call1(view: View) -> Any:
            value = arg(view)
            try:
                return impl(value)
            except Fault as exc:
                raise failed(exc) from None
            except _EXPECTED as exc:
                raise failed(exc) from exc

        return call1
    if len(fns) == 2:
        first, second = fns

        def call2(view: View) -> Any:
            a, b = first(view), second(view)
            try:
                return impl(a, b)
            except Fault as exc:
                raise failed(exc) from None
            except _EXPECTED as exc:
                raise failed(exc) from exc

        return call2

    def call(view: View) -> Any:
        values = [fn(view) for fn in fns]
        try:
            return impl(*values)
        except Fault as exc:
            raise failed(exc) from None
        except _EXPECTED as exc:
            raise failed(exc) from exc

    return call


# -- small pure helpers -------------------------------------------------------------------------------------


def _join(types: list[FieldType]) -> FieldType:
    """The item type of a list literal: the items' common type, ``number`` for mixed numbers, else any."""
    if not types:
        return ANY
    kinds = {t.kind for t in types}
    optional = any(t.optional for t in types)
    if len(kinds) == 1:
        first = types[0]
        if all(t == first for t in types) or first.kind not in (Kind.LIST, Kind.RECORD):
            return FieldType(first.kind, item=first.item, fields=first.fields, optional=optional)
        return FieldType(first.kind, optional=optional) if first.kind is Kind.LIST else ANY
    if kinds <= NUMBER:
        return FieldType(Kind.FLOAT, optional=optional)
    return ANY


def _hashable_like(values: tuple[Any, ...], t: FieldType) -> bool:
    """Whether a constant list can become a frozenset for ``t``-typed lookups (same family, no bools)."""
    family = NUMBER if t.kind in NUMBER else _STR_KINDS
    return all(kind_of(v) in family for v in values)


def _path(node: Node) -> str:
    if isinstance(node, Name):
        return node.name
    if isinstance(node, Attribute):
        return f"{_path(node.target)}.{node.name}"
    return "the value"


def _unknown(message: str, name: str, known: Mapping[str, Any], label: str) -> str:
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{message}{hint} ({label}: {', '.join(names) or 'none'})"
