"""bench/eviction_ceiling.py on a prefix of the Mooncake trace: its figures' structure, and the figures that can
be computed another way computed so."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from evocache.controller.eviction import LearnedTraining, make_eviction_policy
from evocache.controller.eviction._features import FEATURES
from evocache.controller.replay import belady_unit, read_trace, replay

pytestmark = pytest.mark.slow  # every test runs bench/eviction_ceiling.py's main (most share one run)

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "bench" / "data" / "mooncake_synthetic_trace.jsonl"
REQUESTS = 300  # 7,721 block accesses, 7,352 distinct blocks
SIZES = (0.05, 0.1)
SLICE = 3000
RETRAIN = 1000


def _script() -> ModuleType:
    path = ROOT / "bench" / "eviction_ceiling.py"
    spec = importlib.util.spec_from_file_location("bench_eviction_ceiling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    tmp = tmp_path_factory.mktemp("ceiling")
    prefix = tmp / "prefix.jsonl"
    with TRACE.open(encoding="utf-8") as f:
        prefix.write_text("".join(next(f) for _ in range(REQUESTS)), encoding="utf-8")
    out = tmp / "out.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = _script().main(["--trace", str(prefix), "--sizes", ",".join(map(str, SIZES)), "--slices-at", "0.05",
                               "--slice", str(SLICE), "--retrain-every", str(RETRAIN), "--json", str(out)])
    assert code == 0
    return prefix, json.loads(out.read_text(encoding="utf-8")), printed.getvalue()


def test_the_document_has_every_part(ran: tuple[Path, dict, str]) -> None:
    prefix, doc, _ = ran
    assert set(doc) == {"trace", "accesses", "objects", "output_lengths", "sizes", "slices", "documents",
                        "second_access_distance", "new_blocks"}
    assert (doc["trace"], doc["accesses"], doc["objects"], doc["output_lengths"]) == (str(prefix), 7721, 7352, False)
    assert [row["size"] for row in doc["sizes"]] == list(SIZES)
    for row in doc["sizes"]:
        assert set(row) == {"size", "capacity", "lru", "belady", "learned", "oracle", "learned_gap", "oracle_gap",
                            "model_auc"}
        assert all(0 <= a <= 1 for a in row["model_auc"])
    assert set(doc["documents"]) == {"documents", "documents_with_4_requests", "median_gap_cv",
                                     "head_requests_quartiles"}
    assert doc["documents"]["documents"] == 287
    assert len(doc["documents"]["head_requests_quartiles"]) == 3
    assert set(doc["new_blocks"]) == {"by_output_length", "short_answer_by_new_part"}


def test_the_reference_rows_and_the_watched_learned_policy_are_the_replays(ran: tuple[Path, dict, str]) -> None:
    prefix, doc, _ = ran
    trace = list(read_trace(prefix))
    for row in doc["sizes"]:
        capacity = int(row["size"] * doc["objects"])
        learned = replay(trace, lambda **kw: make_eviction_policy(
            "learned", capacity=capacity, training=LearnedTraining(retrain_every=RETRAIN), **kw),
            capacity_objects=capacity).hit_ratio
        lru = replay(trace, "lru", capacity_objects=capacity).hit_ratio
        best = belady_unit(trace, capacity).hit_ratio
        assert (row["capacity"], row["lru"], row["belady"], row["learned"]) == (capacity, lru, best, learned)
        assert row["oracle_gap"] == pytest.approx((row["oracle"] - lru) / (best - lru))


def test_the_slices_count_reuse_within_twice_the_blocks_held(ran: tuple[Path, dict, str]) -> None:
    """With unit sizes and every miss admitted, a policy holds min(distinct blocks so far, capacity) blocks
    when an access arrives, whichever policy it is: the label needs no replay."""
    prefix, doc, _ = ran
    keys = [a.key for a in read_trace(prefix)]
    capacity = int(0.05 * doc["objects"])
    nxt, last = [math.inf] * len(keys), {}
    for i, k in enumerate(keys):
        if k in last:
            nxt[last[k]] = i
        last[k] = i
    seen: set[str] = set()
    reused = []
    for i, k in enumerate(keys):
        horizon = 2 * max(min(len(seen), capacity), 1)
        reused.append(nxt[i] - i <= horizon)
        seen.add(k)
    sliced = doc["slices"]
    assert (sliced["size"], sliced["slice"]) == (0.05, SLICE)
    # 7,721 accesses: two full slices, and the remainder (1,721 >= half a slice) as a third.
    assert [(r["start"], r["end"]) for r in sliced["rows"]] == [(0, 3000), (3000, 6000), (6000, 7721)]
    for r in sliced["rows"]:
        assert set(r) == {"start", "end", "reuse", "auc", "best", "head", "rate"}
        assert r["reuse"] == pytest.approx(sum(reused[r["start"]:r["end"]]) / (r["end"] - r["start"]))
        assert list(r["auc"]) == list(FEATURES)
        assert all(a is None or 0 <= a <= 1 for a in r["auc"].values())
        # Every access is a block's access right after it was recorded: its age is 0, a constant.
        assert r["auc"]["age"] is None


def test_the_new_block_tables_count_every_first_access(ran: tuple[Path, dict, str]) -> None:
    prefix, doc, _ = ran
    trace = list(read_trace(prefix, output_lengths=True))
    seen: set[str] = set()
    short = 0
    for a in trace:
        if a.key not in seen:
            seen.add(a.key)
            short += a.req_out < 60
    tables = doc["new_blocks"]
    assert sum(r["blocks"] for r in tables["by_output_length"]) == len(seen)
    assert [(r["low"], r["high"]) for r in tables["by_output_length"]] == [
        (0, 20), (20, 40), (40, 60), (60, 200), (200, None)]
    assert [(r["low"], r["high"]) for r in tables["short_answer_by_new_part"]] == [
        (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, None)]
    assert sum(r["blocks"] for r in tables["short_answer_by_new_part"]) == short


def test_the_printed_report(ran: tuple[Path, dict, str]) -> None:
    _, doc, printed = ran
    lines = printed.splitlines()
    assert [line.split(" (")[0] for line in lines[:2]] == ["size 0.05", "size 0.1"]
    assert lines[2].startswith("7721 accesses, 7352 distinct blocks; median distance")
    table = [line.split(" | ")[0].strip("| ") for line in lines if line.startswith("| ")]
    assert table == ["feature", "reuse", *FEATURES, "head", "rate", "best single feature, either direction"]
    assert "new blocks ever accessed again, by output length" in lines


def test_a_slice_size_that_is_not_replayed_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _script().main(["--sizes", "0.01", "--slices-at", "0.05"])
    assert exit_info.value.code == 2
    assert "--slices-at 0.05 must be one of --sizes 0.01" in capsys.readouterr().err
