"""Errors of the dsl room.

    DslError
    ├── ExpressionError            an expression is wrong; carries source, line, column and a caret
    │   ├── ExpressionSyntaxError  lexing or parsing failed
    │   ├── ExpressionCompileError unknown name, field or function; wrong argument types or counts;
    │   │                          a bound exceeded by a literal (length, nesting, pattern size)
    │   └── ExpressionEvalError    at request time: a type mismatch or a bound exceeded by a value;
    │                              the only thing evaluation ever raises
    ├── PolicyError                a policy document is invalid; carries every PolicyIssue found
    └── PolicyFileError            a policy path is not a regular file (a FIFO, a device); also an OSError

Every error is raised before anything is applied: a policy that fails to load leaves nothing behind.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters: a 100,000-character name is shown by
    its head and its length, so that an issue stays one readable line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    length = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[: limit - 3]}...{length}"


class DslError(Exception):
    """Base of every error the dsl room raises on purpose."""


class ExpressionError(DslError):
    """An expression is invalid. ``str(err)`` shows the message, then the source line with a caret.

    ``line`` and ``column`` are 1-based and relative to the expression text; ``origin`` (file name,
    line and column offset of the expression inside a larger document) is added by callers that know it.
    """

    def __init__(self, message: str, source: str, line: int = 1, column: int = 1, *, origin: str = "") -> None:
        self.message = message
        self.source = source
        self.line = line
        self.column = column
        self.origin = origin
        super().__init__(self._render())

    def _render(self) -> str:
        lines = self.source.splitlines() or [""]
        text = lines[min(self.line, len(lines)) - 1]
        where = f"{self.origin}: " if self.origin else ""
        caret = " " * (max(self.column, 1) - 1) + "^"
        return f"{where}line {self.line}, column {self.column}: {self.message}\n  {text}\n  {caret}"


class ExpressionSyntaxError(ExpressionError):
    """The text is not a well-formed expression."""


class ExpressionCompileError(ExpressionError):
    """The expression is well formed but names something it may not, or breaks a static bound."""


class ExpressionEvalError(ExpressionError):
    """Evaluation failed on a request view (wrong value type, a bound exceeded). Never anything else."""


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    """One problem in a policy document: where it is and what is wrong."""

    file: str
    line: int | None
    column: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.field or '<document>'}: {self.message}"


class PolicyError(DslError):
    """A policy document is invalid. ``issues`` lists every problem found, in document order."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        assert issues, "PolicyError needs at least one issue"
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


class PolicyFileError(DslError, OSError):
    """A policy path names something that is not a regular file (a FIFO, a device, a directory): it is refused
    before anything is read from it. An ``OSError`` (``errno.EINVAL``), like the other ways a file cannot be
    read; ``strerror`` says what the path is."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(errno.EINVAL, message, path)
