"""Hostile expressions: every one is rejected at compile time, with the error class (and where it matters, the
position) asserted exactly. Nothing here may reach evaluation."""

from __future__ import annotations

import pytest

from evocache.dsl import (
    ExpressionCompileError,
    ExpressionError,
    ExpressionSyntaxError,
    compile_expression,
)

SYN, COMP = ExpressionSyntaxError, ExpressionCompileError

# (source, error class, (line, column) or None)
HOSTILE: list[tuple[str, type[ExpressionError], tuple[int, int] | None]] = [
    # Python escape hatches
    ("__import__('os')", COMP, (1, 1)),
    ("__import__('os').system('ls')", COMP, (1, 18)),  # method call caught by the parser first
    ("().__class__", SYN, (1, 2)),
    ("().__class__.__bases__[0].__subclasses__()", SYN, (1, 2)),
    ("tenant.__dict__", COMP, (1, 8)),
    ("tenant.__class__", COMP, (1, 8)),
    ("input_ids.__len__()", COMP, (1, 11)),
    ("input_ids.append(1)", COMP, (1, 11)),
    ("prompt.format(x=1)", SYN, (1, 16)),  # the lexer sees '=' before the parser sees the call
    ("len.__self__", COMP, (1, 5)),
    ("len.__globals__['os']", COMP, (1, 5)),
    ("len(prompt).__class__", COMP, (1, 13)),
    ("eval('1')", COMP, (1, 1)),
    ("exec('x = 1')", COMP, (1, 1)),
    ("open('x')", COMP, (1, 1)),
    ("getattr(tenant, 'id')", COMP, (1, 1)),
    ("globals()", COMP, (1, 1)),
    ("compile('1', 'f', 'eval')", COMP, (1, 1)),
    ("type(tenant)", COMP, (1, 1)),
    ("print", COMP, (1, 1)),
    ("(len)(prompt).x", COMP, (1, 15)),
    ("prompt(1)", COMP, (1, 1)),
    ("input_ids[0](1)", COMP, (1, 13)),
    ("_private", COMP, (1, 1)),
    ("__builtins__", COMP, (1, 1)),
    # resource exhaustion
    ('"a" * 10**9', SYN, (1, 9)),
    ("9**9**9", SYN, (1, 2)),
    ("[1]*10**9", SYN, (1, 7)),
    ("'a' * 1000000", COMP, (1, 5)),
    ("[1] * 1000000", COMP, (1, 5)),
    ("(" * 100 + "1" + ")" * 100, COMP, (1, 32)),
    ("[" * 100 + "]" * 100, COMP, (1, 32)),
    ("not " * 100 + "stream", COMP, (1, 125)),
    ("-" * 100 + "1", COMP, (1, 32)),
    ("len(" * 40 + "prompt" + ")" * 40, COMP, (1, 128)),  # the 32nd '(': its argument is level 33
    ("1" + "+1" * 40, COMP, (1, 64)),
    ("'" + "x" * 10_000_000 + "'", COMP, (1, 4097)),
    ("[" + ", ".join(["1"] * 5000) + "]", COMP, (1, 4097)),
    ("[" + ",".join(["0"] * 300) + "]", COMP, (1, 514)),
    ("'" + "x" * 1025 + "'", COMP, (1, 1)),
    ("9" * 30, COMP, (1, 1)),
    ("18446744073709551616", COMP, (1, 1)),
    ("1e309", COMP, (1, 1)),
    ("matches(prompt, '(a+)(?#)+$')", COMP, (1, 17)),  # a comment group can hide a quantifier
    ("matches(prompt, '\\\\d{50000}x')", COMP, (1, 17)),  # a count RE2 does not compile
    ("matches(prompt, '(?:abcdefghij){900}')", COMP, (1, 17)),  # a program over MAX_PROGRAM_SIZE
    ("matches(prompt, '\\\\pL{1000}')", COMP, (1, 17)),  # a program over RE2's memory
    ("matches(prompt, '(a)\\\\1')", COMP, (1, 17)),  # backreference
    ("matches(prompt, '(?=a)a')", COMP, (1, 17)),  # lookaround
    ("matches(prompt, '(?>a+)')", COMP, (1, 17)),  # atomic group
    ("matches(prompt, 'a++')", COMP, (1, 17)),  # possessive quantifier
    ("matches(prompt, '(?x) (a+)+ # comment')", COMP, (1, 17)),
    ("matches(prompt, lower(prompt))", COMP, (1, 17)),
    # statements and other Python syntax
    ("lambda: 1", SYN, (1, 1)),
    ("(lambda x: x)(1)", SYN, (1, 2)),
    ("f'{tenant.__class__}'", SYN, (1, 1)),
    ("rb'x'", SYN, (1, 1)),
    ("import os", SYN, (1, 1)),
    ("from os import system", SYN, (1, 1)),
    ("top_k if stream else 0", SYN, (1, 7)),
    ("[x for x in input_ids]", SYN, (1, 4)),
    ("top_k > 1; import os", SYN, (1, 10)),
    ("top_k = 1", SYN, (1, 7)),
    ("top_k += 1", SYN, (1, 8)),
    ("(top_k := 1)", SYN, (1, 8)),
    ("del top_k", SYN, (1, 1)),
    ("assert stream", SYN, (1, 1)),
    ("yield 1", SYN, (1, 1)),
    ("await stream", SYN, (1, 1)),
    ("stream is True", SYN, (1, 8)),
    ("{'a': 1}", SYN, (1, 1)),
    ("input_ids[::-1]", SYN, (1, 11)),
    ("top_k # comment", SYN, (1, 7)),
    ("`top_k`", SYN, (1, 1)),
    ("top_k @ 2", SYN, (1, 7)),
    ("~top_k", SYN, (1, 1)),
    ("stream & stream", SYN, (1, 8)),
    ("!stream", SYN, (1, 1)),
    ("len(*input_ids)", SYN, (1, 5)),
    ("max(**tenant)", SYN, (1, 5)),
    ("len(prompt=1)", SYN, (1, 11)),
    ("0x41", SYN, (1, 1)),
    ("1_000", SYN, (1, 1)),
    ("'\\x41'", SYN, (1, 2)),
    ("'\\u0041'", SYN, (1, 2)),
    ("'a\nb'", SYN, (1, 1)),
    ("'a\u2028b'", SYN, (1, 1)),
    ("top_k\x0c> 1", SYN, (1, 6)),
    # unicode tricks
    ("ｔｏｐ_ｋ > 1", SYN, (1, 1)),  # fullwidth letters (NFKC would fold them to top_k)
    ("top\u200b_k > 1", SYN, (1, 4)),  # zero-width space inside a name
    ("top_k\u200d > 1", SYN, (1, 6)),  # zero-width joiner
    ("\ufefftop_k > 1", SYN, (1, 1)),  # byte-order mark
    ("top_k\u00a0> 1", SYN, (1, 6)),  # no-break space
    ("top_k > \uff11", SYN, (1, 9)),  # fullwidth digit one
    ("top_k > \u0661", SYN, (1, 9)),  # arabic-indic digit one
    ("tеnant.tier", SYN, (1, 2)),  # Cyrillic 'е' homoglyph
    ("top_k \u2264 1", SYN, (1, 7)),  # '≤'
    ("stream\u202e", SYN, (1, 7)),  # right-to-left override
    ("top_k > 1 \u037e stream", SYN, (1, 11)),  # Greek question mark, looks like ';'
]


@pytest.mark.parametrize(("source", "error", "position"), HOSTILE, ids=[repr(h[0])[:50] for h in HOSTILE])
def test_hostile_expression_is_rejected_at_compile_time(
    source: str, error: type[ExpressionError], position: tuple[int, int] | None
) -> None:
    with pytest.raises(ExpressionError) as info:
        compile_expression(source)
    assert type(info.value) is error, str(info.value)[:300]
    if position is not None:
        assert (info.value.line, info.value.column) == position, str(info.value)[:300]


def test_a_huge_expression_error_does_not_carry_the_whole_text() -> None:
    with pytest.raises(ExpressionCompileError) as info:
        compile_expression("'" + "x" * 10_000_000 + "'")
    assert len(info.value.source) == 4097
    assert len(str(info.value)) < 10_000
    assert "10000002 characters long; the limit is 4096" in info.value.message


def test_messages_tell_what_to_write_instead() -> None:
    cases = {
        "9**9": "the power operator '**' is not supported",
        "top_k = 1": "compare with '=='",
        "stream is True": "compare with '==' or '!='",
        "top_k if stream else 0": "conditional expressions",
        "f'x'": "no f-strings",
        "top\u200b_k": "invisible character U+200B ZERO WIDTH SPACE",
        "ｔop_k": "U+FF54 FULLWIDTH LATIN SMALL LETTER T",
        "input_ids.__len__()": "method calls are not allowed",
        "tenant.__dict__": "attribute names starting with '__' are not allowed",
        "open('x')": "unknown function 'open' (known functions: abs, contains,",
    }
    for source, fragment in cases.items():
        with pytest.raises(ExpressionError) as info:
            compile_expression(source)
        assert fragment in info.value.message, (source, info.value.message)
