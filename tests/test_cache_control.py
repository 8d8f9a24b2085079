"""A caller's per-call directives (``controller.cache_control``): no-store serves but stores nothing, no-cache
looks nothing up and stores the fresh answer, max-age refuses older entries, ttl shortens what is stored, and a
rule's ``client_controls`` decides which of them a caller may give."""

from __future__ import annotations

import pytest
from _helpers import FakeClock

from evocache.controller import (
    NO_STORE,
    REFRESH,
    CacheControl,
    StoreConfig,
    build_runtime,
    cache_control,
    cache_if,
)
from evocache.dsl import parse_policy

POLICY = """
policy: controls
version: 1
fields: {x: int}
defaults: {ttl: 10m}
rules:
  - name: locked
    when: x >= 100
    client_controls: []
  - name: only-refresh
    when: x >= 50
    client_controls: [no-cache]
"""


@pytest.fixture
def rt():
    runtime = build_runtime(StoreConfig(), policy=parse_policy(POLICY), clock=FakeClock())
    yield runtime
    runtime.close()


@pytest.fixture
def f(rt):
    calls = []

    @cache_if("true", store=rt)
    def f(x: int) -> str:
        calls.append(x)
        return f"answer {x} #{len(calls)}"

    f.calls = calls
    return f


def outcome(f, x, control=None):
    with cache_control(control):
        return f.call(x).outcome


def test_no_store_serves_a_hit_and_stores_no_miss(f):
    first = outcome(f, 1, CacheControl(no_store=True))
    assert (first.outcome, first.stored, first.rejected) == ("miss", (), NO_STORE)
    assert outcome(f, 1).outcome == "miss"  # nothing was stored
    assert outcome(f, 1, CacheControl(no_store=True)).outcome == "hit"  # what is stored is still served
    assert f.calls == [1, 1]


def test_no_cache_recomputes_and_stores_the_fresh_answer(f):
    assert f(2) == "answer 2 #1"
    fresh = outcome(f, 2, CacheControl(no_cache=True))
    assert (fresh.outcome, fresh.reason, fresh.stored) == ("miss", REFRESH, ("l1",))
    assert f(2) == "answer 2 #2"  # the plain call is now served the refreshed answer


def test_max_age_refuses_older_entries_for_that_call_only(f, rt):
    f(3)
    rt.clock.advance(60)
    assert outcome(f, 3, CacheControl(max_age_s=120)).outcome == "hit"
    assert outcome(f, 3, CacheControl(max_age_s=30)).outcome == "miss"  # and its fresh answer is stored
    assert outcome(f, 3, CacheControl(max_age_s=30)).outcome == "hit"
    assert f.calls == [3, 3]


def test_ttl_shortens_what_the_call_stores_and_never_lengthens_it(f, rt):
    outcome(f, 4, CacheControl(ttl_s=5))
    outcome(f, 5, CacheControl(ttl_s=3600 * 24))
    rt.clock.advance(6)
    assert outcome(f, 4).outcome == "miss"
    rt.clock.advance(600)  # past the rule's ten minutes
    assert outcome(f, 5).outcome == "miss"


def test_a_rule_decides_which_directives_a_caller_may_give(f):
    f(100)
    locked = outcome(f, 100, CacheControl(no_cache=True, no_store=True))
    assert (locked.outcome, locked.reason) == ("hit", "")  # client_controls: [] ignores them all
    f(50)
    refreshed = outcome(f, 50, CacheControl(no_cache=True, no_store=True))
    assert (refreshed.outcome, refreshed.reason, refreshed.stored) == ("miss", REFRESH, ("l1",))  # no-store ignored
    assert f.calls == [100, 50, 50]


def test_a_control_takes_the_full_path_even_for_an_l1_hit(f):
    f(6)
    f(6)  # the L1 hit path
    assert outcome(f, 6, CacheControl(no_cache=True)).outcome == "miss"
    with cache_control(CacheControl(no_cache=True)):
        assert f(6) == "answer 6 #3"  # a plain call under the control, not the memoised L1 hit


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_age_s"):
        CacheControl(max_age_s=-1)
    with pytest.raises(ValueError, match="ttl_s"):
        CacheControl(ttl_s=float("nan"))
