"""`evocache bench eviction --peers`: libCacheSim's algorithms on the accesses our replay sees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from evocache.controller.replay import Access, read_trace, replay
from evocache.controller.replay._peers import PEERS, encode
from evocache.controller.replay.commands import app
from typer.testing import CliRunner

TRACES = Path(__file__).resolve().parent / "data" / "traces"
ROW_KEYS = {"policy", "size", "capacity", "hit_ratio", "byte_hit_ratio", "prefix_hit_ratio"}
PEER_ROWS = ["lcs:LRU", "lcs:ARC", "lcs:S3-FIFO", "lcs:SIEVE", "lcs:LeCaR", "lcs:Cacheus", "lcs:WTinyLFU",
             "lcs:GLCache", "lcs:LRB"]

runner = CliRunner()


def mixed_trace(n: int = 3000) -> list[Access]:
    """Two tenants sharing key names (distinct objects all the same), sizes 1..7, a skewed reuse pattern."""
    trace = []
    for i in range(n):
        key = f"k{(i * i + 7 * i) % 97 if i % 4 else i % 211}"
        ns = "a" if i % 3 else "b"
        trace.append(Access(t=i / 10, key=key, size=1 + (i * 31 + len(key)) % 7, ns=ns))
    return trace


def write_canonical(path: Path, trace: list[Access]) -> Path:
    path.write_text("".join(json.dumps({"t": a.t, "key": a.key, "size": a.size, "ns": a.ns}) + "\n"
                            for a in trace))
    return path


def test_encode_numbers_objects_by_first_access_and_keeps_tenants_apart() -> None:
    trace = [Access(0.9, "x", 5, "a"), Access(1.5, "x", 6, "b"), Access(2.0, "x", 7, "a"), Access(3.2, "y", 1)]
    objects = encode(trace, "objects")
    assert (objects.obj_ids, objects.sizes, objects.times) == ([1, 2, 1, 3], [1, 1, 1, 1], [0, 1, 2, 3])
    assert encode(trace, "bytes").sizes == [5, 6, 7, 1]


# -- with libcachesim installed ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lcs():  # noqa: ANN201 - the libcachesim module
    return pytest.importorskip("libcachesim")


@pytest.mark.parametrize("unit", ["objects", "bytes"])
@pytest.mark.parametrize("capacity", [1, 2, 17, 60, 250])
def test_lcs_lru_hits_exactly_what_our_lru_hits(lcs, unit: str, capacity: int) -> None:  # noqa: ANN001
    from evocache.controller.replay._peers import replay_peer

    trace = mixed_trace()
    ours = replay(trace, "lru", **{f"capacity_{unit}": capacity})
    theirs = replay_peer(lcs, "LRU", encode(trace, unit), capacity)
    assert theirs.policy == "lcs:LRU"
    assert 0 < ours.hits < ours.requests or capacity == 1
    assert (theirs.capacity, theirs.capacity_unit) == (capacity, unit)
    assert (theirs.hits, theirs.bytes_hit, theirs.per_ns) == (ours.hits, ours.bytes_hit, ours.per_ns)


def test_lcs_lru_matches_prefix_hits_on_a_mooncake_trace(lcs) -> None:  # noqa: ANN001
    from evocache.controller.replay._peers import replay_peer

    trace = list(read_trace(TRACES / "mooncake.jsonl"))
    for capacity in (1, 2, 3, 5):
        ours = replay(trace, "lru", capacity_objects=capacity)
        theirs = replay_peer(lcs, "LRU", encode(trace, "objects"), capacity)
        assert (theirs.hits, theirs.prefix_hits) == (ours.hits, ours.prefix_hits)


def test_a_capacity_where_libcachesim_would_abort_is_refused(lcs) -> None:  # noqa: ANN001
    from evocache.controller.replay._peers import replay_peer

    with pytest.raises(ValueError, match="lcs:S3-FIFO needs a capacity of at least 10, got 9"):
        replay_peer(lcs, "S3-FIFO", encode(mixed_trace(10), "objects"), 9)


def test_peers_add_named_rows_with_the_issue_schema(lcs, tmp_path: Path) -> None:  # noqa: ANN001
    trace = mixed_trace()
    path, out = write_canonical(tmp_path / "t.jsonl", trace), tmp_path / "out.json"
    result = runner.invoke(app, ["eviction", "--trace", str(path), "--sizes", "0.1,0.3", "--policies", "lru,lfu",
                                 "--unit", "objects", "--peers", "--json", str(out)])
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["size"], r["policy"]) for r in rows] == [
        (size, name) for size in (0.1, 0.3) for name in ["lru", "lfu", *PEER_ROWS, "belady"]]
    assert all(set(r) == ROW_KEYS for r in rows)
    for size in (0.1, 0.3):
        by_name = {r["policy"]: r for r in rows if r["size"] == size}
        assert by_name["lcs:LRU"]["hit_ratio"] == by_name["lru"]["hit_ratio"]
        assert by_name["lcs:LRU"]["capacity"] == by_name["lru"]["capacity"]
        # Belady is the exact optimum for unit sizes: no peer may beat it.
        assert all(r["hit_ratio"] <= by_name["belady"]["hit_ratio"] for r in by_name.values())
    stdout_rows = [line.split("│")[1].strip() for line in result.stdout.splitlines() if line.startswith("│")]
    assert stdout_rows == ["lru", "lfu", *PEER_ROWS, "belady"]
    assert "lcs:* rows: libCacheSim 0.3.5 with its default parameters" in result.stdout
    assert "lcs:LeCaR and lcs:Cacheus use libCacheSim's own unseeded random generator" in result.stdout


def test_peers_too_small_to_build_are_left_out_with_a_note(lcs, tmp_path: Path) -> None:  # noqa: ANN001
    # 211 + 97 keys in two tenants; 2 % is 6 objects: S3-FIFO needs 10, W-TinyLFU 5.
    path, out = write_canonical(tmp_path / "t.jsonl", mixed_trace()), tmp_path / "out.json"
    result = runner.invoke(app, ["eviction", "--trace", str(path), "--sizes", "0.01,0.5", "--policies", "lru",
                                 "--unit", "objects", "--peers", "--json", str(out)])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["capacity"] for r in rows if r["size"] == 0.01} == {4}
    assert [r["policy"] for r in rows if r["size"] == 0.01] == [
        "lru", *(name for name in PEER_ROWS if name not in ("lcs:S3-FIFO", "lcs:WTinyLFU")), "belady"]
    lines = result.stdout.splitlines()
    assert "lcs:S3-FIFO not run: libCacheSim aborts below a capacity of 10, and the smallest here is 4" in lines
    assert "lcs:WTinyLFU not run: libCacheSim aborts below a capacity of 5, and the smallest here is 4" in lines


def test_lrb_equal_to_lru_is_explained(lcs, tmp_path: Path) -> None:  # noqa: ANN001
    path, out = write_canonical(tmp_path / "t.jsonl", mixed_trace()), tmp_path / "out.json"
    result = runner.invoke(app, ["eviction", "--trace", str(path), "--sizes", "0.2", "--policies", "lru",
                                 "--peers", "--json", str(out)])
    assert result.exit_code == 0, result.stderr
    assert ("lcs:LRB equals lcs:LRU here: libCacheSim's LRB trains only after 131,072 labelled samples, and "
            "this trace has 3,000 accesses") in result.stdout.splitlines()


# -- without libcachesim -----------------------------------------------------------------------------------

def test_missing_libcachesim_says_how_to_install_it_before_reading_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "libcachesim", None)  # `import libcachesim` now raises ImportError
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["eviction", "--trace", str(tmp_path / "never-read.jsonl"), "--peers",
                                 "--json", str(out)])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == ("error: --peers needs libCacheSim's Python package (GPL-3.0, a benchmark extra): "
                             "pip install 'evocache[peers]' "
                             "(in a source checkout: .venv/bin/pip install -e '.[peers]')\n")
    assert not out.exists()


def test_libcachesim_is_imported_only_by_the_peers_path(tmp_path: Path) -> None:
    # A fresh interpreter: this one may have imported libcachesim in the tests above.
    path = write_canonical(tmp_path / "t.jsonl", mixed_trace(50))
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "import evocache.cli.app, evocache.controller.replay._peers\n"
        "from evocache.controller.replay.commands import app\n"
        f"r = CliRunner().invoke(app, ['eviction', '--trace', {str(path)!r}, '--json', {str(tmp_path / 'o.json')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('libcachesim' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "False\n"


def test_every_peer_of_the_issue_is_registered() -> None:
    assert ["lcs:" + name for name in PEERS] == PEER_ROWS


def test_help_names_the_extra_that_brings_libcachesim() -> None:
    result = runner.invoke(app, ["eviction", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.stdout.replace("│", " ").split())  # the option's help, out of rich's box
    assert "(needs libcachesim, GPL-3.0: evocache's 'peers' extra)" in text
