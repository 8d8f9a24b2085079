"""Pratt parser: tokens -> syntax tree, with the nesting bound enforced while parsing.

Binding powers follow Python: ``or`` < ``and`` < ``not`` < comparisons (chained) < ``+ -`` < ``* / // %`` <
unary ``-`` < postfix (call, index, attribute). ``and``/``or`` chains and comparison chains become one n-ary
node each, so a long ``a and b and c ...`` does not make the tree deep.

Nesting depth is the height of the tree, where a parenthesised group counts as a level of its own. It is
capped at ``MAX_DEPTH`` (an ``ExpressionCompileError`` at the token that goes one level too deep); the cap
also bounds the recursion of the parser, the compiler and the evaluator: none can reach Python's limit.
"""

from __future__ import annotations

from collections.abc import Callable

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
    start,
)
from ._lexer import MAX_SOURCE_CHARS, Token, tokenize
from .errors import ExpressionCompileError, ExpressionSyntaxError

MAX_DEPTH = 32
MAX_LIST_ITEMS = 256

_COMPARISONS = frozenset({"==", "!=", "<", "<=", ">", ">=", "in"})
_ARITHMETIC = frozenset({"+", "-", "*", "/", "//", "%"})
_INFIX_POWER = {
    "or": 10,
    "and": 20,
    **{op: 40 for op in _COMPARISONS},
    "+": 50,
    "-": 50,
    "*": 60,
    "/": 60,
    "//": 60,
    "%": 60,
    "(": 80,
    "[": 80,
    ".": 80,
}
_NOT_POWER = 30  # operand of prefix 'not': a comparison binds tighter, 'and' looser
_NEG_POWER = 70  # operand of unary '-'
_COMPARE_POWER = 40

_DESCRIPTIONS = {"eof": "end of expression", "int": "number", "float": "number", "str": "string"}


def parse(source: str) -> Node:
    """Parse ``source`` into a tree. Raises ``ExpressionSyntaxError`` for malformed text and
    ``ExpressionCompileError`` for text that breaks a bound (length, nesting, list size, literal size)."""
    if len(source) > MAX_SOURCE_CHARS:
        line = source.count("\n", 0, MAX_SOURCE_CHARS) + 1
        column = MAX_SOURCE_CHARS - (source.rfind("\n", 0, MAX_SOURCE_CHARS) + 1) + 1
        # Only the head of the text goes into the error: str(err) of a 10 MB expression must stay readable.
        raise ExpressionCompileError(
            f"expression is {len(source)} characters long; the limit is {MAX_SOURCE_CHARS}",
            source[: MAX_SOURCE_CHARS + 1],
            line,
            column,
        )
    return _Parser(source, tokenize(source)).run()


class _Parser:
    def __init__(self, source: str, tokens: list[Token]) -> None:
        self.source = source
        self.tokens = tokens
        self.i = 0
        self.depth = 0  # nesting of the sub-expression being parsed; the tree is at least this tall

    # -- token helpers -------------------------------------------------------------------------------------

    @property
    def current(self) -> Token:
        return self.tokens[self.i]

    def advance(self) -> Token:
        tok = self.tokens[self.i]
        if tok.type != "eof":
            self.i += 1
        return tok

    def expect(self, type_: str, context: str) -> Token:
        tok = self.current
        if tok.type != type_:
            raise self.syntax(f"expected '{type_}' {context}, found {_describe(tok)}", tok)
        return self.advance()

    def syntax(self, message: str, tok: Token) -> ExpressionSyntaxError:
        return ExpressionSyntaxError(message, self.source, tok.line, tok.column)

    def too_deep(self, tok: Token) -> ExpressionCompileError:
        return ExpressionCompileError(
            f"expression nests more than {MAX_DEPTH} levels deep", self.source, tok.line, tok.column
        )

    # -- the Pratt loop ------------------------------------------------------------------------------------

    def run(self) -> Node:
        if self.current.type == "eof":
            raise self.syntax("empty expression", self.current)
        node, _ = self.child(0, self.current)
        if self.current.type != "eof":
            raise self.syntax(
                f"unexpected {_describe(self.current)} after a complete expression", self.current
            )
        return node

    def child(self, power: int, opener: Token) -> tuple[Node, int]:
        """Parse a sub-expression one level deeper than the caller; blame ``opener`` if that is too deep."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.too_deep(opener)
        try:
            return self.expression(power)
        finally:
            self.depth -= 1

    def expression(self, power: int) -> tuple[Node, int]:
        """Parse while the next infix operator binds tighter than ``power``; return the node and height."""
        tok = self.advance()
        prefix = _PREFIX.get(tok.type)
        if prefix is None:
            raise self.syntax(f"unexpected {_describe(tok)}", tok)
        node, height = prefix(self, tok)
        if height > MAX_DEPTH:
            raise self.too_deep(tok)
        while power < self.infix_power():
            tok = self.advance()
            node, height = _INFIX[tok.type](self, tok, node, height)
            if height > MAX_DEPTH:
                raise self.too_deep(tok)
        return node, height

    def infix_power(self) -> int:
        tok = self.current
        if tok.type == "not":
            # 'not' in infix position only starts 'not in'.
            return _COMPARE_POWER if self.tokens[self.i + 1].type == "in" else 0
        return _INFIX_POWER.get(tok.type, 0)

    # -- prefix forms --------------------------------------------------------------------------------------

    def literal(self, tok: Token) -> tuple[Node, int]:
        value = {"true": True, "false": False, "none": None}.get(tok.type, tok.value)
        return Literal(value, tok.line, tok.column), 1

    def name(self, tok: Token) -> tuple[Node, int]:
        return Name(tok.value, tok.line, tok.column), 1

    def group(self, tok: Token) -> tuple[Node, int]:
        if self.current.type == ")":
            raise self.syntax("empty parentheses (tuples are not supported)", self.current)
        node, height = self.child(0, tok)
        if self.current.type == ",":
            raise self.syntax("tuples are not supported (write a list: [a, b])", self.current)
        self.expect(")", "to close '('")
        return node, height + 1

    def list_literal(self, tok: Token) -> tuple[Node, int]:
        items, heights = self.sequence("]", tok, "list")
        if len(items) > MAX_LIST_ITEMS:
            line, column = start(items[MAX_LIST_ITEMS])
            raise ExpressionCompileError(
                f"list literal has {len(items)} items; the limit is {MAX_LIST_ITEMS}",
                self.source,
                line,
                column,
            )
        return ListExpr(tuple(items), tok.line, tok.column), 1 + max(heights, default=0)

    def negate(self, tok: Token) -> tuple[Node, int]:
        operand, height = self.child(_NEG_POWER, tok)
        return Unary("-", operand, tok.line, tok.column), height + 1

    def logical_not(self, tok: Token) -> tuple[Node, int]:
        operand, height = self.child(_NOT_POWER, tok)
        return Unary("not", operand, tok.line, tok.column), height + 1

    # -- infix and postfix forms ---------------------------------------------------------------------------

    def arithmetic(self, tok: Token, left: Node, height: int) -> tuple[Node, int]:
        right, right_height = self.child(_INFIX_POWER[tok.type], tok)
        return Binary(tok.type, left, right, tok.line, tok.column), 1 + max(height, right_height)

    def boolean(self, tok: Token, left: Node, height: int) -> tuple[Node, int]:
        operands, tallest = [left], height
        op, first = tok.type, tok
        while True:
            operand, h = self.child(_INFIX_POWER[op], tok)
            operands.append(operand)
            tallest = max(tallest, h)
            if self.current.type != op:
                break
            tok = self.advance()
        return BoolOp(op, tuple(operands), first.line, first.column), tallest + 1

    def comparison(self, tok: Token, left: Node, height: int) -> tuple[Node, int]:
        operands, ops, tallest = [left], [], height
        while True:
            if tok.type == "not":
                self.advance()  # the 'in' of 'not in'
                symbol = "not in"
            else:
                symbol = tok.type
            ops.append(CompareOp(symbol, tok.line, tok.column))
            operand, h = self.child(_COMPARE_POWER, tok)
            operands.append(operand)
            tallest = max(tallest, h)
            if self.infix_power() != _COMPARE_POWER:
                break
            tok = self.advance()
        first = ops[0]
        return Compare(tuple(operands), tuple(ops), first.line, first.column), tallest + 1

    def call(self, tok: Token, callee: Node, height: int) -> tuple[Node, int]:
        args, heights = self.sequence(")", tok, "argument list")
        return Call(callee, tuple(args), tok.line, tok.column), 1 + max([height, *heights])

    def index(self, tok: Token, target: Node, height: int) -> tuple[Node, int]:
        if self.current.type == "]":
            raise self.syntax("empty index", self.current)
        index, index_height = self.child(0, tok)
        if self.current.type == ",":
            raise self.syntax("only one index is allowed", self.current)
        self.expect("]", "to close '['")
        return Index(target, index, tok.line, tok.column), 1 + max(height, index_height)

    def attribute(self, tok: Token, target: Node, height: int) -> tuple[Node, int]:
        name = self.current
        if name.type != "name":
            raise self.syntax(f"expected a member name after '.', found {_describe(name)}", name)
        self.advance()
        if self.current.type == "(":
            raise ExpressionCompileError(
                f"method calls are not allowed ('.{name.value}(...)'): "
                "only the allow-listed functions can be called",
                self.source,
                name.line,
                name.column,
            )
        return Attribute(target, name.value, name.line, name.column), height + 1

    def sequence(self, closer: str, opener: Token, what: str) -> tuple[list[Node], list[int]]:
        """Comma-separated expressions up to ``closer`` (a trailing comma is allowed)."""
        items: list[Node] = []
        heights: list[int] = []
        while self.current.type != closer:
            item, h = self.child(0, opener)
            items.append(item)
            heights.append(h)
            if self.current.type != ",":
                break
            self.advance()
        self.expect(closer, f"to close the {what}")
        return items, heights


_Prefix = Callable[[_Parser, Token], tuple[Node, int]]
_Infix = Callable[[_Parser, Token, Node, int], tuple[Node, int]]

_PREFIX: dict[str, _Prefix] = {
    "int": _Parser.literal,
    "float": _Parser.literal,
    "str": _Parser.literal,
    "true": _Parser.literal,
    "false": _Parser.literal,
    "none": _Parser.literal,
    "name": _Parser.name,
    "(": _Parser.group,
    "[": _Parser.list_literal,
    "-": _Parser.negate,
    "not": _Parser.logical_not,
}

_INFIX: dict[str, _Infix] = {
    **{op: _Parser.arithmetic for op in _ARITHMETIC},
    **{op: _Parser.comparison for op in _COMPARISONS},
    "not": _Parser.comparison,
    "and": _Parser.boolean,
    "or": _Parser.boolean,
    "(": _Parser.call,
    "[": _Parser.index,
    ".": _Parser.attribute,
}


def _describe(tok: Token) -> str:
    if tok.type in _DESCRIPTIONS:
        return _DESCRIPTIONS[tok.type]
    if tok.type == "name":
        return f"name '{tok.value}'"
    return f"'{tok.type}'"
