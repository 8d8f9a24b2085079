"""SLO circuit breakers per rule and tenant: a tenant whose calls of a rule break its service objectives runs
in a safe mode for a while; the rule as a whole does only when several tenants' do.

Each rule of the policy in force whose ``slo`` sets an objective (``Policy.slos``: its own over the policy's,
field by field) has a ``RuleBreakers``: one ``SloBreaker`` per tenant (namespace) that has called it, each
measured on that tenant's calls alone, so one tenant's traffic never moves another's breaker:

- lookups: the seconds of every ``hit`` and ``miss`` decision (what ``CachedFunction._emit`` measures: cache
  time, the function's excluded; a semantic lookup's embedding included). L1 hits served by the hit path are
  counted without touching that path: a plan of a rule with a ``p99_ms`` carries its tenant's tally
  (``SloBreakers.l1_tally``), one cell the hit path adds one to, and the breaker counts those hits as lookups
  within the objective (they take microseconds).
- verdicts: exploration verdicts of the semantic layer (a would-be hit the model answered anyway, judged) and
  ``feedback(correct=...)`` on served semantic hits. A verdict says whether serving would have been, or was,
  wrong.

Over the last ``window`` (``SLICES`` slices, each expiring whole), with at least ``min_samples`` of the
measurement concerned (and at least ``P99_MIN_LOOKUPS`` lookups for the p99), a breaker trips when the wrong
share of its verdicts exceeds ``max_error_rate`` or its lookup p99 exceeds ``p99_ms`` (more than 1 % of its
lookups slower: the p99 by nearest rank is above the limit exactly then). Tripped, it is ``open`` for
``cool_down``: the tenant's calls of the rule run in safe mode, ``semantic-off`` (exact caching only; their
events carry reason ``slo-breaker``) or ``bypass`` (no cache; a bypass event with reason ``slo-breaker``).
Then ``half-open``: a fraction ``probe`` of those calls (every ``round(1 / probe)``-th, the first one
included) run normally, the rest stay safe, and only the probes are measured, from zero. Once the probes hold
``min_samples`` of the measurement that tripped it and break nothing, it closes (a fresh window); as soon as
their measurements break an objective, it opens again. Too few probe measurements decide nothing: the breaker
stays half-open. Calls in safe mode are not measured.

Rule-wide: while at least ``rule_wide_tenants`` tenants' breakers of a rule are open within their cool-down,
the rule runs in safe mode for every tenant, until the cool-down of the last of those that keep the count
there ends (the ``rule_wide_tenants``-th latest end). A tenant whose own breaker is open or half-open follows
its own breaker even then, so its probes run and the rule can recover; the calls of the others are not
measured. Below that count, a tenant's calls of the rule run exactly as if no other tenant had tripped
anything: the same path, the same decisions, the same event reasons.

Memory is bounded: a rule keeps at most ``max_tenants`` breakers (``MAX_TENANT_BREAKERS``), least recently
used first out, closed ones before tripped ones; a tripped one dropped (every breaker kept is tripped) closes
with reason ``evicted``, so its tenant's calls run normally again. A tenant whose breaker was dropped is
measured afresh at its next call.

Each transition is an access event (outcome ``slo-open``, ``slo-half-open`` or ``slo-closed``, the rule, the
namespace of the tenant whose breaker moved in ``ns``, the reason: ``error-rate`` or ``p99`` for an opening,
``cool-down`` for half-open, ``probes-held`` or ``evicted`` for closing). A rule-wide transition has ``ns``
empty (no namespace is): ``slo-open`` with reason ``tenants``, ``slo-closed`` with reason ``cool-down``. The
metrics count them (``evocache_slo_state`` by policy, rule and ns, ``""`` the rule-wide state: 0 closed,
1 half-open, 2 open; a tenant's series from its breaker's first transition until the breaker is dropped;
``evocache_slo_transitions_total`` by policy, rule, scope ``tenant`` or ``rule`` and state entered).

The request path asks little: the L1 hit path checks one set (``(rule, ns)`` pairs, and rules, tripped to
``bypass``), the full path one dict (rules with a breaker open or half-open, or tripped rule-wide); both are
empty while every breaker holds. Time comes from the runtime's ``clock``, so tests drive the breakers without
sleeping.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._metrics import CacheMetrics
from ._types import Namespace

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
# The reasons of a rule-wide opening, and of a tripped breaker's closing when it is dropped.
TENANTS, EVICTED = "tenants", "evicted"
RULE_WIDE = Namespace("")  # the ns of the rule-wide state's events and series: no tenant's namespace is empty
# Breakers kept per rule: at least the dsl's largest rule_wide_tenants (1000), so any count can be reached.
MAX_TENANT_BREAKERS = 1024
# A p99 needs 100 lookups to mean anything: with fewer, "more than 1 % slower" is "any one slower", and a single
# cold start (an embedder loading on the first semantic lookup) would trip the rule.
P99_MIN_LOOKUPS = 100

# A tally is a list, for speed: [lookups, slow lookups, verdicts, wrong verdicts].
_LOOKUPS, _SLOW, _VERDICTS, _WRONG = range(4)


class L1Tally(list):
    """One cell: the L1 hits the hit path served one tenant's calls of one rule. A list, so that path adds
    to it as cheaply as to its metric cells; weakly referenced, so it lives as long as a plan or a breaker
    holds it (``SloBreakers.l1_tally``)."""

    __slots__ = ("__weakref__",)


def _no_hits() -> float:
    return 0.0


class SloBreaker:
    """The breaker of one tenant's calls (namespace ``ns``) of one rule under ``spec`` (a resolved
    ``SloSpec``); see the module docstring.

    ``observe`` and ``verdict`` take measurements, ``admit`` says whether a call runs normally.
    ``notify(breaker, state, reason)`` is told of every transition, after the breaker's lock is released.
    ``l1_hits()``: how many L1 hits of the tenant's calls of the rule the hit path has counted so far.
    Thread-safe: state changes under a lock.
    """

    __slots__ = (
        "rule", "ns", "spec", "state", "reason", "transitions", "opened_until", "_clock", "_notify",
        "_l1_hits", "_lock", "_slice", "_slices", "_totals", "_probes", "_admitted", "_every", "_l1_seen",
        "_slow_s", "retired",
    )

    def __init__(
        self, rule: str, spec: SloSpec, *, clock: Callable[[], float],
        notify: Callable[[SloBreaker, str, str], None], l1_hits: Callable[[], float] = _no_hits,
        ns: Namespace = RULE_WIDE,
    ) -> None:
        if spec.window is None or spec.min_samples is None or spec.cool_down is None or spec.probe is None:
            raise ValueError(f"rule {rule!r}: the breaker takes a resolved SloSpec (SloSpec.resolved())")
        self.rule = rule
        self.ns = ns
        self.spec = spec
        self.state = CLOSED
        self.reason = ""  # what opened it last: ERROR_RATE or P99
        self.transitions = 0  # a verdict on a hit served under another state than now's is not counted
        self.opened_until = 0.0
        self.retired = False  # its policy left, or it was dropped: it measures and decides nothing
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

    def observe(self, seconds: float) -> None:
        """One lookup of the tenant's call of the rule took ``seconds`` (the full path's: the hit path's L1
        hits are read from ``l1_hits``)."""
        if self.retired:
            return
        now = self._clock()
        change = None
        with self._lock:
            hot = self._hot_hits()
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
            self._notify(self, *change)

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
            self._notify(self, *change)

    def _hot_hits(self) -> float:
        """L1 hits the hit path served since the last measurement (it counts them in a tally only)."""
        counted = self._l1_hits()
        hot = counted - self._l1_seen
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
            "rule %s breaks its slo for %s: %s in %gs; %s for %gs", self.rule, self.ns, what, spec.window,
            spec.trip_to, spec.cool_down,
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
                self._notify(self, *change)
        # Counted without the lock: a lost increment only moves which call is the next probe.
        admitted = self._admitted
        self._admitted = admitted + 1
        return self.state == CLOSED or (self.state == HALF_OPEN and admitted % self._every == 0)

    def __repr__(self) -> str:
        return f"SloBreaker({self.rule!r}, {self.ns!r}, {self.state}, transitions={self.transitions})"


class RuleBreakers:
    """One rule's breakers: ``breakers`` by namespace (least recently measured first, at most
    ``SloBreakers.max_tenants``), ``tripped`` the namespaces whose breaker is open or half-open, and the
    rule-wide state (``wide``, until ``wide_until``). Plain state: ``SloBreakers`` changes it, under
    ``lock``."""

    __slots__ = ("rule", "spec", "breakers", "tripped", "wide", "wide_until", "wide_moved", "lock")

    def __init__(self, rule: str, spec: SloSpec) -> None:
        if spec.rule_wide_tenants is None:
            raise ValueError(f"rule {rule!r}: the breakers take a resolved SloSpec (SloSpec.resolved())")
        self.rule = rule
        self.spec = spec
        self.breakers: OrderedDict[Namespace, SloBreaker] = OrderedDict()
        self.tripped: set[Namespace] = set()
        self.wide = False
        self.wide_until = 0.0
        self.wide_moved = False  # the rule-wide state has had a transition (its series exists)
        self.lock = threading.Lock()

    def wide_end(self) -> float:
        """When the rule-wide state ends: the ``rule_wide_tenants``-th latest end of a cool-down among the
        tenants' open breakers (0.0 with fewer of them)."""
        breakers = [self.breakers.get(ns) for ns in self.tripped]
        ends = sorted((b.opened_until for b in breakers if b is not None and b.state == OPEN), reverse=True)
        n = self.spec.rule_wide_tenants
        return ends[n - 1] if len(ends) >= n else 0.0

    def victim(self) -> SloBreaker:
        """The breaker to drop for a new one: the least recently measured closed one, else the least recently
        measured one."""
        for breaker in self.breakers.values():
            if breaker.state == CLOSED:
                return breaker
        return next(iter(self.breakers.values()))

    def __repr__(self) -> str:
        wide = ", rule-wide" if self.wide else ""
        tripped = sorted(self.tripped)
        return f"RuleBreakers({self.rule!r}, {len(self.breakers)} tenants, tripped={tripped}{wide})"


class SloBreakers:
    """The breakers of one policy's rules (``Policy.slos``), what the runtime holds (``CacheRuntime.slo``).

    ``by_rule``: every rule's ``RuleBreakers`` by rule name (empty: nothing to watch; the request path then
    does nothing more). ``tripped``: the rules with a tenant's breaker open or half-open, or tripped
    rule-wide; ``bypassing``: the ``(rule, ns)`` pairs, and the rules tripped rule-wide, whose safe mode is
    ``bypass`` (the L1 hit path's one check). Both are updated in place on every transition, so what a
    runtime hands to the hit path stays current. A rule keeps at most ``max_tenants`` tenants' breakers.

    Transitions are recorded as access events in ``events`` with the policy's ref, and counted in
    ``metrics``, labelled by policy ref, rule and namespace (a canary's rules are other breakers than the
    active's of the same name). A policy swap builds a new set (every breaker closed: a changed policy is
    judged afresh) and ``retire``s this one.
    """

    def __init__(
        self, policy: Policy | None, *, clock: Callable[[], float], metrics: CacheMetrics, events: EventSink,
        max_tenants: int = MAX_TENANT_BREAKERS,
    ) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants!r}")
        self.policy = policy
        self.policy_ref = policy.ref if policy is not None else ""
        self.clock = clock
        self.metrics = metrics
        self.events = events
        self.max_tenants = max_tenants
        self.retired = False  # its policy left: no breaker is made any more
        self.tripped: dict[str, RuleBreakers] = {}
        self.bypassing: set[str | tuple[str, Namespace]] = set()
        slos = policy.slos if policy is not None else {}
        self.by_rule: dict[str, RuleBreakers] = {
            rule: RuleBreakers(rule, spec) for rule, spec in slos.items()
        }
        self._tallies: weakref.WeakValueDictionary[tuple[str, Namespace], L1Tally]
        self._tallies = weakref.WeakValueDictionary()
        self._tallies_lock = threading.Lock()

    # -- the tenants' breakers ---------------------------------------------------------------------------

    def l1_tally(self, rule: str, ns: Namespace) -> L1Tally | None:
        """The tally a plan of ``ns``'s calls of ``rule`` counts its hit-path L1 hits in (``Plan.slo_hits``);
        None when the rule has no p99 objective (only lookups' latency needs those hits)."""
        rules = self.by_rule.get(rule)
        if rules is None or rules.spec.p99_ms is None:
            return None
        with self._tallies_lock:
            tally = self._tallies.get((rule, ns))
            if tally is None:
                tally = self._tallies[(rule, ns)] = L1Tally([0.0])
            return tally

    def breaker(self, rule: str, ns: Namespace) -> SloBreaker | None:
        """``ns``'s breaker of ``rule``, made when missing (None for a rule without objectives, or once
        retired); it becomes the most recently used. Making one past ``max_tenants`` drops another (``RuleBreakers.victim``)."""
        rules = self.by_rule.get(rule)
        if rules is None or self.retired:
            return None
        dropped = None
        with rules.lock:
            breakers = rules.breakers
            breaker = breakers.get(ns)
            if breaker is not None:
                breakers.move_to_end(ns)
                return breaker
            if len(breakers) >= self.max_tenants:
                dropped = rules.victim()
                del breakers[dropped.ns]
                dropped.retired = True
                change = self._dropped(rules, dropped)
            tally = self.l1_tally(rule, ns)
            breaker = breakers[ns] = SloBreaker(
                rule, rules.spec, clock=self.clock, notify=self._changed, ns=ns,
                l1_hits=_no_hits if tally is None else lambda: tally[0],
            )
        if dropped is not None:
            self._record_drop(rules, dropped, change)
        return breaker

    def observe(self, rule: str, ns: Namespace, seconds: float) -> None:
        """A lookup of ``ns``'s call of ``rule`` took ``seconds`` (ignored for a rule without a breaker)."""
        breaker = self.breaker(rule, ns)
        if breaker is not None:
            breaker.observe(seconds)

    def verdict(self, rule: str, ns: Namespace, wrong: bool) -> None:
        """A semantic verdict on an answer of ``rule`` to ``ns`` (ignored for a rule without a breaker)."""
        breaker = self.breaker(rule, ns)
        if breaker is not None:
            breaker.verdict(wrong)

    def mark(self, rule: str, ns: Namespace) -> tuple[SloBreaker, int] | None:
        """What a served hit keeps for the verdict that may follow (``SloBreaker.verdict``'s ``mark``)."""
        breaker = self.breaker(rule, ns)
        return None if breaker is None else (breaker, breaker.transitions)

    # -- deciding ----------------------------------------------------------------------------------------

    def admit(self, plan: Plan) -> Plan | None:
        """The plan a call of a tripped rule runs: ``plan`` itself when it runs normally (its tenant's breaker
        is closed and the rule is not tripped rule-wide, or a probe), a copy without semantic lookup (reason
        ``slo-breaker``) in ``semantic-off`` safe mode, None in ``bypass`` safe mode (the caller bypasses the
        cache with reason ``slo-breaker``)."""
        rules = self.tripped.get(plan.rule)
        if rules is None:
            return plan
        breaker = rules.breakers.get(plan.ns)
        if breaker is not None and breaker.state != CLOSED:
            runs = breaker.admit()
        else:
            runs = not self._wide(rules)
        if runs:
            return plan
        if rules.spec.trip_to == "bypass":
            return None
        return dataclasses.replace(plan, semantic=None, reason=SLO_REASON)

    def _wide(self, rules: RuleBreakers) -> bool:
        """Whether ``rules`` is tripped rule-wide now; the first call after it ends closes it."""
        if not rules.wide:
            return False
        if self.clock() < rules.wide_until:
            return True
        with rules.lock:
            change = self._rewiden(rules)
        if change is not None:
            self._record(rules.rule, RULE_WIDE, "rule", change, STATES[change], "cool-down")
        return rules.wide

    # -- transitions -------------------------------------------------------------------------------------

    def _changed(self, breaker: SloBreaker, state: str, reason: str) -> None:
        rules = self.by_rule[breaker.rule]
        with rules.lock:
            if breaker.retired:  # dropped, or its policy left, while it moved: nothing of it is kept
                return
            self._track(rules, breaker)
            wide = self._rewiden(rules)
            now = breaker.state
        self._record(rules.rule, breaker.ns, "tenant", state, STATES[now], reason)
        if wide is not None:
            why = TENANTS if wide == OPEN else "cool-down"
            self._record(rules.rule, RULE_WIDE, "rule", wide, STATES[wide], why)

    def _track(self, rules: RuleBreakers, breaker: SloBreaker) -> None:
        """``tripped`` and ``bypassing`` after ``breaker`` moved, by its state now (two threads' notices may
        arrive out of order). Under ``rules.lock``."""
        pair = (rules.rule, breaker.ns)
        if breaker.state == CLOSED or breaker.retired:
            rules.tripped.discard(breaker.ns)
            self.bypassing.discard(pair)
        else:
            rules.tripped.add(breaker.ns)
            if rules.spec.trip_to == "bypass":
                self.bypassing.add(pair)

    def _rewiden(self, rules: RuleBreakers) -> str | None:
        """The rule-wide state after a change of its tenants' breakers or of the time; the state it entered,
        if it moved. Under ``rules.lock``."""
        rules.wide_until = rules.wide_end()
        wide = self.clock() < rules.wide_until
        moved = None
        if wide != rules.wide:
            rules.wide, rules.wide_moved = wide, True
            moved = OPEN if wide else CLOSED
            if rules.spec.trip_to == "bypass":
                (self.bypassing.add if wide else self.bypassing.discard)(rules.rule)
            if wide:
                log.warning("rule %s: %d tenants' breakers open; safe mode for every tenant until %.0f",
                            rules.rule, rules.spec.rule_wide_tenants, rules.wide_until)
        if rules.tripped or rules.wide:
            self.tripped[rules.rule] = rules
        else:
            self.tripped.pop(rules.rule, None)
        return moved

    def _dropped(self, rules: RuleBreakers, breaker: SloBreaker) -> str | None:
        """Forget a dropped breaker's part in the rule's state; the rule-wide transition, if any. Under
        ``rules.lock``."""
        was_tripped = breaker.ns in rules.tripped
        self._track(rules, breaker)
        if was_tripped:
            log.warning("rule %s: the open breaker of %s dropped for a newer tenant's (%d kept)", rules.rule,
                        breaker.ns, self.max_tenants)
        return self._rewiden(rules)

    def _record_drop(self, rules: RuleBreakers, breaker: SloBreaker, wide: str | None) -> None:
        if breaker.state != CLOSED:
            self._record(rules.rule, breaker.ns, "tenant", CLOSED, None, EVICTED)
        if breaker.transitions:
            self.metrics.slo_forget(self.policy_ref, rules.rule, breaker.ns)
        if wide is not None:
            self._record(rules.rule, RULE_WIDE, "rule", wide, STATES[wide], EVICTED)

    def _record(
        self, rule: str, ns: Namespace, scope: str, state: str, value: int | None, reason: str
    ) -> None:
        """A transition's metrics (``value`` None: the series goes) and access event."""
        self.metrics.slo_transition(self.policy_ref, rule, ns, scope, state, value)
        # A plain tuple in AccessEvent field order (controller._events).
        self.events.record((
            self.clock(), "", ns, rule, self.policy_ref, f"slo-{state}", None, 0, 0.0, 0.0, "", reason, None,
        ))

    # -- reading -----------------------------------------------------------------------------------------

    def states(self, ns: Namespace | None = None) -> dict[str, str]:
        """``{rule: state}``: of ``ns``'s breaker of every rule (closed where it has none), or with ``ns``
        None, of every rule's rule-wide state (``open`` or ``closed``)."""
        if ns is None:
            now = self.clock()
            return {
                rule: OPEN if r.wide and now < r.wide_until else CLOSED for rule, r in self.by_rule.items()
            }
        return {
            rule: breaker.state if (breaker := r.breakers.get(ns)) is not None else CLOSED
            for rule, r in self.by_rule.items()
        }

    def serves(self, policy: Policy | None, clock: Callable[[], float], metrics: CacheMetrics,
               events: EventSink) -> bool:
        """Whether this set is the one for a runtime with these parts (else the runtime builds its own)."""
        return (self.policy is policy and self.clock is clock and self.metrics is metrics
                and self.events is events)

    def retire(self) -> None:
        """Its policy left: the breakers stop measuring and deciding, and their state metrics go."""
        self.retired = True
        for rule, rules in self.by_rule.items():
            with rules.lock:
                for ns, breaker in rules.breakers.items():
                    breaker.retired = True
                    if breaker.transitions:
                        self.metrics.slo_forget(self.policy_ref, rule, ns)
                if rules.wide_moved:
                    self.metrics.slo_forget(self.policy_ref, rule, RULE_WIDE)
        self.tripped.clear()
        self.bypassing.clear()

    def __bool__(self) -> bool:
        return bool(self.by_rule)

    def __repr__(self) -> str:
        return f"SloBreakers({self.policy_ref or 'no policy'}, {self.by_rule})"
