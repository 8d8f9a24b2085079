"""WHAT may be cached: the expression language, policy documents, contracts, policy diffs.

Public names are re-exported here; the modules behind them are private.
"""

from .errors import (
    DslError,
    ExpressionCompileError,
    ExpressionError,
    ExpressionEvalError,
    ExpressionSyntaxError,
    PolicyError,
    PolicyIssue,
)
from ._schema import STANDARD_FIELDS, STANDARD_SCHEMA, TYPE_NAMES, FieldType, Kind, RequestSchema

# --- expression language exports (owned by the expression module) ---

# --- policy document exports (owned by the policy module) ---

__all__ = [name for name in dir() if not name.startswith("_")]
