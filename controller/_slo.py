"""Per-rule SLO circuit breakers: a rule that breaks its service objectives runs in a safe mode for a while.

Each rule of the policy in force whose ``slo`` sets an objective (``Policy.slos``: its own over the policy's,
field by field) has a ``SloBreaker``, measured on its own:

- lookups: the seconds of every ``hit`` and ``miss`` decision of the rule (what ``CachedFunction._emit``
  measures: cache time, the function's excluded; a semantic lookup's embedding included). L1 hits served by
  the hit path are counted without touching that path: the breaker reads their number from the rule's L1-hit
  cells of the decision histogram, and counts them as lookups within the objective (they take microseconds).
- verdicts: exploration verdicts of the semantic layer (a would-be hit the model answered anyway, judged) and
  ``feedback(correct=...)`` on served semantic hits. A verdict says whether serving would have been, or was,
  wrong.

Over the last ``window`` (``SLICES`` slices, each expiring whole), with at least ``min_samples`` of the
measurement concerned (and at least ``P99_MIN_LOOKUPS`` lookups for the p99), the rule trips when the wrong
share of its verdicts exceeds ``max_error_rate`` or its lookup p99 exceeds ``p99_ms`` (more than 1 % of its
lookups slower: the p99 by nearest rank is above the limit exactly then). Tripped, it is ``open`` for ``cool_down``: its calls run in safe mode, ``semantic-off`` (exact
caching only; their events carry reason ``slo-breaker``) or ``bypass`` (no cache; a bypass event with reason
``slo-breaker``). Then ``half-open``: a fraction ``probe`` of its calls (every ``round(1 / probe)``-th, the
first one included) run normally, the rest stay safe, and only the probes are measured, from zero. Once the
probes hold ``min_samples`` of the measurement that tripped it and break nothing, it closes (a fresh window);
as soon as their measurements break an objective, it opens again. Too few probe measurements decide
nothing: the rule stays half-open. Calls in safe mode are not measured.

Each transition is an access event (outcome ``slo-open``, ``slo-half-open`` or ``slo-closed``, the rule, the
reason: ``error-rate`` or ``p99`` for an opening, ``cool-down`` for half-open, ``probes-held`` for closing)
and is counted in the metrics (``evocache_slo_state`` per rule: 0 closed, 1 half-open, 2 open;
``evocache_slo_transitions_total`` by rule and state entered).

The request path asks little: the L1 hit path checks one set (rules tripped to ``bypass``), the full path one
dict (rules open or half-open); both are empty while every rule holds. Time comes from the runtime's
``clock``, so tests drive the breaker without sleeping.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._metrics import CacheMetrics
from ._types import L1

if TYPE_CHECKING:
    from evocache.dsl import Policy, SloSpec

    from ._contract import Plan
    from ._events import EventSink

log = logging.getLogger("evocache.controller.slo")

CLOSED, HALF_OPEN, OPEN = "closed", "half-open", "open"
STATES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the value of evocache_slo_state
SLO_REASON = "slo-breaker"  # the reason of the decisions a tripped rule makes in safe mode
SLICES = 10  # a window is this many slices; a slice's measurements expire together
ERROR_RATE, P99 = "error-rate", "p99"
# A p99 needs 100 lookups to mean anything: with fewer, "more than 1 % slower" is "any one slower", and a single
# cold start (an embedder loading on the first semantic lookup) would trip the rule.
P99_MIN_LOOKUPS = 100

# A tally is a list, for speed: [lookups, slow lookups, verdicts, wrong verdicts].
_LOOKUPS, _SLOW, _VERDICTS, _WRONG = range(4)


def _hits_counted(cells: list[float] | None) -> float:
    # The cells are a count per latency bucket, then the sum of seconds (controller._metrics).
    return 0.0 if cells is None else sum(cells) - cells[-1]


class SloBreaker:
    """The breaker of one rule under ``spec`` (a resolved ``SloSpec``); see the module docstring.

    ``observe`` and ``verdict`` take measurements, ``admit`` says whether a call runs normally.
    ``notify(rule, state, reason)`` is told of every transition, after the breaker's lock is released.
    ``l1_hits()``: how many L1 hits of the rule the decision histogram has counted so far. Thread-safe: state
    changes under a lock.
    """

    __slots__ = (
        "rule", "spec", "state", "reason", "transitions", "opened_until", "_clock", "_notify", "_l1_hits",
        "_lock", "_slice", "_slices", "_totals", "_probes", "_admitted", "_every", "_l1_seen", "_slow_s",
        "retired",
    )

    def __init__(
        self, rule: str, spec: SloSpec, *, clock: Callable[[], float],
        notify: Callable[[str, str, str], None], l1_hits: Callable[[], float],
    ) -> None:
        if spec.window is None or spec.min_samples is None or spec.cool_down is None or spec.probe is None:
            raise ValueError(f"rule {rule!r}: the breaker takes a resolved SloSpec (SloSpec.resolved())")
        self.rule = rule
        self.spec = spec
        self.state = CLOSED
        self.reason = ""  # what opened it last: ERROR_RATE or P99
        self.transitions = 0  # a verdict on a hit served under another state than now's is not counted
        self.opened_until = 0.0
        self.retired = False  # its policy is no longer in force: it measures and decides nothing
        self._clock = clock
        self._notify = notify
        self._l1_hits = l1_hits
        self._lock = threading.Lock()
        self._slice = spec.window / SLICES
        self._slices: deque[list[float]] = deque()  # [slice index, *tally], oldest first
        self._totals = [0.0, 0.0, 0.0, 0.0]  # the window's tally: the sum of its slices'
        self._probes = [0.0, 0.0, 0.0, 0.0]  # half-open: what the probes measured
        self._admitted = 0  # calls admitted since half-open (every _every-th is a probe)
        self._every = max(1, round(1 / spec.probe))
        self._l1_seen = l1_hits()  # hits counted before the breaker existed are not its window's
        self._slow_s = spec.p99_ms / 1000.0 if spec.p99_ms is not None else float("inf")

    # -- measurements ------------------------------------------------------------------------------------

    def observe(self, seconds: float, l1_hit: bool = False) -> None:
        """One lookup of the rule took ``seconds``; ``l1_hit``: it was an L1 hit, already in the histogram
        cells the breaker reads the hit path's hits from (so it is not counted twice)."""
        if self.retired:
            return
        now = self._clock()
        change = None
        with self._lock:
            hot = self._hot_hits(l1_hit)
            slow = seconds > self._slow_s
            if self.state == CLOSED:
                cell = self._current(now)
                cell[1 + _LOOKUPS] += 1 + hot
                cell[1 + _SLOW] += slow
                self._totals[_LOOKUPS] += 1 + hot
                self._totals[_SLOW] += slow
                change = self._judge_window(now)
            elif self.state == HALF_OPEN:
                self._probes[_LOOKUPS] += 1
                self._probes[_SLOW] += slow
                change = self._judge_probes(now)
        if change is not None:
            self._notify(self.rule, *change)

    def verdict(self, wrong: bool, mark: int | None = None) -> None:
        """A semantic verdict on one of the rule's answers (``wrong``: it was, or would have been, wrong).
        ``mark``: ``transitions`` when that answer was served; a verdict from before the last transition is
        dropped (it judges the rule as it ran then)."""
        if self.retired or (mark is not None and mark != self.transitions):
            return
        now = self._clock()
        change = None
        with self._lock:
            if self.state == CLOSED:
                cell = self._current(now)
                cell[1 + _VERDICTS] += 1
                cell[1 + _WRONG] += wrong
                self._totals[_VERDICTS] += 1
                self._totals[_WRONG] += wrong
                change = self._judge_window(now)
            elif self.state == HALF_OPEN:
                self._probes[_VERDICTS] += 1
                self._probes[_WRONG] += wrong
                change = self._judge_probes(now)
        if change is not None:
            self._notify(self.rule, *change)

    def _hot_hits(self, l1_hit: bool) -> float:
        """L1 hits the hit path served since the last measurement (it counts them in the histogram only)."""
        counted = self._l1_hits()
        hot = counted - self._l1_seen - l1_hit
        self._l1_seen = counted
        return hot if hot > 0 and self.state == CLOSED else 0.0

    def _current(self, now: float) -> list[float]:
        """The tally of the slice ``now`` falls in; slices past the window are dropped from the totals."""
        index = int(now // self._slice)
        slices = self._slices
        if slices and slices[-1][0] >= index:  # the same slice, or a clock stepped back: the latest one
            return slices[-1]
        while slices and slices[0][0] <= index - SLICES:
            old = slices.popleft()
            for i in range(4):
                self._totals[i] -= old[1 + i]
        cell = [float(index), 0.0, 0.0, 0.0, 0.0]
        slices.append(cell)
        return cell

    def _breaks(self, tally: list[float]) -> str | None:
        """The objective ``tally`` breaks with enough samples to say so, if any."""
        spec, enough = self.spec, self.spec.min_samples
        if (spec.max_error_rate is not None and tally[_VERDICTS] >= enough
                and tally[_WRONG] > spec.max_error_rate * tally[_VERDICTS]):
            return ERROR_RATE
        if (spec.p99_ms is not None and tally[_LOOKUPS] >= max(enough, P99_MIN_LOOKUPS)
                and tally[_SLOW] * 100 > tally[_LOOKUPS]):
            return P99
        return None

    def _judge_window(self, now: float) -> tuple[str, str] | None:
        broken = self._breaks(self._totals)
        if broken is None:
            return None
        totals, spec = self._totals, self.spec
        if broken == ERROR_RATE:
            what = (f"{totals[_WRONG]:.0f} of {totals[_VERDICTS]:.0f} verdicts wrong "
                    f"(max_error_rate {spec.max_error_rate:g})")
        else:
            what = f"{totals[_SLOW]:.0f} of {totals[_LOOKUPS]:.0f} lookups over {spec.p99_ms:g} ms"
        log.warning(
            "rule %s breaks its slo: %s in %gs; %s for %gs", self.rule, what, spec.window, spec.trip_to,
            spec.cool_down,
        )
        return self._open(now, broken)

    def _judge_probes(self, now: float) -> tuple[str, str] | None:
        broken = self._breaks(self._probes)
        if broken is not None:
            return self._open(now, broken)
        needed = _VERDICTS if self.reason == ERROR_RATE else _LOOKUPS
        least = self.spec.min_samples if needed == _VERDICTS else max(self.spec.min_samples, P99_MIN_LOOKUPS)
        if self._probes[needed] < least:
            return None  # inconclusive: no pass
        return self._enter(CLOSED, "probes-held")

    # -- states ------------------------------------------------------------------------------------------

    def _open(self, now: float, reason: str) -> tuple[str, str]:
        self.reason = reason
        self.opened_until = now + self.spec.cool_down
        return self._enter(OPEN, reason)

    def _enter(self, state: str, reason: str) -> tuple[str, str]:
        self.state = state
        self.transitions += 1
        # Every state measures from zero: the window that tripped it would trip it again at once.
        self._slices.clear()
        self._totals = [0.0, 0.0, 0.0, 0.0]
        self._probes = [0.0, 0.0, 0.0, 0.0]
        self._admitted = 0
        self._l1_seen = self._l1_hits()
        return state, reason

    def admit(self) -> bool:
        """Whether a call of the rule runs normally now (closed, or a half-open probe); False: safe mode.
        An open breaker whose cool-down is over turns half-open here, at the first call after it."""
        if self.retired or self.state == CLOSED:
            return True
        change = None
        if self.state == OPEN:
            if self._clock() < self.opened_until:
                return False
            with self._lock:
                if self.state == OPEN and self._clock() >= self.opened_until:
                    change = self._enter(HALF_OPEN, "cool-down")
            if change is not None:
                self._notify(self.rule, *change)
        # Counted without the lock: a lost increment only moves which call is the next probe.
        admitted = self._admitted
        self._admitted = admitted + 1
        return self.state == CLOSED or (self.state == HALF_OPEN and admitted % self._every == 0)

    def __repr__(self) -> str:
        return f"SloBreaker({self.rule!r}, {self.state}, transitions={self.transitions})"


class SloBreakers:
    """The breakers of one policy's rules (``Policy.slos``), what the runtime holds (``CacheRuntime.slo``).

    ``by_rule``: every breaker by rule name (empty: nothing to watch; the request path then does nothing
    more). ``tripped``: the rules open or half-open, with their breakers; ``bypassing``: those of them whose
    safe mode is ``bypass`` (the L1 hit path's one check). Both are updated in place on every transition, so
    what a runtime hands to the hit path stays current.

    Transitions are recorded as access events in ``events`` with the policy's ref, and counted in
    ``metrics``, labelled by policy ref and rule (a canary's rules are other breakers than the active's of the
    same name); a rule's series appear at its first transition. A policy swap builds a new set (every rule
    closed: a changed policy is judged afresh) and ``retire``s this one.
    """

    def __init__(
        self, policy: Policy | None, *, clock: Callable[[], float], metrics: CacheMetrics, events: EventSink,
    ) -> None:
        self.policy = policy
        self.policy_ref = policy.ref if policy is not None else ""
        self.clock = clock
        self.metrics = metrics
        self.events = events
        self.tripped: dict[str, SloBreaker] = {}
        self.bypassing: set[str] = set()
        slos = policy.slos if policy is not None else {}
        decisions = metrics.decisions
        self.by_rule: dict[str, SloBreaker] = {
            rule: SloBreaker(
                rule, spec, clock=clock, notify=self._changed,
                l1_hits=lambda cells_of=(rule, L1, "hit"): _hits_counted(decisions.get(cells_of)),
            )
            for rule, spec in slos.items()
        }

    def _changed(self, rule: str, state: str, reason: str) -> None:
        breaker = self.by_rule[rule]
        # By the breaker's state now, not the one notified: two threads' notices may arrive out of order.
        now = breaker.state
        if now == CLOSED:
            self.tripped.pop(rule, None)
            self.bypassing.discard(rule)
        else:
            self.tripped[rule] = breaker
            if breaker.spec.trip_to == "bypass":
                self.bypassing.add(rule)
        self.metrics.slo_transition(self.policy_ref, rule, state, STATES[now])
        # A plain tuple in AccessEvent field order (controller._events).
        self.events.record((
            self.clock(), "", "", rule, self.policy_ref, f"slo-{state}", None, 0, 0.0, 0.0, "", reason, None,
        ))

    def admit(self, plan: Plan) -> Plan | None:
        """The plan a call of a tripped rule runs: ``plan`` itself when it runs normally (a probe), a copy
        without semantic lookup (reason ``slo-breaker``) in ``semantic-off`` safe mode, None in ``bypass``
        safe mode (the caller bypasses the cache with reason ``slo-breaker``)."""
        breaker = self.tripped.get(plan.rule)
        if breaker is None or breaker.admit():
            return plan
        if breaker.spec.trip_to == "bypass":
            return None
        return dataclasses.replace(plan, semantic=None, reason=SLO_REASON)

    def verdict(self, rule: str, wrong: bool) -> None:
        """A semantic verdict on an answer of ``rule`` (ignored for a rule without a breaker)."""
        breaker = self.by_rule.get(rule)
        if breaker is not None:
            breaker.verdict(wrong)

    def mark(self, rule: str) -> tuple[SloBreaker, int] | None:
        """What a served hit keeps for the verdict that may follow (``SloBreaker.verdict``'s ``mark``)."""
        breaker = self.by_rule.get(rule)
        return None if breaker is None else (breaker, breaker.transitions)

    def states(self) -> dict[str, str]:
        """``{rule: state}`` of every breaker."""
        return {rule: breaker.state for rule, breaker in self.by_rule.items()}

    def serves(self, policy: Policy | None, clock: Callable[[], float], metrics: CacheMetrics,
               events: EventSink) -> bool:
        """Whether this set is the one for a runtime with these parts (else the runtime builds its own)."""
        return (self.policy is policy and self.clock is clock and self.metrics is metrics
                and self.events is events)

    def retire(self) -> None:
        """Its policy left: the breakers stop measuring and deciding, and their state metrics go."""
        for rule, breaker in self.by_rule.items():
            breaker.retired = True
            if breaker.transitions:
                self.metrics.slo_forget(self.policy_ref, rule)
        self.tripped.clear()
        self.bypassing.clear()

    def __bool__(self) -> bool:
        return bool(self.by_rule)

    def __repr__(self) -> str:
        return f"SloBreakers({self.policy_ref or 'no policy'}, {self.states()})"
