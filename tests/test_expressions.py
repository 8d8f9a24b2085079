"""The expression language: the YAML case suite, the public API, and property tests."""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evocache.dsl as dsl
from evocache.dsl import (
    FUNCTIONS,
    STANDARD_SCHEMA,
    TYPE_NAMES,
    ExpressionCompileError,
    ExpressionError,
    ExpressionEvalError,
    ExpressionSyntaxError,
    FieldType,
    FunctionSpec,
    Kind,
    RequestSchema,
    compile_expression,
)
from evocache.dsl._functions import (
    MATCH_WORK_BUDGET,
    MAX_SCAN_WORK,
    SCAN_ITEM_COST,
    MAX_MATCH_BYTES,
    MAX_PROGRAM_SIZE,
    PATTERN_MAX_MEM,
    PATTERN_MIN_MEM,
    PatternError,
    compile_pattern,
)

CASES_FILE = Path(__file__).with_name("expression_cases.yaml")
SUITE = yaml.safe_load(CASES_FILE.read_text())
CASE_SCHEMA = STANDARD_SCHEMA.extend({name: TYPE_NAMES[t] for name, t in SUITE["schema"].items()})
ERRORS = {cls.__name__: cls for cls in (ExpressionSyntaxError, ExpressionCompileError, ExpressionEvalError)}
MISSING = object()


def _plain(value: Any) -> Any:
    """Lists and tuples as lists, recursively, keeping the types of scalars."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _same(actual: Any, expected: Any) -> bool:
    actual, expected = _plain(actual), _plain(expected)
    if isinstance(expected, list):
        return isinstance(actual, list) and len(actual) == len(expected) and all(map(_same, actual, expected))
    return type(actual) is type(expected) and actual == expected


def _view(case: dict[str, Any]) -> dict[str, Any]:
    view = copy.deepcopy(SUITE["views"][case.get("view", "default")])
    view.update(copy.deepcopy(case.get("set", {})))
    for name in case.get("unset", []):
        del view[name]
    return view


def _case_id(case: dict[str, Any]) -> str:
    return " ".join(case["expr"].split())[:60] + (f" [{case['view']}]" if "view" in case else "")


def test_suite_is_large_and_well_formed() -> None:
    cases = SUITE["cases"]
    assert len(cases) >= 60
    for case in cases:
        assert set(case) <= {
            "expr",
            "result",
            "error",
            "line",
            "column",
            "message",
            "view",
            "set",
            "unset",
        }, case
        assert ("result" in case) != ("error" in case), case
        if "error" in case:
            assert case["error"] in ERRORS and {"line", "column"} <= set(case), case
    classes = {case["error"] for case in cases if "error" in case}
    assert classes == set(ERRORS)


@pytest.mark.parametrize("case", SUITE["cases"], ids=_case_id)
def test_case(case: dict[str, Any]) -> None:
    view = _view(case)
    if "result" in case:
        result = compile_expression(case["expr"], CASE_SCHEMA).evaluate(view)
        assert _same(result, case["result"]), f"{result!r} != {case['result']!r}"
        return
    with pytest.raises(ERRORS[case["error"]]) as info:
        compile_expression(case["expr"], CASE_SCHEMA).evaluate(view)
    err = info.value
    assert type(err) is ERRORS[case["error"]]
    assert (err.line, err.column) == (case["line"], case["column"]), str(err)
    assert case.get("message", "") in err.message, err.message


# -- public API ---------------------------------------------------------------------------------------------

LONG_VIEW = {
    "input_ids": list(range(600)),
    "prompt": "hi",
    "model": "m",
    "model_revision": "r",
    "temperature": 0.0,
    "top_k": 5,
    "top_p": 1.0,
    "max_tokens": 64,
    "seed": None,
    "stream": False,
    "tenant": {"id": "acme", "tier": "pro"},
}
HEADLINE = '512 <= len(input_ids) <= 2048 and top_k <= 10 and tenant.tier != "free"'


def test_public_names_are_exported() -> None:
    for name in ("compile_expression", "Expression", "FUNCTIONS", "FunctionSpec"):
        assert name in dsl.__all__
    assert dsl.compile_expression is compile_expression


def test_headline_expression() -> None:
    expr = compile_expression(HEADLINE)
    assert expr.source == HEADLINE
    assert expr.fields == frozenset({"input_ids", "top_k", "tenant"})
    assert expr.result_type.kind is Kind.BOOL
    assert expr.test(LONG_VIEW) is True
    assert expr.test({**LONG_VIEW, "top_k": 11}) is False
    assert expr.test({**LONG_VIEW, "input_ids": [1]}) is False
    assert expr.test({**LONG_VIEW, "tenant": {"id": "acme", "tier": "free"}}) is False


def test_compile_is_cached_per_source_and_schema() -> None:
    first = compile_expression("top_k > 1")
    assert compile_expression("top_k > 1") is first
    assert compile_expression("top_k > 1", RequestSchema(dict(STANDARD_SCHEMA.fields))) is first
    other = compile_expression("top_k > 1", STANDARD_SCHEMA.extend({"route": TYPE_NAMES["str"]}))
    assert other is not first and other == first


def test_expression_is_frozen() -> None:
    expr = compile_expression("top_k > 1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        expr.source = "x"  # type: ignore[misc]


def test_fields_are_the_top_level_names_read() -> None:
    assert compile_expression("1 + 2").fields == frozenset()
    assert compile_expression("tenant.id == model and seed == none").fields == frozenset(
        {"tenant", "model", "seed"}
    )


def test_test_rejects_a_non_bool_result() -> None:
    expr = compile_expression("  top_k + 1")
    assert expr.evaluate(LONG_VIEW) == 6
    with pytest.raises(ExpressionEvalError) as info:
        expr.test(LONG_VIEW)
    assert "gave int" in info.value.message
    assert (info.value.line, info.value.column) == (1, 3)


def test_caller_bugs_raise_type_error() -> None:
    with pytest.raises(TypeError):
        compile_expression(b"top_k")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compile_expression("top_k", {"top_k": TYPE_NAMES["int"]})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compile_expression("top_k > 1").evaluate([("top_k", 1)])  # type: ignore[arg-type]


def test_views_may_be_any_mapping() -> None:
    expr = compile_expression("tenant.tier == 'pro' and top_k == 5")
    view = MappingProxyType({**LONG_VIEW, "tenant": MappingProxyType({"id": "a", "tier": "pro"})})
    assert expr.test(view) is True

    class Lazy(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            return LONG_VIEW[key]

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(LONG_VIEW)

        def __len__(self) -> int:
            return len(LONG_VIEW)

    assert compile_expression("top_k == 5 and 599 in input_ids").test(Lazy()) is True


def test_error_renders_a_caret_under_the_column() -> None:
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression("top_k > 1 and\n  tenant.tierr == 'x'")
    assert str(info.value) == (
        "line 2, column 10: tenant has no member 'tierr'; did you mean 'tier'? (known members: id, tier)\n"
        "    tenant.tierr == 'x'\n"
        "           ^"
    )


def test_unknown_name_lists_the_known_fields() -> None:
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression("tokens > 1")
    assert info.value.message == (
        "unknown name 'tokens'; did you mean 'max_tokens'? (known fields: input_ids, max_tokens, model, "
        "model_revision, prompt, seed, stream, "
        "temperature, tenant, top_k, top_p)"
    )


def test_extended_schema_fields_are_checked() -> None:
    schema = STANDARD_SCHEMA.extend({"route": TYPE_NAMES["str"], "ids": TYPE_NAMES["list[int]"]})
    assert (
        compile_expression("route == '/v1' and 3 in ids", schema).test({"route": "/v1", "ids": [3]}) is True
    )
    with pytest.raises(ExpressionCompileError):
        compile_expression("route > 1", schema)
    with pytest.raises(ExpressionCompileError):
        compile_expression("route == '/v1'")


def test_functions_registry() -> None:
    assert set(FUNCTIONS) == {
        "len",
        "min",
        "max",
        "abs",
        "lower",
        "upper",
        "startswith",
        "endswith",
        "contains",
        "matches",
        "int",
        "float",
        "str",
    }
    assert all(isinstance(spec, FunctionSpec) and spec.name == name for name, spec in FUNCTIONS.items())
    assert FUNCTIONS["len"].params == (frozenset({Kind.STR, Kind.LIST}),)
    assert FUNCTIONS["startswith"].params == (frozenset({Kind.STR}), frozenset({Kind.STR}))
    assert FUNCTIONS["min"].variadic and not FUNCTIONS["abs"].variadic
    assert FUNCTIONS["matches"].pattern_argument == 1
    with pytest.raises(TypeError):
        FUNCTIONS["evil"] = FUNCTIONS["len"]  # type: ignore[index]


def test_optional_field_is_none_or_its_type() -> None:
    expr = compile_expression("seed == none or seed > 100")
    assert expr.test({"seed": None}) is True
    assert expr.test({"seed": 5}) is False
    with pytest.raises(ExpressionEvalError) as info:
        expr.test({"seed": "5"})
    assert info.value.message == "field 'seed' must be int or none, got str"


def test_matches_bounds_the_text_it_searches() -> None:
    expr = compile_expression(r"matches(prompt, '\\w+!')")
    limit = MATCH_WORK_BUDGET // 9  # '\w+!' compiles to 9 RE2 instructions
    assert expr.test({"prompt": "hello!"}) is True
    assert expr.test({"prompt": "a" * limit}) is False
    with pytest.raises(ExpressionEvalError) as info:
        expr.test({"prompt": "a" * (limit + 1)})
    assert info.value.message == (
        f"matches() text of {limit + 1} characters is longer than this pattern may search "
        f"({limit} bytes; its program has 9 instructions)"
    )
    # The bound is on UTF-8 bytes: half as many two-byte characters reach it.
    assert expr.test({"prompt": "é" * (limit // 2)}) is False
    with pytest.raises(ExpressionEvalError) as info:
        expr.test({"prompt": "é" * (limit // 2 + 1)})
    assert info.value.message.startswith(f"matches() text of {limit + 2} bytes of UTF-8 is longer")
    small = compile_expression(r"matches(prompt, '^\\w+!')")  # 7 instructions: the absolute cap applies
    assert small.test({"prompt": "a" * MAX_MATCH_BYTES}) is False
    with pytest.raises(ExpressionEvalError):
        small.test({"prompt": "a" * (MAX_MATCH_BYTES + 1)})


def test_a_policy_rule_whose_matches_text_is_too_long_does_not_hold() -> None:
    policy = dsl.parse_policy(
        "policy: p\nversion: 1\nrules:\n"
        "  - {name: greeting, when: \"matches(prompt, '^hello')\", ttl: 60}\n"
        "  - {name: rest, when: 'true', ttl: 30}\n"
    )
    assert policy.decide({"prompt": "hello world"}).rule == "greeting"
    decision = policy.decide({"prompt": "hello" + "!" * MAX_MATCH_BYTES})
    assert (decision.rule, decision.skipped) == ("rest", ("greeting",))


# 'a[ab]{1000}N' compiles to 1006 instructions for a one-digit N; on random a/b text RE2 falls back to
# running every instruction on every byte, so each call costs about program size x text length.
_WIDE = "matches(prompt, 'a[ab]{{1000}}{}')"


def test_the_matches_calls_of_one_expression_share_one_work_budget() -> None:
    # Each call alone may search MATCH_WORK_BUDGET // 1006 bytes; eight calls with that allowance each would
    # cost eight budgets per evaluation (and the hundred an expression of 4096 characters holds, a hundred).
    expr = compile_expression(" or ".join(_WIDE.format(i) for i in range(8)))
    assert (expr.pattern_size, expr.shared_pattern_size) == (8 * 1006, 8 * 1006)
    allowance = MATCH_WORK_BUDGET // (8 * 1006)
    assert expr.test({"prompt": "b" * allowance}) is False
    with pytest.raises(ExpressionEvalError) as info:
        expr.test({"prompt": "b" * (allowance + 1)})
    assert info.value.message == (
        f"matches() text of {allowance + 1} characters is longer than this pattern may search ({allowance} "
        "bytes; its program has 1006 instructions; it shares its work budget with patterns of 7042 more)"
    )
    assert (info.value.line, info.value.column) == (1, 1)


def test_the_patterns_of_one_expression_are_bounded_in_all() -> None:
    source = " or ".join(_WIDE.format(i) for i in range(9))  # 9054 instructions
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression(source)
    assert (info.value.line, info.value.column) == (1, source.index("'a[ab]{1000}8'") + 1)
    assert info.value.message == (
        "the matches() patterns up to this one share a work budget and compile to 9054 instructions in all; "
        f"the limit is {MAX_PROGRAM_SIZE}, so that each may search at least 4096 bytes"
    )


def test_the_matches_calls_of_every_rule_of_a_policy_share_one_work_budget() -> None:
    # One decision may test every rule, so a rule's calls share the budget with every other rule's.
    rules = "".join(
        f"  - {{name: r{i}, when: \"{_WIDE.format(i)}\", cache: bypass}}\n" for i in range(4)
    )
    policy = dsl.parse_policy("policy: p\nversion: 1\nrules:\n" + rules + "  - {name: rest, when: 'true'}\n")
    allowance = MATCH_WORK_BUDGET // (4 * 1006)
    assert policy.decide({"prompt": "b" * allowance}).rule == "rest"
    decision = policy.decide({"prompt": "b" * (allowance + 1)})
    assert (decision.rule, decision.skipped) == ("rest", ("r0", "r1", "r2", "r3"))
    alone = compile_expression(_WIDE.format(0))  # outside the policy: its own budget
    assert alone.test({"prompt": "b" * (allowance + 1)}) is False


def test_the_patterns_of_a_policy_are_bounded_in_all() -> None:
    rules = "".join(f"  - name: r{i}\n    when: \"{_WIDE.format(i)}\"\n" for i in range(10))
    with pytest.raises(dsl.PolicyError) as info:
        dsl.parse_policy("policy: p\nversion: 1\nrules:\n" + rules, "p.yaml")
    (issue,) = info.value.issues  # only the rule whose pattern crosses the limit: 9 x 1006 > 8192
    assert (issue.line, issue.column, issue.field) == (4 + 2 * 8 + 1, 28, "rules[8].when")
    assert issue.message.startswith(
        "the matches() patterns up to this one share a work budget and compile to 9054 instructions in all"
    )


def test_the_operations_that_read_a_whole_text_or_list_share_one_scan_budget() -> None:
    # lower(), contains() and 'in' cost a pass over the text each: the 120 of one expression of 4096
    # characters, in each of a thousand rules, cost minutes a decision on a megabyte of prompt.
    source = " or ".join(["'zq' in prompt"] * 50 + ["contains(lower(prompt), 'zq')"] * 25)
    expr = compile_expression(source)
    assert (expr.scans, expr.shared_scans) == (100, 100)
    allowance = MAX_SCAN_WORK // 100
    assert expr.test({"prompt": "a" * allowance}) is False
    with pytest.raises(ExpressionEvalError) as info:
        expr.test({"prompt": "a" * (allowance + 1)})
    assert info.value.message == (
        f"'in' would read {allowance + 1} characters; each of the 100 operations that share this scan budget "
        f"may read {allowance} (see docs/policy-language.md, 'Bounds')"
    )
    # A list item costs SCAN_ITEM_COST characters: two lists of the request are compared item by item in
    # Python, about 350 ns an item (a hundred comparisons of two lists of a million items took 35 s).
    items = allowance // SCAN_ITEM_COST
    schema = dsl.STANDARD_SCHEMA.extend({"other": dsl.STANDARD_SCHEMA.fields["input_ids"]})
    lists = compile_expression(" or ".join(["input_ids == other"] * 50 + ["max(input_ids) > 5"] * 50), schema)
    assert lists.test({"input_ids": [1] * items, "other": [2] * items}) is False
    with pytest.raises(ExpressionEvalError) as info:
        lists.test({"input_ids": [1] * (items + 1), "other": [2] * (items + 1)})
    assert info.value.message.startswith(f"'==' would read {items + 1} items; each of the 100 operations")
    assert info.value.message.endswith(f"may read {items} (see docs/policy-language.md, 'Bounds')")
    with pytest.raises(ExpressionEvalError) as info:
        lists.test({"input_ids": [1] * (items + 1), "other": [2]})  # the longer of the two counts
    assert compile_expression("input_ids == [1, 2]").scans == 0  # against a literal: lengths differ first


def test_a_membership_test_against_a_literal_reads_no_request_text() -> None:
    expr = compile_expression("tenant.tier in ['pro', 'team'] and 'x' not in 'abc' and len(prompt) > 0")
    assert expr.scans == 0
    assert expr.test({"tenant": {"id": "a", "tier": "pro"}, "prompt": "a" * (MAX_SCAN_WORK + 1)}) is True


def test_the_text_operations_of_every_rule_of_a_policy_share_one_scan_budget() -> None:
    when = " or ".join(["contains(prompt, 'zq')"] * 100)
    rules = "".join(f"  - {{name: r{i}, when: \"{when}\", cache: bypass}}\n" for i in range(10))
    policy = dsl.parse_policy("policy: p\nversion: 1\nrules:\n" + rules + "  - {name: rest, when: 'true'}\n")
    allowance = MAX_SCAN_WORK // 1000
    assert policy.decide({"prompt": "a" * allowance}).rule == "rest"
    decision = policy.decide({"prompt": "a" * (allowance + 1)})
    assert (decision.rule, decision.skipped) == ("rest", tuple(f"r{i}" for i in range(10)))
    assert compile_expression(when).test({"prompt": "a" * (allowance + 1)}) is False  # alone: its own budget


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        ("(a+)+$", "a" * 40 + "!"),
        ("^(a|a)*$", "a" * 40 + "!"),
        ("(a|aa)+b", "a" * 5000),
        ("(a?){25}a{25}", "a" * 24),
        ("a?" * 40 + "a" * 40, "a" * 39),
        (".*a.*a.*a.*b", "a" * 20000),
        ("\\\\d{1000}x", "1" * 30000),
    ],
)
def test_patterns_that_backtrack_in_python_re_are_linear_and_do_not_match(pattern: str, text: str) -> None:
    # Each of these takes a backtracking engine longer than any request may wait (2**40 steps for the first).
    # RE2 runs them as automata: one pass over the text.
    assert compile_expression(f"matches(prompt, '{pattern}')").test({"prompt": text}) is False


def test_patterns_are_compiled_by_re2_with_a_bounded_program() -> None:
    pattern = compile_pattern(r"\d{1000}x")
    assert pattern.program_size == 1005
    assert pattern.max_bytes == MATCH_WORK_BUDGET // 1005
    assert pattern.regex.options.max_mem == 1005 * 1024  # its memory, by its size (see below)
    with pytest.raises(PatternError) as info:
        compile_pattern("(?:abcdefghij){900}")
    assert info.value.message == (
        f"pattern is too large: it compiles to 9004 instructions; the limit is {MAX_PROGRAM_SIZE}"
    )
    with pytest.raises(PatternError) as info:
        compile_pattern(r"\pL{1000}")
    assert info.value.message == f"pattern is too large: RE2 cannot compile it within {PATTERN_MAX_MEM} bytes"


def test_the_memory_of_a_pattern_is_bounded_by_its_program_size() -> None:
    # RE2 grows each pattern's automaton cache up to its max_mem on texts that defeat it: at 8 MiB each, the
    # 340 patterns below could hold 2.7 GiB. At 1 KiB per instruction (32 KiB at least) the patterns of one
    # policy, 8192 instructions in all, hold 8 MiB plus 32 KiB for each small one.
    assert compile_pattern("(?i)translate").regex.options.max_mem == PATTERN_MIN_MEM
    assert compile_pattern(r"\pL{6}").regex.options.max_mem == 7180 * 1024
    rules = "".join(f"  - {{name: r{i}, when: \"matches(prompt, 'a[ab]{{16}}{i:03d}')\"}}\n" for i in range(340))
    policy = dsl.parse_policy("policy: p\nversion: 1\nrules:\n" + rules)
    patterns = [compile_pattern(f"a[ab]{{16}}{i:03d}") for i in range(340)]
    assert sum(p.program_size for p in patterns) <= MAX_PROGRAM_SIZE
    assert sum(p.regex.options.max_mem for p in patterns) == 340 * PATTERN_MIN_MEM  # 10.6 MiB, not 2.7 GiB
    assert len(policy.rules) == 340


def test_a_pattern_with_a_lone_surrogate_is_a_compile_error_at_its_literal() -> None:
    # Written from Python (a YAML file cannot hold one): RE2 reads UTF-8, which has no lone surrogates.
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression("matches(prompt, 'a\ud800')")
    assert (info.value.line, info.value.column) == (1, 17)
    assert info.value.message == (
        "invalid pattern: a lone surrogate (U+D800) is not text (in the text searched, '.' and negated "
        "classes match one)"
    )


@pytest.mark.parametrize("pattern", ["(a{1000}){1000}", "(a{100}){11}", "\\\\d{50000}x"])
def test_a_repetition_too_large_says_that_nested_counts_multiply(pattern: str) -> None:
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression(f"matches(prompt, '{pattern}')")
    assert info.value.message.startswith("invalid pattern: invalid repetition size: {")
    assert info.value.message.endswith(
        "(a count is at most 1000, and nested counts multiply: (a{100}){10} is the most)"
    )
    assert compile_expression("matches(prompt, '(a{100}){10}')").test({"prompt": "a" * 999}) is False


def test_a_lone_surrogate_in_the_text_is_searched_not_an_error() -> None:
    assert compile_expression("matches(prompt, '^a.b$')").test({"prompt": "a\ud800b"}) is True
    assert compile_expression("matches(prompt, 'x')").test({"prompt": "a\ud800b"}) is False


def test_string_building_is_bounded() -> None:
    expr = compile_expression("prompt + prompt")
    assert expr.evaluate({"prompt": "x" * 32768}) == "x" * 65536
    with pytest.raises(ExpressionEvalError) as info:
        expr.evaluate({"prompt": "x" * 32769})
    assert "65538 characters (limit 65536)" in info.value.message


def test_float_results_must_be_finite() -> None:
    expr = compile_expression("temperature * 2")
    with pytest.raises(ExpressionEvalError) as info:
        expr.evaluate({"temperature": float("inf")})
    assert info.value.message == "result is not a finite number"
    with pytest.raises(ExpressionEvalError):
        compile_expression("int(temperature)").evaluate({"temperature": float("nan")})


def test_recursive_list_comparison_is_an_eval_error() -> None:
    schema = STANDARD_SCHEMA.extend({"x": TYPE_NAMES["list"]})
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ExpressionEvalError) as info:
        compile_expression("x == x", schema).evaluate({"x": loop})
    assert info.value.message == "values are nested too deeply to compare"


def test_unsupported_values_in_any_fields() -> None:
    schema = STANDARD_SCHEMA.extend({"x": TYPE_NAMES["any"]})
    view = {"x": object()}
    assert compile_expression("x == none", schema).test(view) is False
    with pytest.raises(ExpressionEvalError) as info:
        compile_expression("x == 1", schema).test(view)
    assert info.value.message == "cannot compare unsupported type object with int"
    with pytest.raises(ExpressionEvalError):
        compile_expression("len(x) > 1", schema).test({"x": b"bytes"})


def test_depth_limit_is_exactly_32() -> None:
    assert compile_expression("(" * 31 + "1" + ")" * 31).evaluate({}) == 1
    assert compile_expression("+".join(["1"] * 32)).evaluate({}) == 32
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression("+".join(["1"] * 33))
    assert (info.value.line, info.value.column) == (1, 64)
    long_and = " and ".join(["stream"] * 300)  # flat: as deep as two operands
    assert compile_expression(long_and).test({"stream": True}) is True


# -- property tests -----------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENS = [
    "top_k",
    "input_ids",
    "prompt",
    "seed",
    "stream",
    "tenant",
    "tier",
    "id",
    "temperature",
    "x",
    "xs",
    ".",
    "(",
    ")",
    "[",
    "]",
    ",",
    "+",
    "-",
    "*",
    "/",
    "//",
    "%",
    "==",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    "and",
    "or",
    "not",
    "in",
    "true",
    "false",
    "none",
    "0",
    "1",
    "-1",
    "2.5",
    "9223372036854775807",
    "'a'",
    '"bc"',
    "'\\n'",
    "len",
    "min",
    "max",
    "abs",
    "lower",
    "upper",
    "startswith",
    "endswith",
    "contains",
    "matches",
    "int",
    "float",
    "str",
    "'(a+)+'",
    "'^a.*'",
    "[]",
    "**",
    "=",
    ":",
    ";",
    "__class__",
    "lambda",
    "if",
    "'",
    '"',
    "\\",
    "\n",
    "\u200b",
    "ｔop_k",
    "#",
    "{",
    "}",
    "1e999",
    "007",
]
FUZZ_SCHEMA = STANDARD_SCHEMA.extend({"x": TYPE_NAMES["any"], "xs": TYPE_NAMES["list"]})


@PROPERTY
@given(st.text(max_size=200))
def test_random_text_raises_only_expression_errors(source: str) -> None:
    try:
        compile_expression(source, FUZZ_SCHEMA)
    except ExpressionError as err:
        assert err.line >= 1 and err.column >= 1
        str(err)


@PROPERTY
@given(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=14), st.sampled_from([" ", ""]))
def test_token_soup_raises_only_expression_errors(tokens: list[str], sep: str) -> None:
    try:
        compile_expression(sep.join(tokens), FUZZ_SCHEMA)
    except ExpressionError as err:
        assert 1 <= err.line <= sep.join(tokens).count("\n") + 1
        str(err)


# Well-typed views of the standard schema (plus an `any` field and a list-of-any field).
_ints = st.integers(min_value=-(2**63), max_value=2**63)
_floats = st.floats(allow_nan=False, allow_infinity=False)
_scalars = st.one_of(st.none(), st.booleans(), _ints, _floats, st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
WELL_TYPED_VIEWS = st.fixed_dictionaries(
    {
        "input_ids": st.lists(st.integers(min_value=0, max_value=2**31), max_size=8),
        "prompt": st.text(max_size=30),
        "model": st.text(max_size=8),
        "model_revision": st.text(max_size=4),
        "temperature": _floats,
        "top_k": _ints,
        "top_p": _floats,
        "max_tokens": _ints,
        "seed": st.one_of(st.none(), _ints),
        "stream": st.booleans(),
        "tenant": st.fixed_dictionaries(
            {"id": st.text(max_size=5), "tier": st.sampled_from(["free", "pro"])}
        ),
        "x": _values,
        "xs": st.lists(_values, max_size=4),
    }
)

# Expressions from a small grammar, so that many of them compile and reach evaluate().
_atoms = st.sampled_from(
    [
        "top_k",
        "max_tokens",
        "seed",
        "temperature",
        "top_p",
        "len(input_ids)",
        "len(prompt)",
        "tenant.tier",
        "prompt",
        "stream",
        "x",
        "xs",
        "input_ids",
        "input_ids[0]",
        "xs[1]",
        "0",
        "1",
        "-3",
        "2.5",
        "9223372036854775807",
        "'free'",
        "'a'",
        "true",
        "false",
        "none",
        "[1, 2]",
        "['free', 'pro']",
    ]
)


def _grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    binary = st.sampled_from(
        ["+", "-", "*", "/", "//", "%", "==", "!=", "<", "<=", ">", ">=", "in", "not in", "and", "or"]
    )
    unary_fns = st.sampled_from(
        ["len", "abs", "lower", "upper", "int", "float", "str", "min", "max", "not", "-"]
    )
    binary_fns = st.sampled_from(["startswith", "endswith", "contains", "min", "max"])
    return st.one_of(
        st.builds(lambda a, op, b: f"({a} {op} {b})", inner, binary, inner),
        st.builds(lambda f, a: f"{f} ({a})" if f in ("not", "-") else f"{f}({a})", unary_fns, inner),
        st.builds(lambda f, a, b: f"{f}({a}, {b})", binary_fns, inner, inner),
        st.builds(lambda a: f"matches(str({a}), '^a.*b?$')", inner),
        st.builds(lambda a, b, c: f"{a} < {b} <= {c}", inner, inner, inner),
    )


EXPRESSIONS = st.recursive(_atoms, _grow, max_leaves=6)


@PROPERTY
@given(EXPRESSIONS, WELL_TYPED_VIEWS)
def test_well_typed_views_raise_only_eval_errors(source: str, view: dict[str, Any]) -> None:
    try:
        expr = compile_expression(source, FUZZ_SCHEMA)
    except ExpressionCompileError:
        return
    try:
        expr.evaluate(view)
    except ExpressionEvalError as err:
        assert 1 <= err.column <= len(source) + 1


@PROPERTY
@given(EXPRESSIONS, st.dictionaries(st.sampled_from(sorted(FUZZ_SCHEMA.fields)), _values))
def test_ill_typed_views_raise_only_eval_errors(source: str, view: dict[str, Any]) -> None:
    try:
        expr = compile_expression(source, FUZZ_SCHEMA)
    except ExpressionCompileError:
        return
    try:
        expr.evaluate(view)
    except ExpressionEvalError:
        pass


_small = st.integers(min_value=-(2**31), max_value=2**31)
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}


@PROPERTY
@given(_small, st.sampled_from(sorted(_OPS)), _small)
def test_integer_arithmetic_matches_python(a: int, op: str, b: int) -> None:
    schema = STANDARD_SCHEMA.extend({"a": TYPE_NAMES["int"], "b": TYPE_NAMES["int"]})
    expr = compile_expression(f"a {op} b", schema)
    if op in ("//", "%") and b == 0:
        with pytest.raises(ExpressionEvalError):
            expr.evaluate({"a": a, "b": b})
    else:
        assert expr.evaluate({"a": a, "b": b}) == _OPS[op](a, b)


@PROPERTY
@given(_small, _small, _small)
def test_chained_comparison_is_a_conjunction(a: int, b: int, c: int) -> None:
    schema = STANDARD_SCHEMA.extend({name: TYPE_NAMES["int"] for name in "abc"})
    view = {"a": a, "b": b, "c": c}
    chained = compile_expression("a < b <= c", schema).evaluate(view)
    assert chained is ((a < b) and (b <= c))
    assert chained is compile_expression("a < b and b <= c", schema).evaluate(view)


def test_field_type_of_a_literal_list_is_inferred() -> None:
    assert compile_expression("[1, 2]").result_type == FieldType(Kind.LIST, item=FieldType(Kind.INT))
    assert compile_expression("[1, 2.5]").result_type.item == FieldType(Kind.FLOAT)
    assert compile_expression("[1, 'a']").result_type.item == FieldType(Kind.ANY)
