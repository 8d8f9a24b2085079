"""``CachedFunction.lookup``: an exact hit without running the function, recorded as a hit; anything else None
with nothing recorded, so the process that computes the call records it once."""

from __future__ import annotations

from evocache.controller import CacheControl, EventsConfig, StoreConfig, build_runtime, cache_control, cache_if


def test_lookup_serves_hits_only_and_records_each_call_once():
    rt = build_runtime(StoreConfig(events=EventsConfig(sink="ring")))
    ran = []

    @cache_if("true", store=rt)
    def words(prompt: str):
        ran.append(prompt)
        yield from prompt.split()

    assert words.lookup("a b c") is None  # a miss: nothing ran, nothing recorded
    assert list(words("a b c")) == ["a", "b", "c"]
    hit = words.lookup("a b c")
    assert hit is not None and hit.value == ["a", "b", "c"] and hit.outcome.outcome == "hit"
    with cache_control(CacheControl(no_cache=True)):
        assert words.lookup("a b c") is None  # the caller wants a fresh answer: computing it is not ours
    rt.flush()
    outcomes = [e.outcome for e in rt.events.events()]
    assert outcomes == ["miss", "hit"] and ran == ["a b c"]
    assert words.cache_info().hits == 1 and words.cache_info().misses == 1
    rt.close()
