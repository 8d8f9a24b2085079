"""Reading policy files and long documents: what is refused before parsing, and that loading stays linear."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from evocache.dsl import Policy, PolicyError, PolicyFileError, load_policy, parse_policy
from evocache.dsl._lexer import MAX_SOURCE_CHARS
from evocache.dsl._source import MAX_POLICY_BYTES
from evocache.dsl._policy import MAX_RULES
from evocache.dsl._yaml import MAX_DOCUMENT_CHARS, MAX_NODES
from evocache.dsl.commands import app
from typer.testing import CliRunner

runner = CliRunner()
HEAD = "policy: p\nversion: 1\nrules:\n  - name: r\n    when: "


def _only_issue(info: pytest.ExceptionInfo[PolicyError]) -> str:
    (issue,) = info.value.issues
    return str(issue)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    with pytest.raises(PolicyFileError) as info:
        load_policy(fifo)
    assert isinstance(info.value, OSError)
    assert (info.value.filename, info.value.strerror) == (
        str(fifo),
        "not a regular file (a FIFO); a policy is read from a file",
    )


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_a_device_is_refused_before_reading(path: str, kind: str) -> None:
    with pytest.raises(PolicyFileError) as info:
        load_policy(path)
    assert info.value.strerror == f"not a regular file ({kind}); a policy is read from a file"


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyFileError) as info:
        load_policy(tmp_path)
    assert info.value.strerror == "not a regular file (a directory); a policy is read from a file"


def test_check_exits_2_for_paths_that_are_not_files_and_checks_the_rest(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    good = tmp_path / "good.yaml"
    good.write_text("policy: good\nversion: 1\n")
    result = runner.invoke(app, ["check", "/dev/zero", str(fifo), str(good)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: /dev/zero: not a regular file (a character device); a policy is read from a file",
        f"error: {fifo}: not a regular file (a FIFO); a policy is read from a file",
    ]
    assert result.stdout.startswith("ok good@1 ")


def test_a_file_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    at_limit = tmp_path / "at-limit.yaml"
    body = "policy: p\nversion: 1\n# "
    at_limit.write_text(body + "x" * (MAX_POLICY_BYTES - len(body)))
    assert at_limit.stat().st_size == MAX_POLICY_BYTES
    assert load_policy(at_limit).ref == "p@1"
    over = tmp_path / "over.yaml"
    with over.open("wb") as f:  # 30 MB, sparse: only its first MAX_POLICY_BYTES + 1 bytes may be read
        f.write(body.encode())
        f.truncate(30 * 1024 * 1024)
    with pytest.raises(PolicyError) as info:
        load_policy(over)
    assert _only_issue(info) == f"{over}: <document>: file is larger than the limit of {MAX_POLICY_BYTES} bytes"


def test_a_text_over_the_size_limit_is_refused_before_yaml_reads_it() -> None:
    text = "policy: p\nversion: 1\n" + "#" * MAX_DOCUMENT_CHARS
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "big.yaml")
    assert _only_issue(info) == (
        f"big.yaml: <document>: document is {len(text)} characters long; the limit is {MAX_DOCUMENT_CHARS}"
    )


def test_an_expression_over_its_limit_names_the_file_and_the_limit() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(HEAD + "a" * 500_000 + "\n", "long.yaml")
    (issue,) = info.value.issues
    assert (issue.file, issue.line, issue.column, issue.field) == ("long.yaml", 5, 11 + MAX_SOURCE_CHARS, "rules[0].when")
    assert issue.message.startswith(f"expression is 500000 characters long; the limit is {MAX_SOURCE_CHARS}\n")


class _CountingText(str):
    """A document text that counts the characters its own searches and slices go over: the work that the
    position mapping does on it (PyYAML reads a copy of its own)."""

    scanned = 0

    def _span(self, start: Any, end: Any) -> None:
        lo = 0 if start is None else start
        hi = len(self) if end is None else end
        type(self).scanned += max(0, min(hi, len(self)) - max(lo, 0))

    def count(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        self._span(start, end)
        return super().count(sub, start, end)

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        self._span(start, end)
        return super().find(sub, start, end)

    def rfind(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        self._span(start, end)
        return super().rfind(sub, start, end)

    def __getitem__(self, key: Any) -> str:  # type: ignore[override]
        if isinstance(key, slice):
            self._span(key.start, key.stop)
        else:
            type(self).scanned += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("style", ["plain", "double-quoted", "literal"])
def test_an_error_at_the_end_of_a_long_expression_is_located_in_linear_work(style: str) -> None:
    # The longest expression allowed, with its error (an unknown name) on the last token: finding the file
    # position of that token must not rescan the document once per character of the expression.
    expression = " and ".join(["stream"] * 400) + " and nope"
    expression = expression[-(MAX_SOURCE_CHARS - 8) :].lstrip(" and")
    body = {
        "plain": expression,
        "double-quoted": f'"{expression}"',
        "literal": "|\n      " + expression,
    }[style]
    text = _CountingText(HEAD + body + "\n")
    _CountingText.scanned = 0
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    scanned = _CountingText.scanned
    (issue,) = info.value.issues
    assert issue.message.startswith("unknown name 'nope'")
    at = str(text).index("nope")
    assert (issue.line, issue.column) == (str(text).count("\n", 0, at) + 1, at - str(text).rfind("\n", 0, at))
    # Linear: a few passes over the text (about 8). Looking each character's line up from the start of the
    # document, as a per-character position table would, costs len(text)**2 / 2: some 8.5 million here.
    assert scanned < 10 * len(text)


@pytest.mark.parametrize(
    ("text", "where", "field"),
    [
        (HEAD + "\"prompt == '\\ud800'\"\n", (5, 23), "rules[0].when"),
        ('policy: "p\\udfff"\nversion: 1\n', (1, 11), "policy"),
        ('policy: p\nversion: 1\n"k\\ud83d\\ude00": 1\n', (3, 3), ""),  # a UTF-16 pair is two lone halves
    ],
)
def test_a_lone_surrogate_written_as_an_escape_is_an_issue_at_the_escape(
    text: str, where: tuple[int, int], field: str
) -> None:
    # A string holding one cannot be encoded: it would fail the content hash (and `policy check`) later.
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "s.yaml")
    (issue,) = info.value.issues
    assert (issue.line, issue.column, issue.field) == (*where, field)
    assert issue.message.startswith("a lone surrogate (U+D")


def test_check_reports_a_lone_surrogate_with_exit_1(tmp_path: Path) -> None:
    doc = tmp_path / "s.yaml"
    doc.write_text("policy: p\nversion: 1\nrules:\n  - name: r\n    when: \"prompt == '\\ud800'\"\n")
    result = runner.invoke(app, ["check", str(doc)])
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.exit_code == 1
    assert result.stdout.startswith(f"{doc}:5:23: rules[0].when: a lone surrogate (U+D800) is not text")


def test_a_document_of_too_many_nodes_fails_at_the_node_past_the_limit_before_reading_on() -> None:
    # A megabyte of "1," is some 500,000 nodes: composing them all before counting would take PyYAML ten
    # seconds or more. The count stops at the node past MAX_NODES: the unclosed bracket at the end, which
    # composing the whole list would report, is never reached.
    text = "policy: p\nversion: 1\nx: [" + "1," * (MAX_DOCUMENT_CHARS // 2 - 20)
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "n.yaml")
    (issue,) = info.value.issues
    # The root mapping, three keys, two values and the list are 7 nodes: the 49,994th item is one too many.
    column = 5 + 2 * (MAX_NODES - 7)
    assert str(issue) == (
        f"n.yaml:3:{column}: <document>: document writes more than {MAX_NODES} keys and values; "
        "a policy is a few hundred"
    )


def test_a_policy_holds_at_most_max_rules_rules_and_validation_stops_past_them() -> None:
    rules = "".join(f"  - {{name: r{i}, when: top_k > {i}}}\n" for i in range(MAX_RULES))
    assert len(parse_policy("policy: p\nversion: 1\nrules:\n" + rules).rules) == MAX_RULES
    # No rule is validated then: the errors of those past the limit (no `when`) are not reported.
    text = "policy: p\nversion: 1\nrules:\n" + rules + "  - {name: extra}\n" * 5
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "r.yaml")
    (issue,) = info.value.issues
    assert str(issue) == (
        f"r.yaml:{4 + MAX_RULES}:5: rules[{MAX_RULES}]: a policy has at most {MAX_RULES} rules; "
        f"this one has {MAX_RULES + 5}"
    )
    # Built from data, without positions, the model holds the same bound.
    many = [{"name": f"r{i}", "when": "true"} for i in range(MAX_RULES + 1)]
    data = {"policy": "p", "version": 1, "rules": many}
    with pytest.raises(ValueError, match=f"at most {MAX_RULES} items"):
        Policy.model_validate(data)


_NOPE = "policy: p\nversion: 1\nrules:\n  - name: r\n    when: top_k > 1 and nope\n"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (_NOPE, (5, 25)),
        (_NOPE.replace("\n", "\r\n"), (5, 25)),
        (_NOPE.replace("\n", "\r"), (5, 25)),  # YAML reads each of these as a line break, as \n
        (_NOPE.replace("\n", "\x85"), (5, 25)),
        (_NOPE.replace("\n", "\u2028"), (5, 25)),
        (_NOPE.replace("top_k > 1 and nope", "|\n      top_k > 1 and\n      nope").replace("\n", "\r"), (7, 7)),
        ("\ufeffrules: [{name: r, when: nope}]\npolicy: p\nversion: 1\n", (1, 25)),  # a byte-order mark: no column
    ],
    ids=["lf", "crlf", "cr", "nel", "line-separator", "cr-literal-block", "bom"],
)
def test_an_expression_error_is_located_as_yaml_counts_lines_and_columns(
    text: str, where: tuple[int, int]
) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    (issue,) = info.value.issues
    assert issue.message.startswith("unknown name 'nope'")
    assert (issue.line, issue.column) == where


def test_a_device_is_refused_without_being_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    # Opening a device can act on its own (a watchdog starts counting when opened): the path is checked first.
    import evocache.dsl._source as source

    opened: list[str] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, *args: Any) -> int:
        opened.append(str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(source.os, "open", recording_open)
    with pytest.raises(PolicyFileError):
        load_policy("/dev/null")
    assert opened == []


def test_a_byte_that_is_not_utf8_is_located_as_yaml_counts_lines(tmp_path: Path) -> None:
    doc = tmp_path / "cr.yaml"
    doc.write_bytes(b"policy: p\rversion: 1\r# caf\xe9\r")  # \r alone ends a line in YAML
    with pytest.raises(PolicyError) as info:
        load_policy(doc)
    assert _only_issue(info) == (
        f"{doc}:3:6: <document>: not UTF-8 text: byte 0xe9 cannot be decoded (invalid continuation byte)"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("policy: p\nversion: 1\nrules:\n\t- {name: r, when: 'true'}\n", (4, 1)),  # a tab as indentation
        (HEAD + "top_k\t> 1\n", (5, 16)),  # a tab inside a plain value
    ],
)
def test_a_tab_where_yaml_refuses_one_says_what_to_write(text: str, where: tuple[int, int]) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "t.yaml")
    (issue,) = info.value.issues
    assert (issue.line, issue.column) == where
    assert issue.message == (
        "YAML syntax: found character '\\t' that cannot start any token "
        "(YAML indents with spaces, never tabs; quote a value that holds a tab)"
    )
    assert parse_policy(HEAD + '"top_k\t> 1"\n').rules[0].when == "top_k\t> 1"  # quoted, a tab is text


def _head(text: str) -> str:
    return repr(text)[:77] + f"... ({len(text)} characters)"  # as errors.brief shows it


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (
            "policy: " + "n" * 100_000 + "\nversion: 1\n",
            "policy",
            f"invalid name {_head('n' * 100_000)}: use letters, digits, '-', '_' and '.', starting with a letter "
            "or digit, at most 64 characters",
        ),
        (
            "policy: p\nversion: " + "9" * 5000 + "\n",
            "version",
            f"cannot read {_head('9' * 5000)} as !!int: an integer this long is out of every range",
        ),
        (
            "policy: p\nversion: 1\ndefaults: {ttl: '" + "1s" * 50_000 + "'}\n",
            "defaults.ttl",
            f"invalid duration {_head('1s' * 50_000)}: use each unit once, largest first (like 1h30m)",
        ),
        (
            "policy: p\nversion: 1\n" + "k" * 1000 + ": 1\n",  # YAML's longest plain key: 1024 characters
            "k" * 60 + "...",
            f"unknown field {_head('k' * 1000)}; known fields: policy, version, fields, defaults, rules, "
            "tenants, eviction, slo, guardrails",
        ),
    ],
    ids=["name", "integer", "duration", "key"],
)
def test_an_issue_shows_a_long_value_by_its_head_and_length(text: str, field: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "l.yaml")
    (issue,) = info.value.issues
    assert (issue.field, issue.message) == (field, message)
