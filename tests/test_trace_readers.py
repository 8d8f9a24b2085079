"""Trace readers: every format on small fixtures with exact accesses, exact error positions, streaming."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from evocache.controller.errors import ControllerError
from evocache.controller import _calls
from evocache.controller.replay._access import Access
from evocache.controller.replay._readers import FORMATS, CsvColumns, ReadStats, TraceError, read_trace
from hypothesis import given, settings
from hypothesis import strategies as st

DATA = Path(__file__).parent / "data" / "traces"
MOONCAKE = Path(__file__).resolve().parents[1] / "bench" / "data" / "mooncake_synthetic_trace.jsonl"  # shipped, with provenance


def fixture(name: str) -> str:
    return str(DATA / name)


class CountingText(io.TextIOBase):
    """A text stream over ``lines`` (any iterator) that counts the lines handed out."""

    def __init__(self, lines: Iterator[str]) -> None:
        self._lines = lines
        self.lines_read = 0

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        line = next(self._lines, "")
        if line:
            self.lines_read += 1
        return line


# -- each format, exact accesses ----------------------------------------------------------------------------

def test_canonical() -> None:
    stats = ReadStats()
    assert list(read_trace(fixture("canonical.jsonl"), "canonical", stats=stats)) == [
        Access(0.5, "a", 10),
        Access(1.0, "42", 3, "tenant-a"),
        Access(2.25, "a", 10),
    ]
    assert stats == ReadStats(lines=4, accesses=3, skipped=0)


def test_events_hits_and_sized_misses_in_trace_order() -> None:
    stats = ReadStats()
    assert list(read_trace(fixture("events.jsonl"), "events", stats=stats)) == [
        Access(10.0, "k1", 120, "t-a", "r1"),  # sized by the store two lines later, still first
        Access(10.1, "k2", 7, "t-a", "r1"),
        Access(10.4, "k1", 120, "t-a", "r1"),
        Access(10.5, "big", 9000, "t-b", "r2"),  # sized by its reject
        Access(10.7, "lost", 0, "t-b", "r2"),  # never stored: size 0
        Access(10.8, "k2", 7, "t-a", "r1"),
    ]
    assert stats == ReadStats(lines=10, accesses=6, skipped=0)


def _event(t: float, key: str, outcome: str, size: int = 0, ns: str = "") -> str:
    return json.dumps({"t": t, "key": key, "ns": ns, "rule": "r", "outcome": outcome, "size": size}) + "\n"


def test_events_concurrent_misses_take_their_stores_in_order() -> None:
    lines = [
        _event(1, "x", "miss"), _event(2, "x", "miss"), _event(3, "x", "miss", ns="other"),
        _event(4, "x", "store", 10), _event(5, "y", "store", 99), _event(6, "x", "store", 20),
        _event(7, "x", "store", 30, ns="other"), _event(8, "x", "store", 40),
    ]
    assert list(read_trace(io.StringIO("".join(lines)), "events")) == [
        Access(1.0, "x", 10, "", "r"), Access(2.0, "x", 20, "", "r"), Access(3.0, "x", 30, "other", "r"),
    ]


def test_events_miss_waits_no_longer_than_the_lookahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_calls, "MISS_LOOKAHEAD", 2)
    lines = [_event(1, "a", "miss"), _event(2, "b", "hit", 3), _event(3, "c", "hit", 4),
             _event(4, "d", "hit", 5), _event(5, "a", "store", 8)]
    assert list(read_trace(io.StringIO("".join(lines)), "events")) == [
        Access(1.0, "a", 0, "", "r"), Access(2.0, "b", 3, "", "r"), Access(3.0, "c", 4, "", "r"),
        Access(4.0, "d", 5, "", "r"),
    ]


def test_mooncake_one_access_per_block() -> None:
    stats = ReadStats()
    got = list(read_trace(fixture("mooncake.jsonl"), "mooncake", stats=stats, block_tokens=16, bytes_per_token=2))
    assert got == [
        Access(0.0, "0", 32, req=0, pos=0), Access(0.0, "1", 32, req=0, pos=1), Access(0.0, "2", 32, req=0, pos=2),
        Access(1.5, "0", 32, req=1, pos=0), Access(1.5, "3", 32, req=1, pos=1),
        Access(2.75, "4", 32, req=2, pos=0),
    ]
    assert stats == ReadStats(lines=4, accesses=6, skipped=0)


def test_mooncake_output_length_only_when_asked(tmp_path) -> None:
    """``output_length`` is what a request generated, known at its completion: it becomes ``req_out`` only with
    ``output_lengths`` (-1 otherwise, and without one); a present one that is not an int >= 0 is a bad line
    either way, named with its file and line."""
    assert [a.req_out for a in read_trace(fixture("mooncake.jsonl"), "mooncake", output_lengths=True)] == [
        6, 6, 6, 4, 4, 1]
    assert {a.req_out for a in read_trace(fixture("mooncake.jsonl"), "mooncake")} == {-1}
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "output_length": 2.5, "hash_ids": [2]}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field .output_length. must be an int >= 0, got 2.5"):
        list(read_trace(path, "mooncake"))
    got = list(read_trace(path, "mooncake", skip_bad=True, output_lengths=True))
    assert [(a.key, a.req_out) for a in got] == [("1", -1)]


def test_mooncake_default_block_size_is_512_tokens() -> None:
    assert {a.size for a in read_trace(fixture("mooncake.jsonl"), "mooncake")} == {512}


def test_csv_with_a_mapping() -> None:
    stats = ReadStats()
    got = list(read_trace(fixture("blocks.csv"), "csv", stats=stats, csv_columns=CsvColumns(id="lbn")))
    assert got == [Access(5633898.0, "42932745", 512), Access(5633898.0, "42932746", 512),
                   Access(5634000.0, "40409911", 6656)]
    assert stats == ReadStats(lines=5, accesses=3, skipped=0)


def test_csv_without_sizes_namespaces_and_time_scale() -> None:
    columns = CsvColumns(time="ts", id="obj", size=None, ns="tenant")
    assert list(read_trace(fixture("tenants.csv"), "csv", csv_columns=columns, time_scale=0.5)) == [
        Access(50.0, "a", 1, "t1"), Access(100.0, "b", 1, "t2"), Access(150.0, "a", 1, "t1"),
    ]


def test_csv_header_lacking_a_mapped_column() -> None:
    with pytest.raises(TraceError) as info:
        list(read_trace(fixture("tenants.csv"), "csv", skip_bad=True))
    assert str(info.value) == (
        f"{fixture('tenants.csv')}:1: header ['ts', 'obj', 'tenant'] lacks the mapped column(s) time='time', "
        "id='id', size='size' (CsvColumns(size=None) for a trace without sizes)"
    )


def test_crlf_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"t": 1, "key": "a", "size": 2}\r\n\r\n{"t": 2, "key": "b", "size": 3}\r\n')
    assert list(read_trace(path)) == [Access(1.0, "a", 2), Access(2.0, "b", 3)]
    csv_path = tmp_path / "t.csv"
    csv_path.write_bytes(b"time,id,size\r\n1,a,2\r\n2,b,3\r\n")
    assert list(read_trace(csv_path)) == [Access(1.0, "a", 2), Access(2.0, "b", 3)]


# -- malformed lines ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "fmt", "message"), [
    ("canonical_bad.jsonl", "canonical", "2: invalid JSON: Expecting ',' delimiter at the end of the line"),
    ("events_bad.jsonl", "events",
     "2: field 'outcome' must be one of ['bypass', 'hit', 'kv', 'miss', 'reject', 'slo-closed', "
     "'slo-half-open', 'slo-open', 'store'], got 'evicted'"),
    ("mooncake_bad.jsonl", "mooncake", "2: field 'hash_ids' must be a string or an int, got 1.5"),
    ("blocks_bad.csv", "csv", "3: time column 'time' must be a number, got 'later'"),
])
def test_first_malformed_line_raises_with_its_position(name: str, fmt: str, message: str) -> None:
    got = read_trace(fixture(name), fmt, csv_columns=CsvColumns(id="lbn"))
    with pytest.raises(TraceError) as info:
        list(got)
    assert str(info.value) == f"{fixture(name)}:{message}"
    assert (info.value.file, info.value.line) == (fixture(name), int(message.split(":")[0]))
    assert isinstance(info.value, ControllerError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(("line", "message"), [
    ('{"t": 3, "key": "neg", "size": -5}', "field 'size' must be an int >= 1, got -5"),
    ('{"t": 3, "key": "z", "size": 0}', "field 'size' must be an int >= 1, got 0"),
    ('{"t": 4, "size": 1}', "missing field 'key'"),
    ('{"t": "soon", "key": "y", "size": 1}', "field 't' must be a finite number, got 'soon'"),
    ('{"t": NaN, "key": "y", "size": 1}', "field 't' must be a finite number, got nan"),
    ('{"t": 6, "key": true, "size": 1}', "field 'key' must be a string or an int, got True"),
    ('{"t": 6, "key": "k", "size": 1.0}', "field 'size' must be an int >= 1, got 1.0"),
    ('{"t": 6, "key": "k", "size": 1, "ns": null}', "field 'ns' must be a string, got None"),
    ("[1, 2, 3]", "expected a JSON object, got [1, 2, 3]"),
])
def test_canonical_field_errors(line: str, message: str) -> None:
    source = io.StringIO('{"t": 0, "key": "ok", "size": 1}\n\n' + line + "\n")
    got = read_trace(source, "canonical")
    assert next(got) == Access(0.0, "ok", 1)
    with pytest.raises(TraceError) as info:
        next(got)
    assert str(info.value) == f"<stream>:3: {message}"


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 20, "hash_ids": "0,1"}', "field 'hash_ids' must be a list, got '0,1'"),
    ('{"hash_ids": [0]}', "missing field 'timestamp'"),
    ('{"timestamp": 1, "hash_ids": [0, 1', "invalid JSON: Expecting ',' delimiter at the end of the line"),
    ('{"timestamp": 1, "hash_ids": [0 1]}', "invalid JSON: Expecting ',' delimiter at column 33"),
])
def test_mooncake_field_errors(line: str, message: str) -> None:
    with pytest.raises(TraceError) as info:
        list(read_trace(io.StringIO(line + "\n"), "mooncake"))
    assert str(info.value) == f"<stream>:1: {message}"


@pytest.mark.parametrize(("row", "message"), [
    ("1,300,2a,-512,3", "size column 'size' must be > 0, got -512"),
    ("1,300,2a,5.0,3", "size column 'size' must be an int, got '5.0'"),
    ("1,400,2a,512", "expected 5 fields, got 4"),
    ("1,500,2a,512,", "id column 'lbn' is empty"),
    ("1,inf,2a,512,7", "time column 'time' must be finite, got 'inf'"),
])
def test_csv_row_errors(row: str, message: str) -> None:
    source = io.StringIO(f"version,time,op,size,lbn\n1,100,2a,512,1\n{row}\n")
    with pytest.raises(TraceError) as info:
        list(read_trace(source, "csv", csv_columns=CsvColumns(id="lbn")))
    assert str(info.value) == f"<stream>:3: {message}"


@pytest.mark.parametrize(("name", "fmt", "expected", "stats"), [
    ("canonical_bad.jsonl", "canonical", [Access(0.0, "ok1", 1), Access(2.0, "ok2", 2), Access(8.0, "ok3", 3)],
     ReadStats(lines=9, accesses=3, skipped=6)),
    # every event is checked whole, a bypass too: {"outcome": "bypass"} alone is not an event
    ("events_bad.jsonl", "events", [Access(1.0, "k", 4, "", "r"), Access(5.0, "k", 4, "", "r")],
     ReadStats(lines=6, accesses=2, skipped=4)),
    ("mooncake_bad.jsonl", "mooncake", [Access(0.0, "0", 512, req=0, pos=0), Access(0.0, "1", 512, req=0, pos=1),
                                        Access(0.04, "0", 512, req=1, pos=0)],
     ReadStats(lines=6, accesses=3, skipped=4)),
    ("blocks_bad.csv", "csv", [Access(100.0, "1", 512), Access(600.0, "6", 512)],
     ReadStats(lines=7, accesses=2, skipped=4)),
])
def test_skip_bad_skips_and_counts(name: str, fmt: str, expected: list[Access], stats: ReadStats) -> None:
    got = ReadStats()
    assert list(read_trace(fixture(name), fmt, skip_bad=True, stats=got, csv_columns=CsvColumns(id="lbn"))) \
        == expected
    assert got == stats


# -- auto-detection -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "fmt"), [
    ("canonical.jsonl", "canonical"), ("events.jsonl", "events"), ("mooncake.jsonl", "mooncake"),
    ("blocks.csv", "csv"),
])
def test_auto_detects(name: str, fmt: str) -> None:
    columns = CsvColumns(id="lbn")
    expected = list(read_trace(fixture(name), fmt, csv_columns=columns))
    assert expected
    assert list(read_trace(fixture(name), csv_columns=columns)) == expected


def test_auto_keeps_line_numbers_after_leading_blank_lines() -> None:
    source = io.StringIO('\n  \n{"t": 1, "key": "a", "size": 1}\n{"t": 2, "key": "b"}\n')
    with pytest.raises(TraceError) as info:
        list(read_trace(source))
    assert str(info.value) == "<stream>:4: missing field 'size'"


def test_auto_fails_naming_the_file() -> None:
    with pytest.raises(TraceError) as info:
        list(read_trace(fixture("unknown.jsonl")))
    assert str(info.value) == (
        f"{fixture('unknown.jsonl')}:1: cannot detect the trace format from 'timestamp prompt': name a .csv file "
        "or pass format= one of ['canonical', 'csv', 'events', 'mooncake']"
    )


def test_auto_on_an_empty_trace() -> None:
    stats = ReadStats()
    assert list(read_trace(io.StringIO("\n\n"), stats=stats)) == []
    assert stats == ReadStats(lines=2)


# -- arguments ------------------------------------------------------------------------------------------------

def test_unknown_format_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown trace format 'parquet'; known: auto, canonical, csv, events, "
                                         r"mooncake$"):
        read_trace(fixture("canonical.jsonl"), "parquet")
    assert sorted(FORMATS) == ["auto", "canonical", "csv", "events", "mooncake"]


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"block_tokens": 0}, ValueError, "block_tokens must be > 0, got 0"),
    ({"bytes_per_token": 2.0}, TypeError, "bytes_per_token must be an int, got float"),
    ({"time_scale": 0.0}, ValueError, "time_scale must be finite and > 0, got 0.0"),
    ({"time_scale": "1"}, TypeError, "time_scale must be a number, got str"),
    ({"csv_columns": {"id": "lbn"}}, TypeError, "csv_columns must be a CsvColumns, got dict"),
])
def test_bad_options_fail_at_the_call(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        read_trace(fixture("canonical.jsonl"), **kwargs)
    assert str(info.value) == message


def test_source_must_be_a_path_or_stream() -> None:
    with pytest.raises(TypeError, match="source must be a path or a text stream, got list"):
        read_trace(["{}"])  # type: ignore[arg-type]


# -- streaming ----------------------------------------------------------------------------------------------

def test_first_accesses_come_before_the_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        fh.writelines(f'{{"t": {i}, "key": "k{i % 977}", "size": {1 + i % 13}}}\n' for i in range(200_000))
    with open(path) as fh:
        counted = CountingText(iter(fh))
        first = list(itertools.islice(read_trace(counted), 10))
    assert first == [Access(float(i), f"k{i}", 1 + i) for i in range(10)]
    assert counted.lines_read == 10


def test_generator_backed_stream_of_unbounded_length() -> None:
    def requests() -> Iterator[str]:
        for i in itertools.count():
            yield json.dumps({"timestamp": i * 10, "hash_ids": [0, 1, i + 2]}) + "\n"

    counted = CountingText(requests())
    first = list(itertools.islice(read_trace(counted, "mooncake"), 7))
    assert [(a.key, a.req, a.pos) for a in first] == [
        ("0", 0, 0), ("1", 0, 1), ("2", 0, 2), ("0", 1, 0), ("1", 1, 1), ("3", 1, 2), ("0", 2, 0),
    ]
    assert counted.lines_read == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.one_of(st.text(max_size=8), st.integers(-10**6, 10**6)),
    st.integers(1, 2**40),
    st.text(max_size=4),
), max_size=20))
def test_canonical_round_trip(rows: list[tuple[float, str | int, int, str]]) -> None:
    text = "".join(json.dumps({"t": t, "key": k, "size": s, "ns": ns}) + "\n" for t, k, s, ns in rows)
    assert list(read_trace(io.StringIO(text), "canonical")) == [Access(t, str(k), s, ns) for t, k, s, ns in rows]


# -- the real Mooncake trace ----------------------------------------------------------------------------------

def test_real_mooncake_trace() -> None:
    stats = ReadStats()
    keys: set[str] = set()
    requests = 0
    for access in read_trace(MOONCAKE, stats=stats):
        keys.add(access.key)
        if access.pos == 0:
            assert access.req == requests
            requests += 1
    assert (len(keys), requests) == (43_924, 3_993)
    assert stats == ReadStats(lines=3_993, accesses=121_877, skipped=0)
