"""The honest queue model (replay._queue), the look-ahead policy it feeds, and `bench eviction --utilisation`."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from evocache.controller.eviction import (
    EntryInfo,
    LFUPolicy,
    LookaheadPolicy,
    LRUPolicy,
    QueuedRequest,
    make_eviction_policy,
)
from evocache.controller.replay import Access, replay
from evocache.controller.replay._queue import Backlog, Load, QueueModel, arrivals, serve
from evocache.controller.replay.commands import app
from typer.testing import CliRunner


def kv_trace(requests: list[tuple[float, list[str]]], ns: str = "") -> list[Access]:
    """One access per block, as the Mooncake reader yields them: (arrival, block keys) per request."""
    return [Access(t, key, 1, ns, "", req, pos)
            for req, (t, keys) in enumerate(requests) for pos, key in enumerate(keys)]


# r0: 2 blocks at 0; r1: 1 at 1; r2: 3 at 1.5; r3 and r4: 1 each at 10.
TINY = kv_trace([(0.0, ["a", "b"]), (1.0, ["a"]), (1.5, ["a", "c", "d"]), (10.0, ["e"]), (10.0, ["b"])])


def starts(trace: list[Access], model: QueueModel) -> list[tuple[float, int, list[int]]]:
    return [(s.start, s.request.queued.req, [w.req for w in s.waiting]) for s in serve(trace, model)]


# -- the queue model --------------------------------------------------------------------------------------


def test_waiting_sets_at_each_service_start_one_second_per_block() -> None:
    # r0 runs 0-2; r1 (arrived 1) starts at 2, when r2 (arrived 1.5) waits; r2 runs 3-6; the server idles until
    # 10, when r3 and r4 arrive together: r4 has arrived when r3 starts, and waits for it.
    assert starts(TINY, QueueModel(per_block=1.0)) == [
        (0.0, 0, []), (2.0, 1, [2]), (3.0, 2, []), (10.0, 3, [4]), (11.0, 4, [])]


def test_backlog_is_the_mean_and_most_waiting_at_a_service_start() -> None:
    # Waiting at the five starts above: 0, 1, 0, 1, 0.
    assert Backlog.of(TINY, QueueModel(per_block=1.0)) == (2 / 5, 1)
    # 4 s per block: r0 runs 0-8; r1 8-12 while r2 waits; r2 starts at 12, when r3 and r4 (arrived at 10) wait.
    assert [len(s.waiting) for s in serve(TINY, QueueModel(per_block=4.0))] == [0, 1, 2, 1, 0]
    assert Backlog.of(TINY, QueueModel(per_block=4.0)) == (4 / 5, 2)


def test_waiting_sets_with_a_fixed_time_per_request() -> None:
    # 6 s per request: r0 0-6 (r1 and r2 arrive after it started), r1 6-12 with r2 waiting, r2 12-18 with r3
    # and r4 (arrived at 10) waiting, r3 18-24, r4 24.
    assert starts(TINY, QueueModel(per_request=6.0)) == [
        (0.0, 0, []), (6.0, 1, [2]), (12.0, 2, [3, 4]), (18.0, 3, [4]), (24.0, 4, [])]


def test_without_service_time_only_simultaneous_arrivals_wait() -> None:
    assert starts(TINY, QueueModel()) == [
        (0.0, 0, []), (1.0, 1, []), (1.5, 2, []), (10.0, 3, [4]), (10.0, 4, [])]


def test_the_waiting_requests_carry_their_keys_as_the_replay_keys_them() -> None:
    trace = kv_trace([(0.0, ["a", "b"]), (0.0, ["a", "c"])], ns="t1")
    first = next(serve(trace, QueueModel(per_block=1.0)))
    assert first.waiting == (QueuedRequest(1, (("t1", "a"), ("t1", "c"))),)
    assert first.request.accesses == tuple(trace[:2])


def test_utilisation_is_arrival_rate_times_mean_service_time() -> None:
    # 5 requests over 10 s, 8 blocks: at 1 s per block, 0.5 requests/s x 1.6 s = 0.8.
    assert Load.of(TINY) == Load(5, 8, 10.0)
    assert QueueModel(per_block=1.0).utilisation(TINY) == pytest.approx(0.8)
    assert QueueModel(per_request=2.0).utilisation(TINY) == pytest.approx(1.0)
    model = QueueModel.for_utilisation(TINY, 0.4)
    assert model == QueueModel(per_block=0.5) and model.utilisation(TINY) == pytest.approx(0.4)


def test_bad_queue_input_is_named() -> None:
    with pytest.raises(ValueError, match="per_block must be a finite number of seconds >= 0, got -1"):
        QueueModel(per_block=-1)
    with pytest.raises(ValueError, match="per_request .* got inf"):
        QueueModel(per_request=float("inf"))
    with pytest.raises(ValueError, match="utilisation must be a finite number > 0, got 0"):
        QueueModel.for_utilisation(TINY, 0)
    with pytest.raises(ValueError, match="span no time"):
        QueueModel.for_utilisation(kv_trace([(3.0, ["a"]), (3.0, ["b"])]), 0.5)
    with pytest.raises(ValueError, match="access 1 \\(key 'x'\\) has no request number"):
        list(arrivals([TINY[0], Access(0.0, "x", 1)]))
    with pytest.raises(ValueError, match="request 1 arrives at t=1.0 before request 0 \\(t=2.0\\)"):
        list(arrivals(kv_trace([(2.0, ["a"]), (1.0, ["b"])])))


# -- the policy ---------------------------------------------------------------------------------------------


def random_kv_trace(seed: int, requests: int = 300) -> list[Access]:
    """Shared prefixes of a few popular chains and one-off chains, arriving in bursts."""
    rng = random.Random(seed)
    out: list[tuple[float, list[str]]] = []
    t = 0.0
    for req in range(requests):
        t += rng.choice([0.0, 0.0, 0.2, 1.0, 3.0])
        head = rng.randrange(6) if rng.random() < 0.6 else 100 + req
        out.append((t, [f"{head}:{pos}" for pos in range(1 + rng.randrange(8))]))
    return kv_trace(out)


@pytest.mark.parametrize("base", ["lru", "lfu", "lruk", "s3fifo", "learned"])
def test_with_an_empty_queue_it_is_its_base_policy(base: str) -> None:
    trace = random_kv_trace(1)
    # A queue that is never occupied: no service time and no two requests arriving together.
    spaced = [a._replace(t=float(a.req)) for a in trace]
    assert not any(s.waiting for s in serve(spaced, QueueModel()))
    for accesses, queue in ((trace, None), (spaced, QueueModel())):
        expected = replay(accesses, partial(make_eviction_policy, base, capacity=12), capacity_objects=12,
                          window_s=2.0)
        got = replay(accesses, partial(make_eviction_policy, "lookahead", capacity=12, base=base), capacity_objects=12,
                     window_s=2.0, queue=queue)
        assert expected.hits > 0
        assert replace(got, policy=expected.policy) == expected


def test_protected_blocks_go_last_and_the_furthest_needed_first() -> None:
    policy = LookaheadPolicy()
    for key in "abcdef":
        policy.on_insert(key, EntryInfo(1))
    # r7 needs c then a; r8 needs e and a. LRU order of the rest: b, d, f.
    policy.on_queue([QueuedRequest(7, ("c", "x", "a")), QueuedRequest(8, ("e", "a"))])
    evicted = []
    for _ in range(6):
        key = policy.victim()
        policy.on_remove(key)
        evicted.append(key)
    # e is needed by r8 only (furthest), then a at r7's third block, then c at r7's first.
    assert evicted == ["b", "d", "f", "e", "a", "c"]


def test_a_key_leaves_protection_when_its_last_waiting_request_starts() -> None:
    policy = LookaheadPolicy()
    for key in "abc":
        policy.on_insert(key, EntryInfo(1))
    policy.on_queue([QueuedRequest(1, ("a",)), QueuedRequest(2, ("a", "b"))])
    assert policy.victim() == "c"
    policy.on_queue([QueuedRequest(2, ("a", "b"))])  # r1 started: a is still needed by r2
    assert (policy.protected("a"), policy.victim()) == (True, "c")
    policy.on_queue([])  # r2 started: a and b go back to LRU as just used, a before b
    policy.on_remove("c")
    assert [policy.victim()] == ["a"]
    with pytest.raises(ValueError, match="appears twice"):
        policy.on_queue([QueuedRequest(3, ("a",)), QueuedRequest(3, ("b",))])


def test_admission_skips_an_unneeded_block_when_only_protected_ones_are_held() -> None:
    policy = LookaheadPolicy(capacity=2)
    policy.on_insert("a", EntryInfo(1))
    policy.on_insert("b", EntryInfo(1))
    policy.on_queue([QueuedRequest(1, ("a", "b"))])
    assert policy.admit("z", EntryInfo(1)) is False
    assert policy.admit("a2", EntryInfo(1)) is False and policy.bypassed == 2
    policy.on_queue([QueuedRequest(1, ("a", "b")), QueuedRequest(2, ("q",))])
    assert policy.admit("q", EntryInfo(1)) is True  # needed by r2: admitted, it will evict b
    assert LookaheadPolicy(capacity=2, admission=False).admit("z", EntryInfo(1)) is True


@pytest.mark.parametrize("seed", range(6))
def test_never_evicts_a_needed_block_while_an_unneeded_one_is_held(seed: int) -> None:
    """Driven through the replay with a queue that is often long: at every victim() the choice is checked
    against what the queue showed, worked out from scratch."""
    trace = random_kv_trace(seed)
    checked: list[int] = []

    class Checked(LookaheadPolicy):
        def on_queue(self, waiting):
            self.shown = list(waiting)
            super().on_queue(waiting)

        def victim(self, ns=None):
            key = super().victim(ns)
            first: dict = {}
            for rank, w in enumerate(getattr(self, "shown", [])):
                for pos, k in enumerate(w.keys):
                    first.setdefault(k, (rank, pos))
            held = list(self._held)
            unneeded = [k for k in held if k not in first]
            if unneeded:
                assert key in unneeded
            else:
                assert first[key] == max(first[k] for k in held)
                checked.append(1)
            return key

    result = replay(trace, partial(Checked, capacity=10), capacity_objects=10, queue=QueueModel(per_block=0.6))
    assert result.requests == len(trace) and checked  # both branches were taken


def test_replay_with_a_queue_is_deterministic_and_beats_lru_here() -> None:
    trace = random_kv_trace(3, requests=400)
    model = QueueModel.for_utilisation(trace, 1.0)
    make = partial(LookaheadPolicy, capacity=15)
    first = replay(trace, make, capacity_objects=15, queue=model, window_s=5.0)
    again = replay(trace, make, capacity_objects=15, queue=model, window_s=5.0)
    assert first == again
    lru = replay(trace, "lru", capacity_objects=15, queue=model)
    assert lru == replay(trace, "lru", capacity_objects=15)  # a policy that does not read the queue
    assert first.hits > lru.hits


def test_replay_refuses_a_queue_on_a_trace_without_requests() -> None:
    trace = [Access(float(i), f"k{i % 3}", 1) for i in range(6)]
    with pytest.raises(ValueError, match="has no request number"):
        replay(trace, "lookahead", capacity_objects=2, queue=QueueModel(per_block=1.0))
    with pytest.raises(TypeError, match="queue must be a QueueModel"):
        replay(trace, "lookahead", capacity_objects=2, queue=0.8)  # type: ignore[arg-type]


# -- bench eviction --utilisation ------------------------------------------------------------------------------


def mooncake_file(tmp_path: Path, trace: list[Access]) -> Path:
    path = tmp_path / "kv.jsonl"
    by_req: dict[int, tuple[float, list[int]]] = {}
    for a in trace:
        by_req.setdefault(a.req, (a.t, []))[1].append(int(a.key.split(":")[0]) * 100 + int(a.key.split(":")[1]))
    path.write_text("".join(json.dumps({"timestamp": int(t * 1000), "input_length": 512 * len(ids),
                                        "output_length": 1, "hash_ids": ids}) + "\n"
                            for t, ids in by_req.values()))
    return path


def test_bench_utilisation_rows_are_what_replay_with_the_queue_gives(tmp_path: Path) -> None:
    from evocache.controller.replay import read_trace

    path, out = mooncake_file(tmp_path, random_kv_trace(4, requests=200)), tmp_path / "out.json"
    result = CliRunner().invoke(app, ["eviction", "--trace", str(path), "--sizes", "0.1", "--policies",
                                      "lru,lookahead", "--utilisation", "0.9", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "queue: one FIFO server" in result.output and "utilisation 0.9" in result.output
    report = json.loads(out.read_text())
    trace = list(read_trace(path))
    model = QueueModel.for_utilisation(trace, 0.9)
    backlog = Backlog.of(trace, model)
    assert report["queue"] == {"utilisation": 0.9, "per_block_s": model.per_block, "requests": 200,
                               "blocks": len(trace), "span_s": Load.of(trace).span,
                               "mean_waiting": backlog.mean, "max_waiting": backlog.most}
    assert backlog.most > 0
    assert (f"at a service start {backlog.mean:.1f} requests wait on average, {backlog.most} at most"
            in " ".join(result.output.split()))
    row = next(r for r in report["rows"] if r["policy"] == "lookahead")
    expected = replay(trace, "lookahead", capacity_objects=row["capacity"], queue=model)
    assert row["hit_ratio"] == expected.hit_ratio


def test_bench_utilisation_needs_a_kv_trace(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"t": i, "key": f"k{i % 3}", "size": 1}) + "\n" for i in range(6)))
    result = CliRunner().invoke(app, ["eviction", "--trace", str(path), "--policies", "lookahead",
                                      "--utilisation", "0.9", "--json", str(tmp_path / "o.json")])
    assert result.exit_code == 2
    assert "error: --utilisation: the queue model needs a KV-block (Mooncake) trace" in result.output


@pytest.mark.parametrize("value", ["1", "1.5", "0", "-0.5", "nan", "inf"])
def test_bench_utilisation_outside_0_1_is_refused_before_reading(tmp_path: Path, value: str) -> None:
    out = tmp_path / "o.json"
    result = CliRunner().invoke(app, ["eviction", "--trace", str(tmp_path / "never-read.jsonl"), "--policies",
                                      "lru,lookahead", "--utilisation", value, "--json", str(out)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (f"error: --utilisation: expected a number in (0, 1), got {float(value):g}: "
                             "at U >= 1 the queue grows without bound\n")
    assert not out.exists()


def test_bench_help_gives_the_utilisation_range() -> None:
    result = CliRunner().invoke(app, ["eviction", "--help"])
    text = " ".join(result.stdout.replace("│", " ").split())
    assert "U, in (0, 1) (at U >= 1 the queue grows without bound)" in text


def test_victim_in_a_namespace_of_protected_keys_only_takes_the_furthest_needed() -> None:
    policy = LookaheadPolicy()
    for key, ns in (("a", "t1"), ("b", "t1"), ("c", "t2")):
        policy.on_insert(key, EntryInfo(1, ns))
    policy.on_queue([QueuedRequest(1, ("b", "a", "c"))])
    assert [policy.victim("t1"), policy.victim("t2"), policy.victim()] == ["a", "c", "c"]
    with pytest.raises(KeyError):
        policy.victim("t3")


def test_bench_runs_the_lookahead_over_a_named_base(tmp_path: Path) -> None:
    from evocache.controller.replay import read_trace

    path, out = mooncake_file(tmp_path, random_kv_trace(5, requests=200)), tmp_path / "out.json"
    result = CliRunner().invoke(app, ["eviction", "--trace", str(path), "--sizes", "0.1", "--policies",
                                      "lru,lookahead:lfu", "--utilisation", "0.9", "--json", str(out)])
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads(out.read_text())["rows"] if r["policy"] == "lookahead:lfu")
    trace = list(read_trace(path))
    model = QueueModel.for_utilisation(trace, 0.9)
    cap = row["capacity"]
    expected = replay(trace, partial(make_eviction_policy, "lookahead", capacity=cap, base="lfu"), capacity_objects=cap, queue=model)
    assert row["hit_ratio"] == expected.hit_ratio
    assert expected.hit_ratio != replay(trace, "lookahead", capacity_objects=cap, queue=model).hit_ratio


def test_bench_reads_a_base_as_written_and_lookahead_over_lru_once(tmp_path: Path) -> None:
    path, out = mooncake_file(tmp_path, random_kv_trace(5, requests=50)), tmp_path / "out.json"
    result = CliRunner().invoke(app, ["eviction", "--trace", str(path), "--sizes", "0.1", "--policies",
                                      "lookahead, lookahead : lru, lookahead: lfu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    names = [r["policy"] for r in json.loads(out.read_text())["rows"]]
    assert names == ["lookahead", "lookahead:lfu", "belady"]  # lru runs as the gap's baseline, unlisted


@pytest.mark.parametrize(("name", "why"), [
    ("lookahead:lookahead", "the base must be another registered policy, one of arc, learned, learned-rank, lfu, "
                            "lru, lruk, s3fifo, weighted"),
    ("lookahead:nope", "the base must be another registered policy"),
    ("lru:lfu", "only lookahead takes a base policy"),
])
def test_bench_rejects_a_bad_base(tmp_path: Path, name: str, why: str) -> None:
    path = mooncake_file(tmp_path, random_kv_trace(5, requests=20))
    result = CliRunner().invoke(app, ["eviction", "--trace", str(path), "--policies", name,
                                      "--json", str(tmp_path / "o.json")])
    assert result.exit_code == 2
    assert f"error: --policies: {name!r}: {why}" in result.output


def test_a_learned_base_trains_in_the_background_when_the_owner_asks() -> None:
    policy = make_eviction_policy("lookahead", base="learned", background=True)
    try:
        assert policy.base._background is True  # type: ignore[attr-defined]
    finally:
        policy.close()
    assert make_eviction_policy("lookahead", base="learned").base._background is False  # type: ignore[attr-defined]


def test_a_base_built_by_name_shares_the_rng_and_a_given_one_is_used_as_is() -> None:
    rng = random.Random(3)
    policy = make_eviction_policy("lookahead", base="lfu", capacity=5, rng=rng)
    assert isinstance(policy.base, LFUPolicy) and policy.base.rng is rng is policy.rng
    assert isinstance(LookaheadPolicy().base, LRUPolicy)
    given = LFUPolicy()
    assert LookaheadPolicy(base=given).base is given


def test_a_bad_base_is_refused() -> None:
    with pytest.raises(ValueError, match="not 'lookahead' itself"):
        make_eviction_policy("lookahead", base="lookahead")
    with pytest.raises(ValueError, match="not a look-ahead itself"):
        LookaheadPolicy(base=LookaheadPolicy())
    with pytest.raises(TypeError, match="base must be an EvictionPolicy"):
        LookaheadPolicy(base="lfu")  # type: ignore[arg-type]
    held = LRUPolicy()
    held.on_insert("a", EntryInfo(1))
    with pytest.raises(ValueError, match="already tracks keys"):
        LookaheadPolicy(base=held)
    with pytest.raises(TypeError, match="background"):
        LookaheadPolicy(background=True)  # type: ignore[call-arg]
