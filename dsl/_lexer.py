"""Lexer of the expression language: text -> tokens, each with its 1-based line and column.

The lexer is where hostile text is turned away first: only ASCII names, the operators of the language and
plain string/number literals exist. Everything else (``**``, ``=``, ``;``, ``:``, f-strings, Python keywords
such as ``lambda`` or ``import``, fullwidth letters, zero-width characters) is an ``ExpressionSyntaxError``
pointing at the offending character, with a message that says what to write instead where that is obvious.
"""

from __future__ import annotations

import keyword
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from .errors import ExpressionCompileError, ExpressionSyntaxError

MAX_SOURCE_CHARS = 4096
MAX_STRING_CHARS = 1024
MAX_INT_LITERAL = 2**63
# 2**63 has 19 digits: anything longer is out of range without converting it (int() of long digit strings
# is slow).
_MAX_INT_DIGITS = 19

# Keywords of the language. Both spellings of the constants are accepted; each maps to one token type.
_KEYWORDS = {
    "and": "and",
    "or": "or",
    "not": "not",
    "in": "in",
    "true": "true",
    "True": "true",
    "false": "false",
    "False": "false",
    "none": "none",
    "None": "none",
}

# Python keywords that mean nothing here: a name spelled like one is almost certainly an attempt at Python.
_PYTHON_KEYWORD_HINTS = {
    "is": "'is' is not supported: compare with '==' or '!='",
    "if": "conditional expressions ('x if y else z') are not supported",
    "else": "conditional expressions ('x if y else z') are not supported",
    "lambda": "lambdas are not supported",
    "import": "imports are not supported",
    "from": "imports are not supported",
    "for": "comprehensions and loops are not supported",
}
_RESERVED = frozenset(keyword.kwlist) - set(_KEYWORDS)

# Longest operators first, so that '<=' is not read as '<' then '='.
_OPERATORS = ("==", "!=", "<=", ">=", "//", "<", ">", "+", "-", "*", "/", "%", "(", ")", "[", "]", ",", ".")

# Characters (or pairs) that are not operators here, with what to write instead.
_REJECTED = {
    "**": "the power operator '**' is not supported",
    ":=": "assignment expressions (':=') are not supported",
    "=": "'=' is not an operator (assignment is not supported): compare with '=='",
    ":": "':' is not part of the language (no slices, lambdas or dicts)",
    ";": "';' is not allowed: an expression is a single expression",
    "!": "'!' is not an operator: negate with 'not' (and compare with '!=')",
    "&": "'&' is not an operator: use 'and'",
    "|": "'|' is not an operator: use 'or'",
    "~": "'~' is not an operator: negate with 'not'",
    "^": "'^' is not an operator",
    "@": "'@' is not an operator",
    "{": "braces are not supported (no dicts or sets)",
    "}": "braces are not supported (no dicts or sets)",
    "#": "comments are not supported",
    "`": "backquotes are not supported",
    "$": "'$' is not allowed here",
    "?": "'?' is not allowed here",
}

_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "'": "'", "\\": "\\"}
_STRING_PREFIXES = frozenset({"f", "r", "b", "u", "rb", "br", "fr", "rf"})
# Every character str.splitlines() breaks at. A raw one inside a string would make the error caret point at
# the wrong line, so they are rejected there; outside strings only \n, \r\n and \r are line breaks.
_LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")


@dataclass(frozen=True, slots=True)
class Token:
    """One token. ``type`` is ``"int"``, ``"float"``, ``"str"``, ``"name"``, ``"eof"``, or the operator or
    keyword itself (``"=="``, ``"and"``, ``"true"``); ``value`` is the literal's value or the name's text."""

    type: str
    value: Any
    line: int
    column: int


def tokenize(source: str) -> list[Token]:
    """Split ``source`` into tokens ending with an ``eof`` token.

    Raises ``ExpressionSyntaxError`` for text that is not part of the language and ``ExpressionCompileError``
    for literals that break a bound (string length, integer magnitude).
    """
    return _Lexer(source).run()


class _Lexer:
    def __init__(self, source: str) -> None:
        self.source = source
        self.pos = 0
        self.line = 1
        self.line_start = 0  # offset of the first character of the current line
        self.tokens: list[Token] = []
        self.end = (1, 1)  # position just after the last token: where "unexpected end" points

    @property
    def column(self) -> int:
        return self.pos - self.line_start + 1

    def fail(self, message: str, line: int | None = None, column: int | None = None) -> ExpressionSyntaxError:
        return ExpressionSyntaxError(message, self.source, line or self.line, column or self.column)

    def run(self) -> list[Token]:
        src = self.source
        while True:
            self._skip_whitespace()
            if self.pos >= len(src):
                break
            ch = src[self.pos]
            if ch == '"' or ch == "'":
                self._string(ch)
            elif "0" <= ch <= "9":
                self._number()
            elif ch == "_" or ("a" <= ch <= "z") or ("A" <= ch <= "Z"):
                self._name()
            else:
                self._operator(ch)
            self.end = (self.line, self.column)
        self.tokens.append(Token("eof", None, *self.end))
        return self.tokens

    def _skip_whitespace(self) -> None:
        src = self.source
        while self.pos < len(src):
            ch = src[self.pos]
            if ch == " " or ch == "\t":
                self.pos += 1
            elif ch == "\n" or ch == "\r":
                self.pos += 2 if src.startswith("\r\n", self.pos) else 1
                self.line += 1
                self.line_start = self.pos
            else:
                return

    def _add(self, type_: str, value: Any, column: int) -> None:
        self.tokens.append(Token(type_, value, self.line, column))

    def _name(self) -> None:
        match = _NAME.match(self.source, self.pos)
        assert match is not None
        word, column = match.group(), self.column
        self.pos = match.end()
        if word in _STRING_PREFIXES and self.source[self.pos : self.pos + 1] in ("'", '"'):
            raise self.fail(
                f"string prefix '{word}' is not supported (no f-strings, raw or byte strings)", column=column
            )
        if word in _KEYWORDS:
            self._add(_KEYWORDS[word], None, column)
        elif word in _RESERVED:
            hint = _PYTHON_KEYWORD_HINTS.get(
                word, f"'{word}' is a Python keyword and means nothing in an expression"
            )
            raise self.fail(hint, column=column)
        else:
            self._add("name", word, column)

    def _number(self) -> None:
        match = _NUMBER.match(self.source, self.pos)
        assert match is not None
        text, column = match.group(), self.column
        self.pos = match.end()
        follower = self.source[self.pos : self.pos + 1]
        if follower and (follower.isalnum() or follower == "_"):
            raise self.fail(f"invalid number literal '{text}{follower}'", column=column)
        if match.group(1) or match.group(2):
            value = float(text)
            if value in (float("inf"), float("-inf")):
                raise ExpressionCompileError(
                    f"float literal {text} is out of range", self.source, self.line, column
                )
            self._add("float", value, column)
            return
        if len(text) > 1 and text[0] == "0":
            raise self.fail(f"integer literal '{text}' has leading zeros", column=column)
        if len(text) > _MAX_INT_DIGITS or int(text) > MAX_INT_LITERAL:
            raise ExpressionCompileError(
                f"integer literal {text[:24]}{'...' if len(text) > 24 else ''} is larger than 2**63",
                self.source,
                self.line,
                column,
            )
        self._add("int", int(text), column)

    def _string(self, quote: str) -> None:
        src, column = self.source, self.column
        chars: list[str] = []
        i = self.pos + 1
        while True:
            if i >= len(src) or src[i] in _LINE_BREAKS:
                raise self.fail("unterminated string literal (strings cannot span lines)", column=column)
            ch = src[i]
            if ch == quote:
                break
            if ch == "\\":
                escaped = src[i + 1 : i + 2]
                if escaped not in _ESCAPES:
                    shown = escaped if escaped and escaped not in _LINE_BREAKS else ""
                    raise self.fail(
                        f"unknown escape '\\{shown}' (only \\n \\t \\\" \\' \\\\ are supported)",
                        column=i - self.line_start + 1,
                    )
                chars.append(_ESCAPES[escaped])
                i += 2
            else:
                chars.append(ch)
                i += 1
        if len(chars) > MAX_STRING_CHARS:
            raise ExpressionCompileError(
                f"string literal of {len(chars)} characters is longer than {MAX_STRING_CHARS}",
                self.source,
                self.line,
                column,
            )
        self.pos = i + 1
        self._add("str", "".join(chars), column)

    def _operator(self, ch: str) -> None:
        src = self.source
        for text in ("**", ":="):
            if src.startswith(text, self.pos):
                raise self.fail(_REJECTED[text])
        for op in _OPERATORS:
            if src.startswith(op, self.pos):
                self._add(op, None, self.column)
                self.pos += len(op)
                return
        if ch in _REJECTED:
            raise self.fail(_REJECTED[ch])
        raise self.fail(_describe_character(ch))


def _describe_character(ch: str) -> str:
    name = unicodedata.name(ch, "")
    code = f"U+{ord(ch):04X}{' ' + name if name else ''}"
    if unicodedata.category(ch) in ("Cf", "Cc", "Zs", "Zl", "Zp") or ch in _LINE_BREAKS:
        return f"unexpected invisible character {code}"
    if not ch.isascii():
        return f"unexpected character {ch!r} ({code}); names and operators are plain ASCII"
    return f"unexpected character {ch!r}"
