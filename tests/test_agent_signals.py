"""The loop's signal collectors: access events (JSONL tails, the Redis stream), NVML, the host, torch.profiler
traces and Nsight Compute CSVs, and the hub that asks them all."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import pynvml
import pytest
from _helpers import free_port
from evocache.agents._types import Outcome, Request, Series, window_stats
from evocache.agents.errors import SignalUnavailable, WorkloadError
from evocache.agents.signals import (
    Collector,
    EventsCollector,
    HostCollector,
    JsonlTail,
    KernelMetrics,
    KernelStat,
    NcuCollector,
    NvmlCollector,
    ProfileCollector,
    RedisStreamTail,
    Sampler,
    SignalHub,
    kernel_summary,
    profile_callable,
    read_ncu_csv,
    read_trace,
)
from evocache.controller import AccessEvent, JsonlSink, RedisStreamSink

DATA = Path(__file__).parent / "data" / "agents"
T0 = 1_700_000_000.0


def ev(t: float, outcome: str, key: str = "k1", *, ns: str = "acme", rule: str = "faq", policy: str = "chat@3",
       tier: str | None = None, size: int = 0, latency_ms: float = 0.5, saved_ms: float = 0.0, reason: str = "",
       kv: dict | None = None, v: int = 1, **more) -> AccessEvent:
    """An event; of version 1 unless ``v`` says otherwise (most tests here write a call the way version 1 did:
    its decision, then its store or reject, then its kv usage)."""
    return AccessEvent(t=T0 + t, key=key, ns=ns, rule=rule, policy=policy, outcome=outcome, tier=tier, size=size,
                       latency_ms=latency_ms, saved_ms=saved_ms, fn="app.answer", reason=reason, kv=kv, v=v,
                       **more)


def lines(*events: AccessEvent) -> str:
    return "".join(e.to_json() + "\n" for e in events)


KV_USAGE = {"prompt_tokens": 700, "cached_tokens": 512, "reused": {"l1": 512}, "recomputed": 188, "load_ms": 0.0,
            "prefetch_ms": 0.0, "hidden_ms": 0.0, "miss": "evicted", "stored_blocks": 1, "chunk_fallback": ""}

# One of each decision, the events that complete them, and those that are no request.
TRAFFIC = (
    ev(0.0, "hit", "a", tier="l2", size=5321, saved_ms=812.0),
    ev(1.0, "miss", "b"),
    ev(1.5, "slo-open", "", reason="p99"),
    ev(2.0, "store", "b", tier="l1,l2", size=900, saved_ms=640.0),
    ev(2.1, "kv", "b", tier="l1", size=512, latency_ms=0.0, reason="evicted", kv=KV_USAGE),
    ev(3.0, "bypass", "", rule="sampled", reason="samples"),
    ev(4.0, "hit", "c", ns="beta", tier="l1", size=77, saved_ms=95.0, reason="semantic"),
    ev(5.0, "miss", "d"),
    ev(5.5, "reject", "d", size=0, saved_ms=12.5, reason="unserializable"),
)

# The same calls as version 2 writes them: one event per call.
TRAFFIC_V2 = (
    ev(0.0, "hit", "a", tier="l2", size=5321, saved_ms=812.0, v=2, call="c-1"),
    ev(1.5, "slo-open", "", reason="p99", v=2),
    ev(1.0, "miss", "b", size=900, saved_ms=640.0, stored="l1,l2", kv=KV_USAGE, v=2, call="c-2"),
    ev(3.0, "bypass", "", rule="sampled", reason="samples", v=2, call="c-3"),
    ev(4.0, "hit", "c", ns="beta", tier="l1", size=77, saved_ms=95.0, reason="semantic", v=2, call="c-4"),
    ev(5.0, "miss", "d", saved_ms=12.5, rejected="unserializable", v=2, call="c-5"),
)

EXPECTED = [
    (Request(T0, "response", ("a",), size=5321, ns="acme", rule="faq", latency_ms=812.0), Outcome(1, 1, tier="l2")),
    (Request(T0 + 1, "response", ("b",), size=900, ns="acme", rule="faq", prompt_tokens=700, latency_ms=640.0),
     Outcome(1, 0)),
    (Request(T0 + 3, "response", (), size=0, ns="acme", rule="sampled"), Outcome(0, 0, bypass=True)),
    (Request(T0 + 4, "response", ("c",), size=77, ns="beta", rule="faq", latency_ms=95.0),
     Outcome(1, 1, semantic=True, tier="l1")),
    (Request(T0 + 5, "response", ("d",), size=0, ns="acme", rule="faq", latency_ms=12.5), Outcome(1, 0)),
]


# -- events from JSONL files --------------------------------------------------------------------------------

def test_events_become_the_shared_pairs(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    for event in TRAFFIC:
        sink.emit(event)
    sink.close()
    events = EventsCollector.from_files([path])
    assert events.poll() == EXPECTED
    assert events.poll() == []
    assert events.requests_between(T0, T0 + 10) == EXPECTED
    assert events.requests_between(T0 + 1, T0 + 4) == EXPECTED[1:3]  # [start, end)
    stats = window_stats(0, "chat@3", *zip(*events.requests_between(T0, T0 + 10), strict=True))
    assert (stats.requests, stats.lookups, stats.hits, stats.bypassed) == (5, 4, 2, 1)


def test_version_2_events_become_the_same_pairs(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(*TRAFFIC_V2))
    assert EventsCollector.from_files([path]).poll() == EXPECTED


def test_appended_lines_are_read_once(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(TRAFFIC[0]))
    events = EventsCollector.from_files([path])
    assert [r.keys for r, _ in events.poll()] == [("a",)]
    with path.open("a") as fh:
        fh.write(lines(ev(6.0, "hit", "e", tier="l1", size=3, saved_ms=1.0),
                       ev(7.0, "hit", "f", tier="l1", size=4, saved_ms=1.0)))
    assert [r.keys for r, _ in events.poll()] == [("e",), ("f",)]
    assert events.poll() == []
    assert [r.keys for r, _ in events.requests_between(T0, T0 + 10)] == [("a",), ("e",), ("f",)]


def test_a_partial_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "events.jsonl"
    line = ev(0.0, "hit", "a", tier="l1", size=10, saved_ms=3.0).to_json()
    path.write_text(lines(TRAFFIC[6]) + line[:25])
    events = EventsCollector.from_files([path])
    assert [r.keys for r, _ in events.poll()] == [("c",)]
    assert events.poll() == []
    with path.open("a") as fh:
        fh.write(line[25:] + "\n")
    assert [r.keys for r, _ in events.poll()] == [("a",)]
    assert events.lines_skipped == 0


def test_a_truncated_file_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(*TRAFFIC[:4]))
    events = EventsCollector.from_files([path])
    assert len(events.poll()) == 2
    path.write_text(lines(ev(9.0, "hit", "z", tier="l1", size=1, saved_ms=2.0)))  # shorter than what was read
    assert [r.keys for r, _ in events.poll()] == [("z",)]


def records(tag: str, n: int, start: int = 0) -> list[dict]:
    """``n`` JSON records, of lengths that vary (so an old offset falls inside a line of other content)."""
    return [{"key": f"{tag}-{i}", "pad": "x" * (i * 7 % 23)} for i in range(start, start + n)]


def jsonl(recs: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


def in_place(path: Path, text: str) -> None:
    """Truncate ``path`` and write ``text`` into the same file (inode)."""
    with path.open("r+") as fh:
        fh.truncate(0)
        fh.seek(0)
        fh.write(text)


def replaced(path: Path, text: str) -> None:
    """Write ``text`` to a new file and rename it over ``path``."""
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    os.replace(new, path)


REWRITES = {"in_place": in_place, "replaced": replaced}


@pytest.mark.parametrize("rewrite", REWRITES)
@pytest.mark.parametrize("n", [1, 9, 26, 400])
def test_a_file_rewritten_longer_between_reads_is_read_once_from_its_start(tmp_path, rewrite, n):
    path = tmp_path / "events.jsonl"
    path.write_text(jsonl(records("old", n)))
    tail = JsonlTail(path)
    assert [rec["key"] for _, rec in tail.read()] == [f"old-{i}" for i in range(n)]
    inode = path.stat().st_ino
    new = records("new", 2 * n + 3)
    REWRITES[rewrite](path, jsonl(new))
    assert (path.stat().st_ino == inode) == (rewrite == "in_place")
    assert [rec for _, rec in tail.read()] == new
    assert tail.read() == []
    assert tail.skipped == 0


@pytest.mark.parametrize("rewrite", REWRITES)
def test_a_file_rewritten_with_as_many_bytes_is_read_again(tmp_path, rewrite):
    path = tmp_path / "events.jsonl"
    old = records("aaa", 30)
    path.write_text(jsonl(old))
    tail = JsonlTail(path)
    assert len(tail.read()) == 30
    new = records("bbb", 30)
    REWRITES[rewrite](path, jsonl(new))
    assert path.stat().st_size == len(jsonl(old))
    assert [rec for _, rec in tail.read()] == new
    assert tail.read() == []


def test_a_file_rewritten_with_the_same_first_lines_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(jsonl(records("k", 300)))  # more than the bytes kept from the start of the file
    tail = JsonlTail(path)
    assert len(tail.read()) == 300
    new = records("k", 299) + records("changed", 40)  # all but the last line read are the same
    in_place(path, jsonl(new))
    assert [rec for _, rec in tail.read()] == new


def test_appending_after_a_rewrite_reads_only_what_was_appended(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(jsonl(records("old", 5)))
    tail = JsonlTail(path)
    tail.read()
    in_place(path, jsonl(records("new", 12)))
    assert len(tail.read()) == 12
    with path.open("a") as fh:
        fh.write(jsonl(records("more", 3)))
    assert [rec["key"] for _, rec in tail.read()] == ["more-0", "more-1", "more-2"]


def test_every_event_of_a_rewritten_file_becomes_one_pair(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(*(ev(i, "hit", f"old{i}", tier="l1", size=1, saved_ms=1.0) for i in range(10))))
    events = EventsCollector.from_files([path])
    assert len(events.poll()) == 10
    in_place(path, lines(*(ev(20 + i, "hit", f"new{i:03d}", tier="l1", size=1, saved_ms=1.0)
                           for i in range(26))))
    assert [r.keys for r, _ in events.poll()] == [(f"new{i:03d}",) for i in range(26)]
    assert events.lines_skipped == 0


def test_a_rotated_file_is_read_to_its_end_then_the_new_one(tmp_path):
    path = tmp_path / "events.jsonl"
    old = JsonlSink(path, flush_every=1)
    old.emit(ev(0.0, "hit", "a", tier="l1", size=1))
    events = EventsCollector.from_files([path])
    assert [r.keys for r, _ in events.poll()] == [("a",)]
    os.rename(path, tmp_path / "events.jsonl.1")
    old.emit(ev(1.0, "hit", "b", tier="l1", size=1))  # the old writer still appends to the rotated file
    old.close()
    new = JsonlSink(path, flush_every=1)
    new.emit(ev(2.0, "hit", "c", tier="l1", size=1))
    new.close()
    assert [r.keys for r, _ in events.poll()] == [("b",), ("c",)]
    assert events.poll() == []


def test_a_file_that_does_not_exist_yet_is_no_events(tmp_path):
    path = tmp_path / "later.jsonl"
    events = EventsCollector.from_files([path])
    assert events.poll() == []
    path.write_text(lines(TRAFFIC[0]))
    assert len(events.poll()) == 1


def test_bad_lines_are_skipped_counted_and_named(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(TRAFFIC[0]) + "{not json\n" + json.dumps({"t": 1, "outcome": "teleport"}) + "\n"
                    + lines(TRAFFIC[6]))
    events = EventsCollector.from_files([path])
    with caplog.at_level(logging.WARNING, "evocache.agents.signals"):
        assert [r.keys for r, _ in events.poll()] == [("a",), ("c",)]
    assert events.lines_skipped == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"{path}:2: skipped: invalid JSON" in m for m in messages)
    assert any(f"{path}:3: not an access event: field 'outcome'" in m for m in messages)


def test_an_over_long_line_is_skipped_and_the_next_one_read(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("x" * 1000)
    tail = JsonlTail(path, max_line_bytes=400)
    assert tail.read() == []
    with path.open("a") as fh:
        fh.write("y" * 50 + "\n" + lines(TRAFFIC[0]))
    assert [rec["key"] for _, rec in tail.read()] == ["a"]
    assert tail.skipped == 1


def test_a_miss_without_its_store_comes_out_unsized_once_its_wait_is_over(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(ev(0.0, "miss", "m"), ev(1.0, "hit", "h", tier="l1", size=5, saved_ms=1.0)))
    events = EventsCollector.from_files([path], miss_wait_s=30.0)
    assert events.poll() == []  # the hit queues behind the miss: pairs keep the source's order
    with path.open("a") as fh:
        fh.write(lines(ev(40.0, "hit", "h", tier="l1", size=5, saved_ms=1.0)))
    pairs = events.poll()
    assert [(r.keys, r.size, r.latency_ms, o.hits) for r, o in pairs] == [
        (("m",), 0, -1.0, 0), (("h",), 5, 1.0, 1), (("h",), 5, 1.0, 1)]


def test_a_version_1_kv_event_without_its_call_is_no_request(tmp_path):
    """A kv event is part of a call: one whose call is not waiting (or names no key, as version 1 wrote after a
    bypass) makes no pair of its own."""
    path = tmp_path / "events.jsonl"
    path.write_text(lines(ev(0.0, "kv", "q", tier="l2", size=512, kv=KV_USAGE),
                          ev(0.5, "bypass", "", rule="sampled", reason="samples"),
                          ev(1.0, "kv", "", tier=None, size=0, kv={**KV_USAGE, "cached_tokens": 0})))
    assert EventsCollector.from_files([path]).poll() == [
        (Request(T0 + 0.5, "response", (), size=0, ns="acme", rule="sampled"), Outcome(0, 0, bypass=True))]


def test_collect_returns_step_series_and_policy_series(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(
        ev(0.0, "hit", "a", tier="l1", size=1), ev(1.0, "hit", "a", tier="l1", size=1, ns="beta"),
        ev(12.0, "miss", "b", policy="chat@4"), ev(12.5, "store", "b", size=10, saved_ms=5.0, policy="chat@4"),
        ev(25.0, "hit", "late", tier="l1", size=1),  # at end: outside [start, end)
    ))
    events = EventsCollector.from_files([path], step_s=10.0)
    series = {(s.name, s.labels): s for s in events.collect(T0, T0 + 20)}
    steps = (T0, T0 + 10)
    assert series["qps", ()] == Series("qps", (), steps, (0.2, 0.1), "1/s")
    miss = series["miss_ratio", ()]
    assert miss.v == (0.0, 1.0) and miss.unit == "ratio"
    assert series["qps", (("tenant", "beta"),)].v == (0.1, 0.0)
    assert series["qps", (("rule", "faq"),)].v == (0.2, 0.1)
    assert series["policy_qps", (("policy", "chat@3"),)] == Series(
        "policy_qps", (("policy", "chat@3"),), steps, (0.2, 0.0), "1/s")
    assert series["policy_qps", (("policy", "chat@4"),)].v == (0.0, 0.1)
    assert all(math.isnan(v) for v in series["prompt_tokens", ()].v)  # response events carry no prompt length
    assert [r.keys for r, _ in events.requests_between(T0, T0 + 30, policy="chat@4")] == [("b",)]
    assert events.collect(T0 + 100, T0 + 200) == []


def test_pairs_older_than_the_retention_are_dropped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(lines(*(ev(float(i * 100), "hit", str(i), tier="l1", size=1) for i in range(5))))
    events = EventsCollector.from_files([path], retention_s=250.0, max_pairs=2)
    events.poll()
    assert [r.keys for r, _ in events.requests_between(0, math.inf)] == [("3",), ("4",)]
    events = EventsCollector.from_files([path], retention_s=250.0)
    events.poll()
    assert [r.keys for r, _ in events.requests_between(0, math.inf)] == [("2",), ("3",), ("4",)]


# -- events from the Redis stream ---------------------------------------------------------------------------

def test_redis_stream_is_read_from_the_last_id(redis_url):
    sink = RedisStreamSink(redis_url, stream="evocache:events")
    try:
        for event in TRAFFIC[:5]:
            sink.emit(event)
        sink.flush()
        events = EventsCollector.from_redis(redis_url)
        assert events.poll() == EXPECTED[:2]
        for event in TRAFFIC[5:]:
            sink.emit(event)
        sink.flush()
        assert events.poll() == EXPECTED[2:]
        assert events.poll() == []
        sink.client.xadd("evocache:events", {"x": "1"})
        sink.client.xadd("evocache:events", {"e": "{broken"})
        assert events.poll() == []
        assert events.lines_skipped == 2
    finally:
        sink.close()


def test_redis_stream_tail_reads_a_restarted_stream_from_its_start(redis_url):
    sink = RedisStreamSink(redis_url, stream="s1")
    try:
        sink.emit(TRAFFIC[0])
        sink.flush()
        tail = RedisStreamTail(client=sink.client, stream="s1", batch=1)
        assert [rec["key"] for _, rec in tail.read()] == ["a"]
        sink.client.delete("s1")
        sink.client.xadd("s1", {"e": TRAFFIC[6].to_json()}, id="1-1")  # far below the last id read
        assert [rec["key"] for _, rec in tail.read()] == ["c"]
    finally:
        sink.close()


def test_an_unreachable_redis_is_unavailable_and_reported_once(caplog):
    events = EventsCollector.from_redis(f"redis://127.0.0.1:{free_port()}/0")
    hub = SignalHub([events])
    with caplog.at_level(logging.INFO, "evocache.agents.signals"):
        for _ in range(3):
            assert hub.collect(T0, T0 + 10) == []
    assert "ConnectionError" in hub.unavailable["events"]
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        f"signal events unavailable: {hub.unavailable['events']}"]


# -- the hub ------------------------------------------------------------------------------------------------

class Scripted:
    """A collector whose rounds are scripted: a list of series, or an exception to raise."""

    def __init__(self, name: str, rounds: list) -> None:
        self.name = name
        self.rounds = rounds

    def collect(self, start: float, end: float) -> list[Series]:
        step = self.rounds.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    closed = 0

    def close(self) -> None:
        self.closed += 1
        if self.name == "broken":
            raise RuntimeError("cannot close")


def test_closing_the_hub_closes_every_collector_even_past_one_that_fails(caplog):
    collectors = [Scripted("a", []), Scripted("broken", []), Scripted("c", [])]
    SignalHub(collectors).close()
    assert [c.closed for c in collectors] == [1, 1, 1]
    assert "signal broken: close failed" in caplog.text


def test_real_nvml_without_a_gpu_is_reported_once_over_many_rounds(caplog):
    nvml = NvmlCollector()
    hub = SignalHub([nvml])
    with caplog.at_level(logging.INFO, "evocache.agents.signals"):
        for _ in range(5):
            assert hub.collect(T0, T0 + 1) == []
    reason = "NVML cannot start: NVMLError_LibraryNotFound: NVML Shared Library Not Found"
    assert hub.unavailable == {"nvml": reason}
    assert [r.getMessage() for r in caplog.records] == [f"signal nvml unavailable: {reason}"]
    with pytest.raises(SignalUnavailable, match="NVMLError_LibraryNotFound"):
        nvml.start()
    nvml.close()


def test_a_failing_collector_is_left_out_and_counted_and_the_others_go_on(caplog):
    point = Series("gpu_util", (("gpu", "0"),), (T0,), (50.0,), "%")
    broken = Scripted("broken", [RuntimeError("bug"), RuntimeError("bug"), [point]])
    fine = Scripted("fine", [[point], [point], [point]])
    hub = SignalHub([broken, fine])
    with caplog.at_level(logging.DEBUG, "evocache.agents.signals"):
        assert hub.collect(T0, T0 + 1) == [point]
        assert hub.collect(T0, T0 + 1) == [point]
        assert hub.collect(T0, T0 + 1) == [point, point]
    assert hub.errors == {"broken": 2}
    tracebacks = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info is not None


def test_a_collector_that_comes_back_leaves_unavailable():
    flaky = Scripted("gpu", [SignalUnavailable("gpu", "driver reloading"), []])
    hub = SignalHub([flaky])
    hub.collect(T0, T0 + 1)
    assert hub.unavailable == {"gpu": "driver reloading"}
    hub.collect(T0, T0 + 1)
    assert hub.unavailable == {}


def test_collectors_meet_the_protocol_and_names_must_be_unique(tmp_path):
    for c in (EventsCollector.from_files([tmp_path / "e.jsonl"]), NvmlCollector(), HostCollector(),
              ProfileCollector(tmp_path), NcuCollector(directory=tmp_path)):
        assert isinstance(c, Collector)
    with pytest.raises(ValueError, match=r"repeated: \['host'\]"):
        SignalHub([HostCollector(), HostCollector()])
    with pytest.raises(ValueError, match="end >= start"):
        SignalHub([]).collect(T0 + 1, T0)


def test_a_sampler_thread_samples_until_stopped_and_ends_when_unavailable():
    import threading

    calls = []
    third = threading.Event()

    def sample():
        calls.append(1)
        if len(calls) == 2:
            raise OSError("one bad reading")
        if len(calls) == 3:
            third.set()

    sampler = Sampler("probe", sample, period_s=0.001)
    sampler.start()
    assert third.wait(10)
    sampler.stop()
    stopped_at = len(calls)
    assert stopped_at >= 3 and sampler.errors == 1
    assert sampler._thread is None and len(calls) == stopped_at

    def unavailable():
        raise SignalUnavailable("probe", "no device")

    gone = Sampler("gone", unavailable, period_s=0.001)
    gone.start()
    gone._thread.join(10)
    assert not gone._thread.is_alive()
    with pytest.raises(ValueError, match="period_s must be > 0"):
        Sampler("bad", sample, period_s=0)


# -- NVML with its device calls faked -----------------------------------------------------------------------

class _Util:
    def __init__(self, gpu: int) -> None:
        self.gpu, self.memory = gpu, 0


class _Mem:
    def __init__(self, used: int, total: int) -> None:
        self.used, self.total, self.free = used, total, total - used


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two GPUs behind the real pynvml module: only its calls into the driver are replaced."""
    calls = []
    names = ["NVIDIA H200", b"NVIDIA L4"]  # older bindings return bytes

    def power(h):
        if h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 350_125

    def pcie(h, counter):
        return {pynvml.NVML_PCIE_UTIL_TX_BYTES: 2048, pynvml.NVML_PCIE_UTIL_RX_BYTES: 10}[counter] * (h + 1)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: names[h])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda h: _Util(37 + h))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: _Mem(1 << 30, 141 << 30))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", power)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPcieThroughput", pcie)
    return calls


def test_nvml_readings_in_units_with_gpu_labels(fake_gpus, fake_clock, caplog):
    nvml = NvmlCollector(clock=fake_clock)
    with caplog.at_level(logging.INFO, "evocache.agents.signals"):
        nvml.sample()
        fake_clock.advance(1.0)
        nvml.sample()
    t = (fake_clock.now - 1.0, fake_clock.now)
    got = {(s.name, s.label("gpu")): s for s in nvml.collect(0, math.inf)}
    h200 = (("gpu", "0"), ("name", "NVIDIA H200"))
    assert got["gpu_util", "0"] == Series("gpu_util", h200, t, (37.0, 37.0), "%")
    assert got["gpu_mem_used", "0"] == Series("gpu_mem_used", h200, t, (2.0**30, 2.0**30), "bytes")
    assert got["gpu_mem_total", "1"].v == (141.0 * 2**30,) * 2
    assert got["gpu_power", "0"] == Series("gpu_power", h200, t, (350.125, 350.125), "W")
    assert got["gpu_pcie_tx", "0"] == Series("gpu_pcie_tx", h200, t, (2048.0 * 1024,) * 2, "bytes/s")
    assert got["gpu_pcie_rx", "1"].v == (20.0 * 1024,) * 2
    assert got["gpu_util", "1"].label("name") == "NVIDIA L4"
    assert ("gpu_power", "1") not in got  # not supported by that board: left out, said once
    assert [r.getMessage() for r in caplog.records] == [
        "nvml: gpu 1 (NVIDIA L4) gives no gpu_power: Not Supported"]
    assert {s.t for s in nvml.collect(t[1], math.inf)} == {(t[1],)}
    nvml.close()
    assert fake_gpus == ["init", "shutdown"]


def test_nvml_with_no_gpu_listed_is_unavailable(fake_gpus, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    nvml = NvmlCollector()
    with pytest.raises(SignalUnavailable, match="NVML reports no GPU"):
        nvml.sample()
    assert fake_gpus == ["init", "shutdown"]


# -- host ---------------------------------------------------------------------------------------------------

def test_host_readings(fake_clock):
    host = HostCollector(clock=fake_clock)
    host.sample()
    fake_clock.advance(2.0)
    host.sample()
    got = {s.name: s for s in host.collect(0, math.inf)}
    assert sorted(got) == ["host_cpu_percent", "host_mem_available", "host_mem_used", "process_rss"]
    assert {s.unit for s in got.values()} == {"%", "bytes"}
    assert got["process_rss"].labels == (("pid", str(os.getpid())),)
    assert got["host_mem_used"].t == (fake_clock.now - 2.0, fake_clock.now)
    assert all(v > 0 for v in got["process_rss"].v + got["host_mem_available"].v)
    assert all(0.0 <= v <= 100.0 for v in got["host_cpu_percent"].v)
    assert host.collect(fake_clock.now + 1, math.inf) == []


# -- torch.profiler traces ----------------------------------------------------------------------------------

def test_a_real_torch_trace_is_summarised(tmp_path):
    import torch

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    path = profile_callable(lambda: layer(x).relu(), steps=3, activities=("cpu",), directory=tmp_path)
    assert path.parent == tmp_path and path.suffix == ".json"
    stats = {s.name: s for s in kernel_summary(read_trace(path), top=100)}
    linear = stats["aten::linear"]
    assert (linear.device, linear.calls) == ("cpu", 3)
    assert stats["aten::relu"].calls == 3
    assert 0 <= linear.self_us < linear.total_us  # aten::linear's time is mostly its addmm
    assert stats["aten::addmm"].total_us <= linear.total_us

    os.utime(path, (T0 + 5, T0 + 5))
    collector = ProfileCollector(tmp_path)
    series = {(s.name, s.label("kernel")): s for s in collector.collect(T0, T0 + 10)}
    assert series["kernel_time_us", "aten::linear"] == Series(
        "kernel_time_us", (("kernel", "aten::linear"), ("device", "cpu")), (T0 + 5,), (linear.total_us,), "us")
    assert series["kernel_calls", "aten::linear"].v == (3.0,)
    assert collector.scan() == []  # read once


def test_kernel_summary_self_time_and_devices():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 10, "dur": 30, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 15, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 50, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 20, "dur": 200, "pid": 1, "tid": 2},
        {"ph": "X", "cat": "kernel", "name": "sgemm_64x32", "ts": 30, "dur": 7.5, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "sgemm_64x32", "ts": 60, "dur": 2.5, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12, "dur": 3, "pid": 1, "tid": 1},
        {"ph": "i", "cat": "cpu_op", "name": "marker", "ts": 1, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "bad", "ts": "soon", "dur": 1},
    ]}
    assert kernel_summary(trace) == [
        KernelStat("aten::addmm", "cpu", 3, 240.0, 235.0),
        KernelStat("aten::linear", "cpu", 1, 100.0, 60.0),
        KernelStat("sgemm_64x32", "cuda", 2, 10.0, 10.0),
        KernelStat("aten::copy_", "cpu", 1, 5.0, 5.0),
    ]
    assert [s.name for s in kernel_summary(trace, top=1)] == ["aten::addmm"]


def test_trace_files_too_large_or_malformed_are_refused_by_name(tmp_path, caplog):
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"traceEvents": [{"ph": "X"}] * 50}))
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    other = tmp_path / "other.json"
    other.write_text('{"events": []}')
    with pytest.raises(WorkloadError, match=r"big\.json: trace is \d+ bytes, more than the 100 allowed"):
        read_trace(big, max_bytes=100)
    with pytest.raises(WorkloadError, match=r"bad\.json: not a Chrome trace: invalid JSON"):
        read_trace(bad)
    with pytest.raises(WorkloadError, match=r"other\.json: not a Chrome trace: no 'traceEvents' list"):
        read_trace(other)
    collector = ProfileCollector(tmp_path, max_bytes=100)
    with caplog.at_level(logging.WARNING, "evocache.agents.signals"):
        assert collector.collect(0, math.inf) == []
    assert sorted(Path(p).name for p in collector.rejected) == ["bad.json", "big.json", "other.json"]
    assert len(caplog.records) == 3
    caplog.clear()
    assert collector.scan() == [] and caplog.records == []  # unchanged files are not tried again


def test_a_missing_profile_directory_is_unavailable(tmp_path):
    with pytest.raises(SignalUnavailable, match="no profile directory"):
        ProfileCollector(tmp_path / "nowhere").collect(0, 1)


# -- Nsight Compute CSV -------------------------------------------------------------------------------------

SGEMM = "ampere_sgemm_64x32_sliced1x4_nn"
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "at::detail::Array<char *, 1>>(int, T2, T3)")


def test_ncu_details_page():
    path = DATA / "ncu_details.csv"
    report = read_ncu_csv(path)
    assert report.skipped_lines == 8  # five ==PROF== lines, two of the program's, one cut row
    assert report.kernels == (
        KernelMetrics(SGEMM, "0", 1_234_500.0, 88.2, 12.75),
        KernelMetrics(FILL, "1", 2816.0, None, None, (
            f"{path}:17: L1/TEX Hit Rate is not a number: 'n/a'",
            f"{path}:18: L2 Hit Rate = 104.3 outside 0-100",
        )),
        KernelMetrics(SGEMM, "2", 1_500_000.0, 50.0, 0.0),
    )


def test_ncu_raw_page_with_its_units_row():
    path = DATA / "ncu_raw.csv"
    report = read_ncu_csv(path)
    assert report.skipped_lines == 4
    assert report.kernels == (
        KernelMetrics("gemm_tiled(float const*, float const*, float*, int)", "0", 3_072_250.0, 93.1, 41.5),
        KernelMetrics("gemm_naive(float const*, float const*, float*, int)", "1", 12_500_000.0, 60.0, None,
                      (f"{path}:8: l1tex__t_sector_hit_rate.pct = -3.0 outside 0-100",)),
    )


def test_ncu_raw_metric_names_in_the_long_layout():
    path = DATA / "ncu_metrics.csv"
    report = read_ncu_csv(path)
    assert report.skipped_lines == 2
    assert report.kernels == (
        KernelMetrics("flash_fwd_kernel", "0", 10_240.0, 77.5, 5.25),
        KernelMetrics("flash_fwd_kernel", "1", None, None, None,
                      (f"{path}:6: gpu__time_duration.sum in an unknown unit 'furlong'",)),
    )


def test_ncu_errors_name_the_file_and_the_column(tmp_path):
    with pytest.raises(WorkloadError, match=r"ncu_no_unit\.csv:1: the header has no column 'Metric Unit'"):
        read_ncu_csv(DATA / "ncu_no_unit.csv")
    only_prof = tmp_path / "empty.csv"
    only_prof.write_text("==PROF== Connected to process 1\n==ERROR== The application returned an error code (1).\n")
    with pytest.raises(WorkloadError, match=r"empty\.csv: no ncu CSV header"):
        read_ncu_csv(only_prof)
    with pytest.raises(WorkloadError, match=r"ncu_details\.csv: \d+ bytes, more than the 1000 allowed"):
        read_ncu_csv(DATA / "ncu_details.csv", max_bytes=1000)
    with pytest.raises(WorkloadError, match=r"absent\.csv: cannot read"):
        read_ncu_csv(tmp_path / "absent.csv")


def test_ncu_collector_series_per_kernel(tmp_path):
    for name in ("ncu_details.csv", "ncu_raw.csv"):
        shutil.copy(DATA / name, tmp_path / name)
    os.utime(tmp_path / "ncu_details.csv", (T0, T0))
    os.utime(tmp_path / "ncu_raw.csv", (T0 + 60, T0 + 60))
    (tmp_path / "broken.csv").write_text("nothing here\n")
    ncu = NcuCollector(directory=tmp_path)
    got = {(s.name, s.label("kernel")): s for s in ncu.collect(T0, T0 + 30)}
    sgemm = (("kernel", SGEMM),)
    assert got["kernel_gpu_time_ns", SGEMM] == Series("kernel_gpu_time_ns", sgemm, (T0,), (2_734_500.0,), "ns")
    assert got["l2_hit_pct", SGEMM] == Series("l2_hit_pct", sgemm, (T0,), (69.1,), "%")
    assert got["l1_hit_pct", SGEMM].v == (6.375,)
    assert got["kernel_gpu_time_ns", FILL].v == (2816.0,)
    assert ("l2_hit_pct", FILL) not in got  # its only L2 reading was out of range
    assert sorted(got) == sorted([("kernel_gpu_time_ns", SGEMM), ("l2_hit_pct", SGEMM), ("l1_hit_pct", SGEMM),
                                  ("kernel_gpu_time_ns", FILL)])
    assert list(ncu.rejected) == [str(tmp_path / "broken.csv")]
    later = ncu.collect(T0 + 30, T0 + 90)
    assert {s.name for s in later} == {"kernel_gpu_time_ns", "l2_hit_pct", "l1_hit_pct"}
    assert ncu.scan() == []
    with pytest.raises(SignalUnavailable, match="no ncu directory"):
        NcuCollector(directory=tmp_path / "nowhere").collect(0, 1)


def test_the_package_exports_exactly_its_public_names_and_loads_no_heavy_library():
    import subprocess
    import sys

    from evocache.agents import signals

    public = {n for n in dir(signals) if not n.startswith("_") and type(getattr(signals, n)) is not type(signals)}
    assert public == set(signals.__all__)
    code = ("import sys, evocache.agents.signals; "
            "print(sorted(m for m in ('torch', 'pynvml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
