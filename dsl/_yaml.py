"""Safe YAML loading that remembers where every value came from.

The document is composed into PyYAML's node tree with ``yaml.SafeLoader`` (never an unsafe loader) and turned
into plain dicts, lists and scalars here, so that:

- every value's node, and every mapping key's node, is kept under its path (``("rules", 0, "ttl")``), for
  error messages that name file, line and column;
- a duplicate key is an error instead of silently keeping the last one;
- only plain mappings, lists and the safe scalar types are built; any other tag (``!!python/object``,
  ``!!set``, a local ``!tag``) is an error;
- recursive aliases, alias bombs and very deep nesting fail with an error instead of hanging or crashing.

Every problem is collected and raised as one ``PolicyError``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .errors import PolicyError, PolicyIssue, brief

Path = tuple[str | int, ...]

_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_MERGE = "tag:yaml.org,2002:merge"
# A policy is a few hundred nodes; far larger means an alias bomb or something that is not a policy. Counted
# twice: the nodes the YAML text writes (keys included) while they are composed, so that a long document fails
# after composing MAX_NODES of them instead of all of them (PyYAML composes some 25,000 to 50,000 a second);
# then the values built from them, each use of an alias counted again.
MAX_NODES = 50_000
MAX_DEPTH = 64
# A policy is a few kilobytes; a longer text is refused before the YAML reader sees it (PyYAML reads about
# a megabyte a second, so this bounds loading to about a second).
MAX_DOCUMENT_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class Position:
    """1-based line and column in the document text."""

    line: int
    column: int


def _position(mark: yaml.Mark | None) -> Position | None:
    return None if mark is None else Position(mark.line + 1, mark.column + 1)


def format_path(path: Path) -> str:
    """``("rules", 0, "ttl")`` → ``rules[0].ttl``; a key longer than 64 characters is shown by its first 60
    (the message that names it shows its length)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if len(part) <= 64 else f"{part[:60]}..."
            out += f".{name}" if out else name
    return out


def _short_tag(tag: str) -> str:
    return tag.replace("tag:yaml.org,2002:", "!!")


@dataclass(frozen=True, slots=True)
class LocatedDocument:
    """A loaded document: plain ``data``, plus the node of every value (``values``) and key (``keys``)."""

    text: str
    source: str
    data: Any
    values: Mapping[Path, yaml.Node]
    keys: Mapping[Path, yaml.Node]

    def locate(self, path: Path, *, key: bool = False) -> Position | None:
        """Where ``path`` is written: its key when ``key`` (an unknown field), else its value. A path that is
        not in the document (a missing field) falls back to the nearest enclosing value that is."""
        if key and path in self.keys:
            return _position(self.keys[path].start_mark)
        for end in range(len(path), -1, -1):
            node = self.values.get(path[:end])
            if node is not None:
                return _position(node.start_mark)
        return None

    def scalar_position(self, path: Path, index: int) -> Position | None:
        """Where character ``index`` of the scalar string at ``path`` is written in the file (an index past
        the end: just past the scalar's last character). ``None`` if ``path`` is not a scalar.

        One pass over the scalar's text, whatever ``index``: an error at the end of a long expression costs
        no more than reading it."""
        node = self.values.get(path)
        if not isinstance(node, yaml.ScalarNode):
            return None
        offsets = _char_offsets(self.text, node)
        return index_position(self.text, offsets[min(max(index, 0), len(offsets) - 1)])


def load_located(text: str, source: str = "<string>") -> LocatedDocument:
    """Load one YAML document safely, keeping positions. Raises ``PolicyError`` listing every problem:
    a text longer than ``MAX_DOCUMENT_CHARS``, YAML syntax, several documents, duplicate keys, non-string keys,
    disallowed tags, recursion or size bombs. An empty document loads as ``None``."""
    if not isinstance(text, str):
        raise TypeError(f"policy text must be str, got {type(text).__name__}")
    if len(text) > MAX_DOCUMENT_CHARS:
        message = f"document is {len(text)} characters long; the limit is {MAX_DOCUMENT_CHARS}"
        raise PolicyError([PolicyIssue(source, None, None, "", message)])
    try:
        loader = _Loader(text)  # the reader rejects control characters right here
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        raise PolicyError([_yaml_issue(exc, source)]) from None
    except yaml.reader.ReaderError as exc:
        where = index_position(text, exc.position)
        message = f"character {chr(exc.character)!r} is not allowed in a YAML document"
        raise PolicyError([PolicyIssue(source, where.line, where.column, "", message)]) from None
    except _TooLarge as exc:
        where = _position(exc.mark)
        raise PolicyError(
            [PolicyIssue(source, where and where.line, where and where.column, "", exc.message)]
        ) from None
    builder = _Builder(loader, source, text)
    try:
        data = None if node is None else builder.build(node, ())
    finally:
        loader.dispose()
    if builder.issues:
        raise PolicyError(builder.issues)
    return LocatedDocument(text, source, data, builder.values, builder.keys)


_TOO_DEEP = f"document is nested more than {MAX_DEPTH} levels deep"
_TOO_MANY = f"document has more than {MAX_NODES} values (an alias bomb?)"
_TOO_MANY_NODES = f"document writes more than {MAX_NODES} keys and values; a policy is a few hundred"


class _TooLarge(Exception):
    def __init__(self, mark: yaml.Mark | None, message: str) -> None:
        self.mark = mark
        self.message = message


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops composing at the node that nests one level deeper than ``MAX_DEPTH``,
    and at the node (key or value; an alias is no new node) past the first ``MAX_NODES``.

    PyYAML composes recursively, one call per nesting level: without the check a deep document would end in
    a ``RecursionError`` that says nowhere where it happened."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0  # nodes being composed; the root's values are at depth 1, as in a path of length 1
        self._nodes = 0  # nodes composed so far

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self._depth > MAX_DEPTH:
            raise _TooLarge(self.peek_event().start_mark, _TOO_DEEP)
        if not self.check_event(yaml.AliasEvent):
            self._nodes += 1
            if self._nodes > MAX_NODES:
                raise _TooLarge(self.peek_event().start_mark, _TOO_MANY_NODES)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _yaml_issue(exc: yaml.MarkedYAMLError, source: str) -> PolicyIssue:
    mark = exc.problem_mark or exc.context_mark
    message = exc.problem or exc.context or "invalid YAML"
    if exc.context == "expected a single document in the stream":
        message = "expected a single YAML document, found more than one"
    elif exc.context and exc.problem and exc.context_mark is not None:
        # "expected ',' or '}'" means little without where the unclosed thing began.
        where = f"line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
        message = f"{exc.problem} ({exc.context} started at {where})"
    if exc.problem and "'\\t'" in exc.problem:
        message += " (YAML indents with spaces, never tabs; quote a value that holds a tab)"
    pos = _position(mark)
    return PolicyIssue(source, pos and pos.line, pos and pos.column, "", f"YAML syntax: {message}")


# What YAML reads as a line break (\r\n is one), as PyYAML counts lines and columns.
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")
_RARE_BREAK = re.compile("[\r\x85\u2028\u2029]")


def index_position(text: str, index: int) -> Position:
    """The line and column of ``text[index]`` as PyYAML counts them: a leading byte-order mark takes no column,
    and \r, \r\n, NEL and the Unicode line and paragraph separators break lines as \n does."""
    if _RARE_BREAK.search(text, 0, index):
        starts = [m.end() for m in _LINE_BREAK.finditer(text, 0, index)]
        line, line_start = len(starts) + 1, starts[-1] if starts else 0
    else:  # the usual text: two C-speed scans
        line, line_start = text.count("\n", 0, index) + 1, text.rfind("\n", 0, index) + 1
    bom = line_start == 0 and text.startswith("\ufeff") and index > 0
    return Position(line, index - line_start + 1 - bom)


class _Builder:
    """Turns composed nodes into plain data, recording positions and every problem on the way."""

    def __init__(self, loader: yaml.SafeLoader, source: str, text: str) -> None:
        self.loader = loader
        self.source = source
        self.text = text
        self.values: dict[Path, yaml.Node] = {}
        self.keys: dict[Path, yaml.Node] = {}
        self.issues: list[PolicyIssue] = []
        self._count = 0
        self._active: set[int] = set()  # ids of the nodes being built: a node met again is a recursive alias
        self._stopped = False

    def _issue(self, node: yaml.Node, path: Path, message: str) -> None:
        pos = _position(node.start_mark)
        self.issues.append(
            PolicyIssue(self.source, pos and pos.line, pos and pos.column, format_path(path), message)
        )

    def build(self, node: yaml.Node, path: Path) -> Any:
        if self._stopped:
            return None
        self._count += 1
        if self._count > MAX_NODES:
            self._issue(node, path, _TOO_MANY)
            self._stopped = True
            return None
        if len(path) > MAX_DEPTH:
            self._issue(node, path, _TOO_DEEP)
            self._stopped = True
            return None
        if id(node) in self._active:
            self._issue(node, path, "recursive alias: a value may not contain itself")
            return None
        self.values[path] = node
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
            if isinstance(node, yaml.SequenceNode):
                return self._sequence(node, path)
            return self._scalar(node, path)
        finally:
            self._active.discard(id(node))

    def _scalar(self, node: yaml.ScalarNode, path: Path) -> Any:
        if node.tag not in yaml.SafeLoader.yaml_constructors or node.tag in (_MAP, _SEQ):
            self._issue(node, path, f"tag {_short_tag(node.tag)} is not allowed: policies are plain YAML")
            return None
        try:
            value = self.loader.construct_object(node)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            # e.g. `!!int abc`, or a timestamp-shaped scalar that is no date (2001-13-45).
            reason = str(exc)
            if "int_max_str_digits" in reason:  # Python's own limit on reading long integers, 4300 digits
                reason = "an integer this long is out of every range"
            self._issue(node, path, f"cannot read {brief(node.value)} as {_short_tag(node.tag)}: {reason}")
            return None
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                self._surrogate(node, path, exc.start)
                return None
        return value

    def _surrogate(self, node: yaml.ScalarNode, path: Path, index: int) -> None:
        # Only an escape (`"\ud800"`) can write one: the reader refuses a raw surrogate. A string holding one
        # cannot be encoded, hashed or printed, so it is refused here, at the escape.
        where = index_position(self.text, _char_offsets(self.text, node)[index])
        code = f"U+{ord(node.value[index]):04X}"
        self.issues.append(
            PolicyIssue(
                self.source,
                where.line,
                where.column,
                format_path(path),
                f"a lone surrogate ({code}) is not text: escape the character itself (\\U0001F600), "
                "not half of a UTF-16 pair",
            )
        )

    def _sequence(self, node: yaml.SequenceNode, path: Path) -> list[Any] | None:
        if node.tag != _SEQ:
            self._issue(node, path, f"tag {_short_tag(node.tag)} is not allowed: use a plain list")
            return None
        return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]

    def _mapping(self, node: yaml.MappingNode, path: Path) -> dict[str, Any] | None:
        if node.tag != _MAP:
            self._issue(node, path, f"tag {_short_tag(node.tag)} is not allowed: use a plain mapping")
            return None
        merged: dict[str, Any] = {}
        explicit: dict[str, yaml.Node] = {}
        pairs = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                # `<<: *base` fills in keys the mapping does not set itself; earlier sources win.
                for key, value in self._merge_sources(value_node, path).items():
                    merged.setdefault(key, value)
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            if key in explicit:
                first = explicit[key].start_mark.line + 1
                self._issue(key_node, path + (key,), f"duplicate key {brief(key)} (first set on line {first})")
                continue
            explicit[key] = key_node
            pairs.append((key, key_node, value_node))
        result = dict(merged)
        for key, key_node, value_node in pairs:
            self.keys[path + (key,)] = key_node
            result[key] = self.build(value_node, path + (key,))
        return result

    def _merge_sources(self, node: yaml.Node, path: Path) -> dict[str, Any]:
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        out: dict[str, Any] = {}
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                self._issue(source, path, "a merge key (<<) takes a mapping or a list of mappings")
                continue
            built = self.build(source, path)
            for key, value in (built or {}).items():
                out.setdefault(key, value)
        return out

    def _key(self, node: yaml.Node, path: Path) -> str | None:
        if not isinstance(node, yaml.ScalarNode):
            self._issue(node, path, "mapping keys must be plain strings, not lists or mappings")
            return None
        key = self._scalar(node, path)
        if not isinstance(key, str):
            if key is not None or node.tag == "tag:yaml.org,2002:null":
                hint = " (quote it)" if node.style is None else ""
                self._issue(
                    node,
                    path,
                    f"mapping keys must be strings; {brief(node.value)} reads as {type(key).__name__}{hint}",
                )
            return None
        return key


def _char_offsets(text: str, node: yaml.ScalarNode) -> list[int]:
    """Align each character of a scalar's value with the text it was written as: the offset in ``text`` of
    each character, plus one for the offset just past the end.

    Exact for plain and quoted single-line scalars and for literal (``|``) blocks; for folded text (``>`` and
    multi-line flow scalars) a folded line break maps to the line break it came from. An escape in a
    double-quoted scalar maps to its backslash. Whatever cannot be aligned maps to the end of the scalar.
    """
    start, end = node.start_mark.index, node.end_mark.index
    style = node.style
    pos, indent = start, 0
    if style in ("|", ">"):
        header_end = _LINE_BREAK.search(text, start, end)  # the content starts on the line after the header
        pos = end if header_end is None else header_end.end()
        indent = _first_content_indent(text, pos, end)
        pos = _skip_indent(text, pos, end, indent)
    elif style in ("'", '"'):
        pos += 1
    out: list[int] = []
    for ch in node.value:
        # Skip what the value does not keep: indentation, a fold's trailing spaces, quotes, a lone \r.
        while pos < end and not _aligns(text[pos], ch, style):
            pos += 1
        out.append(min(pos, end))
        if pos < end:
            pos = _advance(text, pos, end, style, indent)
    out.append(min(pos, end))
    return out


def _aligns(raw: str, ch: str, style: str | None) -> bool:
    return raw == ch or (style == '"' and raw == "\\") or (ch in " \n" and raw in _FOLDED_BREAKS)


# The line breaks a scalar's value holds as \n (or a fold's space); \u2028 and \u2029 stay themselves.
_FOLDED_BREAKS = ("\n", "\r", "\x85")


def _advance(text: str, pos: int, end: int, style: str | None, indent: int) -> int:
    raw = text[pos]
    if style == '"' and raw == "\\":
        return min(pos + 2 + _ESCAPE_WIDTH.get(text[pos + 1 : pos + 2], 0), end)
    if style == "'" and raw == "'":
        return pos + 2  # '' is one quote
    if raw not in _FOLDED_BREAKS:
        return pos + 1
    pos += 2 if text.startswith("\r\n", pos) else 1
    if style in ("|", ">"):
        return _skip_indent(text, pos, end, indent)
    while pos < end and text[pos] in " \t":  # a flow scalar's fold also eats the next line's indentation
        pos += 1
    return pos


def _first_content_indent(text: str, pos: int, end: int) -> int:
    for line in _LINE_BREAK.split(text[pos:end]):
        if line.strip():
            return len(line) - len(line.lstrip(" "))
    return 0


def _skip_indent(text: str, pos: int, end: int, indent: int) -> int:
    stop = pos
    while stop < end and stop - pos < indent and text[stop] == " ":
        stop += 1
    return stop


# Escapes that carry hex digits: \xNN, \uNNNN, \UNNNNNNNN.
_ESCAPE_WIDTH = {"x": 2, "u": 4, "U": 8}
