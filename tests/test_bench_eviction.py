"""`evocache bench eviction`, through typer's runner on the command's own app."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from evocache.controller.eviction import EVICTION_POLICIES
from evocache.controller.replay import CsvColumns, belady_unit, read_trace, replay, working_set
from evocache.controller.replay.commands import app
from typer.testing import CliRunner

TRACES = Path(__file__).resolve().parent / "data" / "traces"
KNOWN = ", ".join(sorted(EVICTION_POLICIES))

runner = CliRunner()

# Capacity 2 of 4 objects. By hand: LRU hits 3 (a b a b), LRU-2 4, Belady 6 (a b a c a b: it keeps c over b at
# the fifth access, b over c at the eighth, and never admits d).
KEYS = "a a b b c a c b d a b c"


def canonical(tmp_path: Path, keys: str = KEYS, sizes: dict[str, int] | None = None) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(
        json.dumps({"t": i, "key": k, "size": (sizes or {}).get(k, 1)}) + "\n" for i, k in enumerate(keys.split())
    ))
    return path


def bench(*args: str) -> object:
    return runner.invoke(app, ["eviction", *args])


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The table's body rows, policy -> the other cells, read off rich's box characters."""
    rows = {}
    for line in stdout.splitlines():
        if line[:1] in ("│", "┃"):  # body rows, and the heading row under the key "policy"
            cells = [cell.strip() for cell in line.replace("┃", "│").strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


def test_json_rows_are_exact(tmp_path: Path) -> None:
    trace, out = canonical(tmp_path), tmp_path / "out.json"
    result = bench("--trace", str(trace), "--sizes", "0.5", "--policies", "lru,lruk", "--unit", "objects",
                   "--json", str(out))
    assert (result.exit_code, result.stderr) == (0, "")
    row = {"size": 0.5, "capacity": 2, "prefix_hit_ratio": None}
    assert json.loads(out.read_text()) == {
        "trace": str(trace), "requests": 12, "objects": 4, "unit": "objects", "skipped": 0,
        "rows": [
            {"policy": "lru", **row, "hit_ratio": 3 / 12, "byte_hit_ratio": 3 / 12},
            {"policy": "lruk", **row, "hit_ratio": 4 / 12, "byte_hit_ratio": 4 / 12},
            {"policy": "belady", **row, "hit_ratio": 6 / 12, "byte_hit_ratio": 6 / 12},
        ],
    }


def test_every_row_is_what_replay_gives_and_belady_bounds_them(tmp_path: Path) -> None:
    keys = " ".join(f"k{(i * i + 3 * i) % 17 if i % 3 else i % 5}" for i in range(200))
    trace, out = canonical(tmp_path, keys), tmp_path / "out.json"
    names = sorted(EVICTION_POLICIES)
    result = bench("--trace", str(trace), "--sizes", "0.5,0.1,0.25", "--policies", ",".join(names),
                   "--unit", "objects", "--json", str(out))
    assert result.exit_code == 0
    rows = json.loads(out.read_text())["rows"]
    accesses = list(read_trace(trace))
    assert [(r["size"], r["policy"]) for r in rows] == [
        (size, name) for size in (0.1, 0.25, 0.5) for name in [*names, "belady"]
    ]
    for r in rows:
        if r["policy"] == "belady":
            expected = belady_unit(accesses, r["capacity"])
        else:
            expected = replay(accesses, r["policy"], fraction=r["size"], fraction_of="objects")
        assert (r["capacity"], r["hit_ratio"], r["byte_hit_ratio"]) == (
            expected.capacity, expected.hit_ratio, expected.byte_hit_ratio)
    for size in (0.1, 0.25, 0.5):
        ratios = {r["policy"]: r["hit_ratio"] for r in rows if r["size"] == size}
        assert all(ratios["belady"] >= ratio for ratio in ratios.values())
        assert ratios["belady"] > ratios["lru"]


def test_table_shows_hit_ratio_and_gap_closed(tmp_path: Path) -> None:
    result = bench("--trace", str(canonical(tmp_path)), "--sizes", "0.5", "--policies", "lru,lruk",
                   "--unit", "objects", "--json", str(tmp_path / "out.json"))
    lines = result.stdout.splitlines()
    assert lines[0] == "hit ratio by cache size (fraction of the working set's objects)"
    assert table_rows(result.stdout) == {
        "policy": ["50% hit", "50% gap"],
        "lru": ["0.250", ""],
        "lruk": ["0.333", "33.3%"],  # (4 - 3) / (6 - 3)
        "belady": ["0.500", ""],
    }
    assert lines[-2:] == ["capacity: 50% = 2 objects", "gap = (policy - LRU) / (Belady - LRU)"]
    assert "\x1b[" not in result.stdout


def test_lru_is_run_for_the_gap_when_not_requested(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench("--trace", str(canonical(tmp_path)), "--sizes", "0.5", "--policies", "lruk",
                   "--unit", "objects", "--json", str(out))
    assert table_rows(result.stdout)["lruk"] == ["0.333", "33.3%"]
    assert "lru" not in table_rows(result.stdout)
    assert result.stdout.splitlines()[-1] == "LRU was not requested: it was run only as the gap's baseline"
    assert [r["policy"] for r in json.loads(out.read_text())["rows"]] == ["lruk", "belady"]


def test_mooncake_defaults_to_objects_and_reports_prefix_hits(tmp_path: Path) -> None:
    # Blocks 0 1 2 | 0 3 | 4, capacity 2 of 5: LRU has evicted 0 by the second request; Belady keeps it.
    out = tmp_path / "out.json"
    result = bench("--trace", str(TRACES / "mooncake.jsonl"), "--sizes", "0.4", "--policies", "lru",
                   "--json", str(out))
    assert result.exit_code == 0
    report = json.loads(out.read_text())
    assert (report["unit"], report["requests"], report["objects"]) == ("objects", 6, 5)
    assert [(r["policy"], r["capacity"], r["hit_ratio"], r["prefix_hit_ratio"]) for r in report["rows"]] == [
        ("lru", 2, 0.0, 0.0), ("belady", 2, 1 / 6, 1 / 6)]
    assert table_rows(result.stdout) == {
        "policy": ["40% hit", "40% gap", "40% prefix"],
        "lru": ["0.000", "", "0.000"],
        "belady": ["0.167", "", "0.167"],
    }


def test_output_lengths_are_opt_in_and_labelled(tmp_path: Path) -> None:
    """--output-lengths hands policies the trace's output_length, which a server knows at completion: the JSON
    and the table say so; without it nothing is marked."""
    out = tmp_path / "out.json"
    plain = bench("--trace", str(TRACES / "mooncake.jsonl"), "--sizes", "0.4", "--policies", "lru", "--json", str(out))
    assert plain.exit_code == 0 and "output_lengths" not in json.loads(out.read_text())
    assert "--output-lengths" not in plain.stdout
    told = bench("--trace", str(TRACES / "mooncake.jsonl"), "--sizes", "0.4", "--policies", "lru", "--output-lengths",
                 "--json", str(out))
    assert told.exit_code == 0 and json.loads(out.read_text())["output_lengths"] is True
    assert "classifies its blocks then" in " ".join(told.stdout.split())


def test_other_traces_default_to_bytes_with_the_size_heuristic(tmp_path: Path) -> None:
    # a (10 bytes) b (1) a b c (5): 16 bytes of objects, 27 requested; at half, 8 bytes: a never fits.
    trace, out = canonical(tmp_path, "a b a b c", {"a": 10, "b": 1, "c": 5}), tmp_path / "out.json"
    result = bench("--trace", str(trace), "--sizes", "0.5", "--policies", "lru", "--json", str(out))
    assert result.exit_code == 0
    report = json.loads(out.read_text())
    assert report["unit"] == "bytes"
    assert [(r["policy"], r["capacity"], r["hit_ratio"], r["byte_hit_ratio"]) for r in report["rows"]] == [
        ("lru", 8, 1 / 5, 1 / 27), ("belady-size (heuristic)", 8, 1 / 5, 1 / 27)]
    assert "belady-size is a heuristic, not a bound: a policy may beat it" in result.stdout.splitlines()
    assert "prefix" not in result.stdout


def test_unknown_policy_fails_at_once_listing_the_known_ones(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench("--trace", str(tmp_path / "never-read.jsonl"), "--policies", "lru,nosuch", "--json", str(out))
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --policies: unknown eviction policy 'nosuch'; known: {KNOWN} (belady always runs)\n")
    assert not out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "0.1,0"], "error: --sizes: 0 is not a fraction in (0, 1]"),
    (["--sizes", "1%"], "error: --sizes: '1%' is not a number"),
    (["--csv-columns", "key=lbn"], ("error: --csv-columns: expected ROLE=COLUMN with ROLE one of "
                                    "time, id, size, ns, got 'key=lbn'")),
])
def test_bad_options_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = bench("--trace", str(canonical(tmp_path)), "--json", str(tmp_path / "out.json"), *args)
    assert (result.exit_code, result.stderr) == (2, message + "\n")


@pytest.mark.parametrize(("args", "message"), [
    (["--unit", "blocks"], "Invalid value for '--unit': Value error, 'blocks' is not one of 'objects', 'bytes'."),
    (["--format", "parquet"], "Invalid value for '--format': Value error, 'parquet' is not one of 'auto', "
                              "'events', 'canonical', 'mooncake', 'csv'."),
])
def test_a_choice_outside_its_list_exits_2_naming_the_choices(tmp_path: Path, args: list[str], message: str) -> None:
    result = bench("--trace", str(canonical(tmp_path)), *args)
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())


def test_the_choices_are_the_readers_and_the_registry() -> None:
    from evocache.controller.replay import FORMATS
    from evocache.controller.replay.commands import TraceFormat, Unit

    assert [f.value for f in TraceFormat] == list(FORMATS)
    assert [u.value for u in Unit] == ["objects", "bytes"]
    result = runner.invoke(app, ["eviction", "--help"], env={"COLUMNS": "400"})
    help_text = " ".join(result.stdout.replace("│", " ").split())
    assert f"Eviction policies to replay, comma-separated: {KNOWN};" in help_text
    assert "<auto|events|canonical|mooncake|csv>" in help_text and "<objects|bytes>" in help_text


def test_without_json_it_prints_the_table_and_writes_nothing(tmp_path: Path) -> None:
    trace = canonical(tmp_path)
    result = bench("--trace", str(trace), "--sizes", "0.5", "--policies", "lru,lruk", "--unit", "objects")
    assert (result.exit_code, result.stderr) == (0, "")
    rows = table_rows(result.stdout)
    assert rows["lru"] == ["0.250", ""] and rows["lruk"][0] == "0.333" and rows["belady"][0] == "0.500"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]


def test_malformed_trace_exits_1_naming_file_and_line(tmp_path: Path) -> None:
    path, out = TRACES / "mooncake_bad.jsonl", tmp_path / "out.json"
    result = bench("--trace", str(path), "--json", str(out))
    assert result.exit_code == 1
    assert result.stderr == f"{path}:2: field 'hash_ids' must be a string or an int, got 1.5\n"
    assert (result.stdout, out.exists()) == ("", False)


def test_skip_bad_skips_and_counts(tmp_path: Path) -> None:
    path, out = TRACES / "canonical_bad.jsonl", tmp_path / "out.json"
    result = bench("--trace", str(path), "--skip-bad", "--sizes", "1", "--policies", "lru", "--json", str(out))
    assert result.exit_code == 0
    assert result.stderr == f"skipped 6 malformed line(s) of {path}\n"
    report = json.loads(out.read_text())
    assert (report["skipped"], report["requests"]) == (6, len(list(read_trace(path, skip_bad=True))))


def test_missing_trace_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = bench("--trace", str(missing), "--json", str(tmp_path / "out.json"))
    assert (result.exit_code, result.stderr) == (2, f"error: {missing}: No such file or directory\n")


def test_empty_trace_exits_1(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = bench("--trace", str(empty), "--json", str(tmp_path / "out.json"))
    assert (result.exit_code, result.stderr) == (1, f"error: {empty}: the trace has no accesses\n")


def test_csv_columns_map_a_block_trace(tmp_path: Path) -> None:
    path, out = TRACES / "blocks.csv", tmp_path / "out.json"
    result = bench("--trace", str(path), "--csv-columns", "id=lbn", "--sizes", "1", "--policies", "lru",
                   "--json", str(out))
    assert result.exit_code == 0
    report = json.loads(out.read_text())
    accesses = list(read_trace(path, csv_columns=CsvColumns(id="lbn")))
    ws = working_set(accesses)
    assert (report["unit"], report["requests"], report["objects"]) == ("bytes", len(accesses), ws.objects)
    assert report["rows"][0]["capacity"] == ws.bytes == math.floor(1 * ws.bytes)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "hits.png"
    result = bench("--trace", str(canonical(tmp_path)), "--sizes", "0.25,0.5", "--json", str(tmp_path / "o.json"),
                   "--plot", str(plot))
    assert result.exit_code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_before_replaying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib.figure now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = tmp_path / "out.json"
    result = bench("--trace", str(canonical(tmp_path)), "--json", str(out), "--plot", str(tmp_path / "p.png"))
    assert (result.exit_code, result.stderr) == (1, "error: --plot needs matplotlib: pip install 'evocache[bench]' "
                                                    "(in a source checkout: .venv/bin/pip install -e '.[bench]')\n")
    assert not out.exists()


def test_help_says_the_trace_is_held_in_memory() -> None:
    result = runner.invoke(app, ["eviction", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "The trace is read once into memory" in " ".join(result.stdout.split())


# -- bench/eviction.py: the figures, on a tiny trace ------------------------------------------------

BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "eviction.py"


def run_bench_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH_SCRIPT), "--trace", str(TRACES / "mooncake.jsonl"), "--sizes", "0.4,1",
         "--rounds", "1", "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_bench_script_prints_every_figure_and_writes_its_json(tmp_path: Path) -> None:
    done = run_bench_script(tmp_path, "--cloudphysics", str(TRACES / "blocks.csv"))
    assert done.returncode == 0, done.stderr
    headings = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert headings == [
        "== (a) policy x size on mooncake.jsonl",
        "== (b) learned against LRU on blocks.csv",
        "== (c) LRU replay throughput (6 accesses, capacity 1 objects)",
        "== (d) per-request cost through the L1 MemoryTier (5% of the objects)",
        "== (e) queue look-ahead on mooncake.jsonl",
    ]
    table = json.loads((tmp_path / "mooncake.json").read_text())
    names = [r["policy"] for r in table["rows"] if r["size"] == 1]
    published = [n for n in EVICTION_POLICIES if n != "learned-rank"]  # the script's table leaves it out
    assert names[:len(published)] == published and names[-1] == "belady"
    speed = json.loads((tmp_path / "throughput.json").read_text())
    assert (speed["accesses"], speed["capacity_objects"], speed["rounds"]) == (6, 1, 1)
    assert speed["ratio"] == speed["replay_s"] / speed["baseline_s"]
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert list(cost["policies"]) == ["lru", *(n for n in published if n != "lru")]
    assert cost["policies"]["lru"]["policy_ratio"] == 1.0
    # Blocks 0 1 2 | 0 3 | 4 through a one-entry L1: nothing is ever hit, whatever the policy.
    assert {row["hit_ratio"] for row in cost["policies"].values()} == {0.0}
    if "learned" in EVICTION_POLICIES:
        assert json.loads((tmp_path / "cloudphysics.json").read_text())["rows"][0]["policy"] == "lru"
        told = json.loads((tmp_path / "mooncake_output_lengths.json").read_text())
        assert told["output_lengths"] is True and {r["policy"] for r in told["rows"]} == {"lru", "learned", "belady"}


@pytest.mark.slow
def test_bench_script_skips_cloudphysics_when_absent(tmp_path: Path) -> None:
    missing = tmp_path / "cloudPhysicsIO.csv"
    done = run_bench_script(tmp_path, "--cloudphysics", str(missing), "--parts", "b")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "", "== (b) learned against LRU on cloudPhysicsIO.csv",
        f"skipped: {missing} is not here (GPL-3.0 data: read from ../shared, never copied)"]
    assert list(tmp_path.iterdir()) == []  # --out is tmp_path: the skipped part wrote nothing


@pytest.mark.slow
def test_bench_script_refuses_unknown_parts(tmp_path: Path) -> None:
    done = run_bench_script(tmp_path, "--parts", "ax")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "eviction.py: error: --parts: expected letters of abcde, got 'ax'"


# -- outputs and trace-bound options are refused before any replay -------------------------------------------


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_in_a_missing_directory_fails_before_reading_the_trace(tmp_path: Path, option: str) -> None:
    bad = tmp_path / "nonexistent" / "out"
    paths = {"--json": str(tmp_path / "o.json"), "--plot": str(tmp_path / "p.png"), option: str(bad)}
    result = bench("--trace", str(tmp_path / "never-read.jsonl"), "--json", paths["--json"], "--plot", paths["--plot"])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"error: {option}: {bad}: the directory {bad.parent} does not exist\n"
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_is_a_directory_fails_before_reading_the_trace(tmp_path: Path) -> None:
    result = bench("--trace", str(tmp_path / "never-read.jsonl"), "--json", str(tmp_path))
    assert (result.exit_code, result.stderr) == (2, f"error: --json: {tmp_path}: is a directory\n")


def test_output_lengths_on_a_trace_without_them_is_a_usage_error(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench("--trace", str(canonical(tmp_path)), "--output-lengths", "--json", str(out))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == ("error: --output-lengths: output lengths come with a KV-block (Mooncake) trace; "
                             "this one has none\n")
    assert not out.exists()


def test_a_csv_without_sizes_is_told_the_option_spelling(tmp_path: Path) -> None:
    path = tmp_path / "nosize.csv"
    path.write_text("ts,obj\n1,a\n2,b\n")
    result = bench("--trace", str(path), "--csv-columns", "time=ts,id=obj", "--json", str(tmp_path / "o.json"))
    assert result.exit_code == 1
    assert result.stderr == (f"{path}:1: header ['ts', 'obj'] lacks the mapped column(s) size='size' "
                             "(--csv-columns size= for a trace without sizes)\n")
    out = tmp_path / "o.json"
    told = bench("--trace", str(path), "--csv-columns", "time=ts,id=obj,size=", "--sizes", "1", "--json", str(out))
    assert told.exit_code == 0, told.stderr
    assert json.loads(out.read_text())["requests"] == 2


def help_text() -> str:
    """``eviction --help`` as one line of words: rich wraps the options' help inside a box."""
    result = runner.invoke(app, ["eviction", "--help"])
    assert result.exit_code == 0
    return " ".join(result.stdout.replace("│", " ").split())


def test_csv_columns_help_spells_the_no_size_mapping() -> None:
    assert "size= (empty) for a trace without sizes" in help_text()
