"""The README and the design pages say what the code does: every link between them resolves, every section a
comment in the code points to exists, the code they show compiles and names what exists, the policies they
show load, and the commands they give take the options they are given."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest
import yaml
import typer
from typer.core import TyperGroup

from evocache.dsl import parse_policy

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Where code and comments point to a design page's section: ``docs/eviction.md, "Labels"``.
CODE_DIRS = ("controller", "dsl", "cli", "bench", "tests", "examples")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks blanked (a ``#`` line in a YAML or shell block is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _generated_sections() -> list[str]:
    """The section titles bench/report.py writes into docs/benchmarks.md (the committed page may predate
    them)."""
    source = (ROOT / "bench" / "report.py").read_text(encoding="utf-8")
    return re.findall(r'Section\("([^"]+)"', source)


@functools.cache
def headings(page: Path) -> dict[str, str]:
    """anchor -> heading of every heading of ``page`` (a repeated anchor gets GitHub's -1, -2, ...)."""
    text = _without_code(page.read_text(encoding="utf-8"))
    titles = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)
    if page == ROOT / "docs" / "benchmarks.md":
        titles += [t for t in _generated_sections() if t not in titles]
    found: dict[str, str] = {}
    for title in titles:
        base = slug = anchor(title)
        repeat = 0
        while slug in found:
            repeat += 1
            slug = f"{base}-{repeat}"
        found[slug] = title
    return found


def links(page: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every relative Markdown link of ``page``, outside code."""
    text = _without_code(page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`]*`", "", text)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        found.append((path, fragment))
    return found


def test_the_pages_are_there() -> None:
    names = {_rel(p) for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/policy-language.md", "docs/semantic.md",
            "docs/eviction.md", "docs/replay.md", "docs/benchmarks.md"} <= names


def test_the_anchors_of_a_page_are_githubs() -> None:
    assert anchor("Semantic caching: fow traps") == "semantic-caching-fow-traps"
    assert anchor("Contracts between the rooms") == "contracts-between-the-rooms"
    assert anchor("`lookahead` and LRU → Belady") == "lookahead-and-lru--belady"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for path, fragment in links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif fragment and (target.suffix != ".md" or fragment not in headings(target)):
            broken.append(f"{path}#{fragment}: no such heading")
    assert not broken, f"{_rel(page)}: {broken}"


def pointers() -> list[tuple[str, int, str, str]]:
    """(file, line, page, section) of every ``docs/<page>.md, 'Section'`` (or ``"Section"``, with or without
    the comma, a second one after ``and``) in the code, tests and examples; a section may run on over a line
    break, a comment's ``#`` included."""
    pattern = re.compile(r"docs/([a-z-]+\.md),?\s+(['\"])(.+?)\2(?:\s+and\s*#?\s*(['\"])(.+?)\4)?", re.DOTALL)
    found = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                for section in (match.group(3), match.group(5)):
                    if section is not None and "\n\n" not in section:
                        section = re.sub(r"\s*\n\s*#?\s*", " ", section)
                        found.append((_rel(path), line, match.group(1), section))
    return found


def test_pointers_are_found_across_line_breaks() -> None:
    found = {(page, section) for _, _, page, section in pointers()}
    assert ("semantic.md", "New tenants") in found  # a comment: "(see docs/semantic.md,\n# 'New tenants')"
    assert ("eviction.md", "The learned policy") in found  # a docstring: '"The learned\n    policy"'
    assert ("policy-language.md", "Bounds") in found  # '"Patterns" and\n "Bounds"'


def test_every_section_the_code_points_to_exists() -> None:
    missing = []
    for path, line, page, section in pointers():
        titles = set(headings(ROOT / "docs" / page).values())
        if section not in titles:
            missing.append(f"{path}:{line}: docs/{page}, {section!r}")
    assert not missing, missing


# -- what the pages show -------------------------------------------------------------------------------------


def blocks(page: Path, language: str) -> list[str]:
    text = page.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


PYTHON = [(p, i, code) for p in PAGES for i, code in enumerate(blocks(p, "python"))]
YAML = [(p, i, text) for p in PAGES for i, text in enumerate(blocks(p, "yaml"))]


@pytest.mark.parametrize(("page", "n", "code"), PYTHON, ids=[f"{_rel(p)}[{i}]" for p, i, _ in PYTHON])
def test_python_snippets_compile_and_call_what_exists_as_it_is_spelt(page: Path, n: int, code: str) -> None:
    """Each snippet compiles; every name it imports from evocache exists; and every keyword it passes to one
    of them is a parameter that callable has (a renamed option fails here, not in a newcomer's shell)."""
    tree = ast.parse(compile(code, f"{_rel(page)}[{n}]", "exec", ast.PyCF_ONLY_AST))
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("evocache"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    wrong = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported):
            continue
        parameters = inspect.signature(imported[node.func.id]).parameters.values()
        named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        wrong += [f"{node.func.id}({kw.arg}=)" for kw in node.keywords if kw.arg not in (None, *named)]
    assert not wrong, f"{_rel(page)}[{n}]: no such keyword: {wrong}"


def test_the_python_snippets_are_found() -> None:
    assert any(page.name == "README.md" for page, _, _ in PYTHON)


@pytest.mark.parametrize(("page", "n", "text"), YAML, ids=[f"{_rel(p)}[{i}]" for p, i, _ in YAML])
def test_policy_snippets_load(page: Path, n: int, text: str) -> None:
    """A complete document loads as it is; a fragment (``rules:`` alone) loads under a name and version. A
    serving configuration (``server:`` first) validates as a ``ServingConfig``."""
    if text.startswith("server:"):
        from evocache.serving import ServingConfig

        ServingConfig.model_validate(yaml.safe_load(text))
        return
    if not re.search(r"^policy:", text, re.MULTILINE):
        text = "policy: snippet\nversion: 1\n" + text
    parse_policy(text, source=f"{_rel(page)}[{n}]")


# -- the commands they give ----------------------------------------------------------------------------------


def command_lines(page: Path) -> list[str]:
    """Every ``evocache ...`` command the page gives: in code blocks (a ``\\`` line break joined) and inline
    code (over a line break too), up to a comment or the end of the command."""
    text = page.read_text(encoding="utf-8").replace("\\\n", " ")
    spans = re.findall(r"^```\w*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    spans += re.findall(r"^    (\S.*)$", text, re.MULTILINE)  # indented code
    spans += [s.replace("\n", " ") for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", _without_code(text))]
    found = []
    for span in spans:
        for line in span.splitlines():
            for match in re.finditer(r"\bevocache ((?:policy|bench) [a-z]+[^#;|)]*)", line):
                found.append(match.group(1).strip())
    return found


@functools.cache
def cli() -> TyperGroup:
    from evocache.cli.app import app

    return typer.main.get_command(app)


def options(words: list[str]) -> set[str]:
    command = cli()
    for word in words:
        assert isinstance(command, TyperGroup), f"{' '.join(words)}: no such command"
        assert word in command.commands, f"{' '.join(words)}: no such command"
        command = command.commands[word]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


COMMANDS = sorted({(p, line) for p in PAGES for line in command_lines(p)}, key=lambda c: (_rel(c[0]), c[1]))


def test_the_commands_are_found() -> None:
    found = {(_rel(p), c) for p, c in COMMANDS}
    assert ("README.md", "policy check examples/policies/chat-prod.yaml") in found
    assert any(c.startswith("bench eviction --trace") and "--utilisation" in c for _, c in COMMANDS)


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{_rel(p)}: {c[:60]}" for p, c in COMMANDS])
def test_every_command_takes_the_options_it_is_given(page: Path, line: str) -> None:
    words = line.split()
    known = options(words[:2])
    given = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", " ".join(words[2:])))  # "[--output-lengths]" too
    assert given <= known, f"{_rel(page)}: evocache {line}: unknown {sorted(given - known)}"


def script_lines(page: Path) -> list[tuple[str, str]]:
    """(script, its arguments) of every ``[python ]bench/<script>.py ...`` the page gives, to the line's
    end."""
    text = page.read_text(encoding="utf-8").replace("\\\n", " ")
    return re.findall(r"(?<![\w/])(bench/\w+\.py)((?:[ \t]+[^\s`#;|)]+)*)", text)


SCRIPTS = sorted({(p, script, args.strip()) for p in PAGES for script, args in script_lines(p)},
                 key=lambda c: (_rel(c[0]), c[1], c[2]))


def test_the_scripts_are_found() -> None:
    found = {(_rel(p), s, a) for p, s, a in SCRIPTS}
    assert ("docs/eviction.md", "bench/learned_eviction.py", "--train-speed 200000") in found


@pytest.mark.parametrize(("page", "script", "args"), SCRIPTS,
                         ids=[f"{_rel(p)}: {s} {a[:40]}" for p, s, a in SCRIPTS])
def test_every_bench_script_takes_the_options_it_is_given(page: Path, script: str, args: str) -> None:
    source = (ROOT / script).read_text(encoding="utf-8")
    known = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source))
    given = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", args))
    assert given <= known, f"{_rel(page)}: python {script} {args}: unknown {sorted(given - known)}"


def test_every_make_target_named_exists() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    named: set[str] = set()
    for page in PAGES:
        named |= set(re.findall(r"`make ([a-z][a-z-]*)", page.read_text(encoding="utf-8")))
        for block in blocks(page, "sh"):
            named |= set(re.findall(r"^make ([a-z][a-z-]*)", block, re.MULTILINE))
    assert named, "no make target found"
    assert named <= targets, sorted(named - targets)


def test_every_test_a_page_names_exists() -> None:
    """``tests/test_x.py::test_y`` and bare ``test_y`` names on the pages are tests of the suite."""
    defined = {
        (_rel(path), name)
        for path in (ROOT / "tests").glob("test_*.py")
        for name in re.findall(r"^(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.M)
    }
    names = {name for _, name in defined}
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path, name in re.findall(r"(tests/test_\w+\.py)::(test_\w+)", text):
            if (path, name) not in defined:
                missing.append(f"{_rel(page)}: {path}::{name}")
        for name in re.findall(r"`(test_\w+)`", text):
            if name not in names:
                missing.append(f"{_rel(page)}: {name}")
    assert not missing, missing


def test_every_repository_path_a_page_names_exists() -> None:
    """Files and folders the pages name (``examples/policies/demo.yaml``, ``controller/replay/_queue.py``) are
    in the repository; the planned rooms (``serving/``, ``agents/``) may name what they will hold."""
    pattern = re.compile(r"(?<![\w./])((?:examples|bench|controller|dsl|cli|tests|docs)/[\w./-]*[\w/])")
    missing = []
    for page in PAGES:
        for path in set(pattern.findall(page.read_text(encoding="utf-8"))):
            if "*" not in path and not (ROOT / path).exists():
                missing.append(f"{_rel(page)}: {path}")
    assert not missing, missing


def _loop_graph_table() -> set[tuple[str, str]]:
    """The ``| from | to | when |`` rows of docs/agents.md's section "The graph"."""
    text = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    section = text.split("\n## The graph\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (\w+) \| .+ \|$", section, re.MULTILINE)
    return {(a, b) for a, b in rows if (a, b) != ("from", "to")}


def test_the_loop_graph_is_drawn_as_the_code_builds_it() -> None:
    from langgraph.checkpoint.memory import InMemorySaver

    from evocache.agents._loop import build_graph

    names = {"__start__": "START", "__end__": "END"}
    graph = build_graph(None, InMemorySaver()).get_graph()  # type: ignore[arg-type]  # no node runs
    built = {(names.get(e.source, e.source), names.get(e.target, e.target)) for e in graph.edges}
    assert len(built) == 19
    assert _loop_graph_table() == built
    drawing = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8").split("\n## The graph\n", 1)[1]
    drawn = set(re.findall(r"\b([a-z]+)\b", drawing.split("```")[1]))
    assert {n for n in graph.nodes if not n.startswith("__")} <= drawn  # every node is in the drawing


def _section(page: str, marker: str) -> str:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert marker in text, f"docs/{page}: {marker!r} not found"
    return text.split(marker, 1)[1]


def test_every_event_outcome_and_field_is_documented() -> None:
    from evocache.controller import EVENT_OUTCOMES, AccessEvent
    from evocache.controller._events import V1_OUTCOMES

    paragraph = _section("architecture.md", "- Access event, schema version 2 (").split("\n- ", 1)[0]
    named = set(re.findall(r"`([a-z-]+)`", paragraph)) | set(re.findall(r'"([a-z_]+)":', paragraph))
    assert [o for o in (*EVENT_OUTCOMES, *V1_OUTCOMES) if o not in named] == []
    assert [f for f in AccessEvent._fields if f not in named] == []


def test_every_tenant_field_is_in_the_tenants_table() -> None:
    from evocache.dsl import TenantSpec

    table = _section("policy-language.md", "A tenant's entry under `tenants:`").split("\n\n| field |", 1)[1]
    table = table.split("\n\n", 1)[0]
    named = {name for row in table.splitlines() for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    assert sorted(set(TenantSpec.model_fields) - named) == []


def _kv_reasons_in_code() -> set[str]:
    """Each miss reason the KV cache and the replica produce: the string literals assigned to ``usage.miss``,
    returned by ``DeviceBlocks.why`` or given to ``KvPlan(reason=...)``, in every module of serving/kv and the
    replica's."""
    import ast

    found: set[str] = set()
    for path in (*sorted((ROOT / "serving" / "kv").glob("*.py")), ROOT / "serving" / "_server.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "miss" for t in node.targets):
                found |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and c.value}
            elif isinstance(node, ast.FunctionDef) and node.name == "why":
                found |= {r.value.value for r in ast.walk(node)
                          if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)}
            elif isinstance(node, ast.keyword) and node.arg == "reason" and isinstance(node.value, ast.Constant):
                found.add(node.value.value)
    return {r for r in found if isinstance(r, str)}


def test_the_kv_miss_reasons_are_the_codes_and_documented_where_they_are_read() -> None:
    from evocache.serving.kv import MISS_REASONS

    assert _kv_reasons_in_code() == set(MISS_REASONS)
    kv_page = _section("kv.md", "## What each request reports")
    metrics_row = next(line for line in (ROOT / "docs" / "serving.md").read_text(encoding="utf-8").splitlines()
                       if "`evocache_kv_misses_total{reason}`" in line)
    for where, text in (("docs/kv.md", kv_page), ("docs/serving.md", metrics_row)):
        assert [r for r in MISS_REASONS if f"`{r}`" not in text] == [], where
