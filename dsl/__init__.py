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
    PolicyFileError,
    PolicyIssue,
)
from ._schema import STANDARD_FIELDS, STANDARD_SCHEMA, TYPE_NAMES, FieldType, Kind, RequestSchema

# --- expression language exports (owned by the expression module) ---
from ._compiler import Expression, compile_expression
from ._functions import FUNCTIONS, FunctionSpec

# --- policy document exports (owned by the policy module) ---
from ._duration import format_duration, parse_duration
from ._policy import (
    CLIENT_CONTROLS,
    SEMANTIC_EXPLORE,
    AutoApprove,
    Decision,
    Defaults,
    EvictionSpec,
    Guardrails,
    KvSpec,
    Policy,
    PolicyRef,
    Rule,
    SemanticSpec,
    SloSpec,
    TenantSpec,
    load_policy,
    parse_policy,
    policy_to_dict,
    policy_to_yaml,
)
from ._diff import Change, PolicyDiff, diff_policies

__all__ = [
    "CLIENT_CONTROLS",
    "SEMANTIC_EXPLORE",
    "AutoApprove",
    "Change",
    "Decision",
    "Defaults",
    "DslError",
    "EvictionSpec",
    "Expression",
    "ExpressionCompileError",
    "ExpressionError",
    "ExpressionEvalError",
    "ExpressionSyntaxError",
    "FUNCTIONS",
    "FieldType",
    "FunctionSpec",
    "Guardrails",
    "Kind",
    "KvSpec",
    "Policy",
    "PolicyDiff",
    "PolicyError",
    "PolicyFileError",
    "PolicyIssue",
    "PolicyRef",
    "RequestSchema",
    "Rule",
    "STANDARD_FIELDS",
    "STANDARD_SCHEMA",
    "SemanticSpec",
    "SloSpec",
    "TYPE_NAMES",
    "TenantSpec",
    "compile_expression",
    "diff_policies",
    "format_duration",
    "load_policy",
    "parse_duration",
    "parse_policy",
    "policy_to_dict",
    "policy_to_yaml",
]
