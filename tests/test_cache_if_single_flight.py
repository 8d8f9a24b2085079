"""Single flight: identical misses at the same time run the function once, for every kind of function. The
first to miss (the leader) computes; the others wait and are served its result as hits with reason
``coalesced``; a leader that fails or is abandoned leaves its followers to look up again, one of them
computing; tenants never share a flight.

The functions block on events the tests set once ``cache_info().waiting`` says the followers wait, so the
order of things is set by events, never by how long anything takes.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from _helpers import eventually

from evocache.controller import DiskConfig, StoreConfig, build_runtime, cache_if, tenant_scope
from evocache.dsl import parse_policy

POLICY = """
policy: p
version: 1
defaults: {ttl: 10m, tiers: [l1, l3]}
rules:
  - name: everything
    when: true
"""
FOLLOWERS = 7
COALESCED = "coalesced"  # the reason a follower's hit gives (docs/architecture.md, access events)


@pytest.fixture
def rt(tmp_path):
    runtime = build_runtime(StoreConfig(disk=DiskConfig(path=str(tmp_path / "l3"))), policy=parse_policy(POLICY))
    yield runtime
    runtime.close()


def run_all(calls):
    """Each callable in a thread of its own; returns their results (an exception stands for itself)."""
    results: list = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    return threads, results


def join(threads):
    for t in threads:
        t.join(30)
        assert not t.is_alive()


def test_identical_sync_misses_run_the_function_once_and_the_followers_hit_coalesced(rt):
    runs, release = [], threading.Event()

    @cache_if("true", store=rt, name="answer-0")
    def answer(prompt: str) -> dict:
        runs.append(prompt)
        release.wait(30)
        return {"text": prompt.upper()}

    threads, results = run_all([lambda: answer.call("hello")] * (1 + FOLLOWERS))
    eventually(lambda: answer.cache_info().waiting == FOLLOWERS, message="the followers to wait")
    release.set()
    join(threads)
    assert runs == ["hello"]
    assert all(r.value == {"text": "HELLO"} for r in results)
    assert len({id(r.value) for r in results}) == len(results)  # each caller has its own copy, as a hit does
    (leader,) = [r.outcome for r in results if r.outcome.outcome == "miss"]
    followers = [r.outcome for r in results if r.outcome.outcome == "hit"]
    assert leader.stored == ("l1", "l3") and len(followers) == FOLLOWERS
    assert {(f.reason, f.tier, f.key, f.size) for f in followers} == {(COALESCED, "l1", leader.key, leader.size)}
    assert answer.cache_info().waiting == 0 and answer.cache_info().hits == FOLLOWERS
    events = rt.events.events()
    assert sorted((e.outcome, e.reason) for e in events) == [("hit", COALESCED)] * FOLLOWERS + [("miss", "")]


def test_tenants_never_share_a_flight(rt):
    runs, release = [], threading.Event()

    @cache_if("true", store=rt, name="answer-1")
    def answer(prompt: str) -> str:
        runs.append(prompt)
        release.wait(30)
        return prompt.upper()

    def as_tenant(tenant):
        with tenant_scope(tenant):
            return answer.call("same prompt")

    threads, results = run_all([lambda: as_tenant("acme"), lambda: as_tenant("globex")])
    eventually(lambda: len(runs) == 2, message="each tenant's call to run the function")
    assert answer.cache_info().waiting == 0
    release.set()
    join(threads)
    assert [r.outcome.outcome for r in results] == ["miss", "miss"]


def test_a_failing_leader_fails_only_itself_and_a_follower_computes(rt):
    runs, release = [], threading.Event()

    @cache_if("true", store=rt, name="answer-2")
    def answer(prompt: str) -> str:
        runs.append(prompt)
        release.wait(30)
        if len(runs) == 1:
            raise RuntimeError("the leader fails")
        return prompt.upper()

    threads, results = run_all([lambda: answer.call("hello")] * 4)
    eventually(lambda: answer.cache_info().waiting == 3, message="the followers to wait")
    release.set()
    join(threads)
    failed = [r for r in results if isinstance(r, RuntimeError)]
    served = [r for r in results if not isinstance(r, RuntimeError)]
    assert len(failed) == 1 and len(runs) == 2  # one follower took over; the others were served its answer
    assert all(r.value == "HELLO" for r in served)
    assert sorted(r.outcome.outcome for r in served) == ["hit", "hit", "miss"]


def test_an_abandoned_stream_leader_leaves_its_followers_whole_answers(rt):
    runs = []

    @cache_if("true", store=rt, name="answer-3")
    def answer(prompt: str):
        runs.append(prompt)
        yield from prompt.split()

    leader = answer.call("one two three")
    assert next(leader) == "one"  # the leader's stream is under way, suspended after its first piece
    threads, results = run_all([lambda: (list(s := answer.call("one two three")), s.handle.outcome)] * 3)
    eventually(lambda: answer.cache_info().waiting == 3, message="the followers to wait")
    leader.close()  # its caller went away: it shares nothing
    join(threads)
    assert leader.handle.outcome.rejected == "incomplete"
    assert [pieces for pieces, _ in results] == [["one", "two", "three"]] * 3
    assert len(runs) == 2 and sorted(o.outcome for _, o in results) == ["hit", "hit", "miss"]


def test_identical_streams_replay_the_leaders_chunks_once_it_ends(rt):
    runs, release = [], threading.Event()

    @cache_if("true", store=rt, name="answer-4")
    def answer(prompt: str):
        runs.append(prompt)
        yield "a"
        release.wait(30)
        yield "b"

    threads, results = run_all([lambda: (list(s := answer.call("p")), s.handle.outcome)] * (1 + FOLLOWERS))
    eventually(lambda: answer.cache_info().waiting == FOLLOWERS, message="the followers to wait")
    release.set()
    join(threads)
    assert runs == ["p"] and [pieces for pieces, _ in results] == [["a", "b"]] * (1 + FOLLOWERS)
    assert sorted((o.outcome, o.reason) for _, o in results) == [("hit", COALESCED)] * FOLLOWERS + [("miss", "")]


def test_one_consumer_interleaving_two_streams_of_a_key_does_not_wait_for_itself(rt):
    @cache_if("true", store=rt, name="answer-5")
    def answer(prompt: str):
        yield from prompt.split()

    first, second = answer.call("x y"), answer.call("x y")
    assert next(first) == "x" and list(second) == ["x", "y"] and list(first) == ["y"]
    assert (first.handle.outcome.outcome, second.handle.outcome.outcome) == ("miss", "miss")


def test_async_functions_and_async_streams_coalesce_on_the_event_loop(rt):
    runs = []

    @cache_if("true", store=rt, ignore=("gate",))
    async def answer(prompt: str, gate: asyncio.Event) -> str:
        runs.append(prompt)
        await gate.wait()
        return prompt.upper()

    @cache_if("true", store=rt, ignore=("gate",))
    async def pieces(prompt: str, gate: asyncio.Event):
        runs.append(prompt)
        await gate.wait()
        for word in prompt.split():
            yield word

    async def drain(stream):
        return [p async for p in stream], stream.handle.outcome

    async def main():
        gate = asyncio.Event()
        calls = [asyncio.ensure_future(answer.call("hi", gate)) for _ in range(1 + FOLLOWERS)]
        streams = [asyncio.ensure_future(drain(pieces.call("a b", gate))) for _ in range(1 + FOLLOWERS)]
        while answer.cache_info().waiting < FOLLOWERS or pieces.cache_info().waiting < FOLLOWERS:
            await asyncio.sleep(0)  # lets the calls run up to their waits
        gate.set()
        return await asyncio.gather(*calls), await asyncio.gather(*streams)

    called, streamed = asyncio.run(asyncio.wait_for(main(), 30))
    assert runs == ["hi", "a b"]
    assert [c.value for c in called] == ["HI"] * (1 + FOLLOWERS)
    assert [p for p, _ in streamed] == [["a", "b"]] * (1 + FOLLOWERS)
    for outcomes in ([c.outcome for c in called], [o for _, o in streamed]):
        assert sorted((o.outcome, o.reason) for o in outcomes) == [("hit", COALESCED)] * FOLLOWERS + [("miss", "")]
