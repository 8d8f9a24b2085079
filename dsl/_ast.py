"""Syntax tree of the expression language: frozen, slotted nodes, each with the position of its main token.

The main token is the one an error about the node points at: the name for ``Name`` and ``Attribute``
(the member name), the operator for ``Binary``, ``Unary`` and each comparison, ``[`` for ``Index`` and
``ListExpr``, ``(`` for ``Call``. ``start()`` gives the first token of a node, used where an error is about a
whole operand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Literal:
    """An int, float, str, bool or none literal."""

    value: Any
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class ListExpr:
    items: tuple[Node, ...]
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Attribute:
    target: Node
    name: str
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Index:
    target: Node
    index: Node
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Call:
    callee: Node
    args: tuple[Node, ...]
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Unary:
    op: str  # "-" or "not"
    operand: Node
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Binary:
    op: str  # + - * / // %
    left: Node
    right: Node
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class BoolOp:
    """``a and b and c`` (or ``or``), flattened: operands are evaluated left to right and short-circuit."""

    op: str
    operands: tuple[Node, ...]
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class CompareOp:
    symbol: str  # == != < <= > >= in "not in"
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Compare:
    """A comparison chain: ``a < b <= c`` holds when ``a < b`` and ``b <= c``; ``b`` is evaluated once."""

    operands: tuple[Node, ...]
    ops: tuple[CompareOp, ...]
    line: int
    column: int


Node = Literal | ListExpr | Name | Attribute | Index | Call | Unary | Binary | BoolOp | Compare


def start(node: Node) -> tuple[int, int]:
    """Line and column of the first token of ``node`` (its leftmost operand for infix and postfix forms)."""
    while True:
        if isinstance(node, (Attribute, Index)):
            node = node.target
        elif isinstance(node, Call):
            node = node.callee
        elif isinstance(node, Binary):
            node = node.left
        elif isinstance(node, (BoolOp, Compare)):
            node = node.operands[0]
        else:
            return node.line, node.column
