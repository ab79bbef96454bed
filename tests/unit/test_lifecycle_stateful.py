"""A hypothesis state machine of the event lifecycle on the memory store.

The machine keeps its own model of every event (attempts, lease, token, records, state) and
drives the real code two ways:

- the real ``Poller.run_once`` (claim -> deliver -> settle), with handlers whose behaviour (ok,
  reject, fail, crash before commit) is scripted per (event, handler) before each run;
- a "manual poller": ``store.claim`` / ``store.delivery`` / ``store.settle`` called directly, with
  settlements from ``outboxkit.core.machine.decide_settlement``; it can crash (abandon its claims).

Besides: publishing (committed or rolled back), advancing the clock, requeueing dead events and
replaying stale tokens. After every step the store must agree with the model, and at teardown a
drain must leave nothing pending.

A note on "attempts <= max_retries + 1": attempts are counted at claim (R4), so a crash on the last
attempt leaves an event with every attempt used and no settlement. Its next claim counts one more
attempt but runs no handler: the poller settles it at once (dead, or published if every handler is
already recorded). So handlers never run on an attempt above ``max_retries + 1``, and stored
attempts only exceed it for such an exhausted claim, which never becomes a retry.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis import event as note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from outboxkit import (
    Claim,
    DeadLettered,
    Event,
    EventBus,
    ExponentialBackoff,
    FrozenClock,
    LeaseLostError,
    MemoryStore,
    ObserverEvent,
    Outbox,
    Outcome,
    Poller,
    Published,
    Reject,
    RetryScheduled,
    State,
    Unrouted,
    hookimpl,
)
from outboxkit.core.machine import DeadLetter, Publish, Retry, decide_settlement, handlers_to_run
from outboxkit.core.model import DeadKey
from outboxkit.store import settle_one

# topic -> its handlers as (name, transactional), in subscription order
TOPICS: dict[str, tuple[tuple[str, bool], ...]] = {
    "two": (("a", True), ("b", True)),
    "one": (("c", False),),  # R7: a non-transactional handler
    "none": (),  # R9: nobody subscribed
}
TRANSACTIONAL = {name: tx for handlers in TOPICS.values() for name, tx in handlers}

# (backoff option given to the Outbox, the delay in seconds expected before retry k)
POLICIES: list[tuple[Any, Callable[[int], float]]] = [
    (None, lambda k: min(2.0 ** (k - 1), 300.0)),  # the default: 1, 2, 4 ... 300 s
    (ExponentialBackoff(base=2.0, max=5.0), lambda k: min(2.0 * 2 ** (k - 1), 5.0)),
    (lambda k: timedelta(seconds=7 * k), lambda k: 7.0 * k),  # any callable, as a timedelta
    (3.0, lambda k: 3.0),  # a constant delay
]

BEHAVIOURS = st.sampled_from(["ok", "fail", "reject", "fail", "crash"])
STALE_DECISIONS = st.sampled_from([Publish(), DeadLetter(), Retry(timedelta(seconds=1), retry=1)])


class Crash(BaseException):
    """The process dies inside a handler, before its delivery commits."""


class SpyStore(MemoryStore):
    """The memory store, keeping every claim it hands out (the poller's too) for later checks."""

    def __init__(self) -> None:
        super().__init__()
        self.claim_log: list[Claim] = []

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        claims = super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)
        self.claim_log.extend(claims)
        return claims


class Observer:
    def __init__(self) -> None:
        self.events: list[ObserverEvent] = []

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        self.events.append(event)


@dataclass
class Model:
    """What the machine expects one committed event to look like in the store."""

    topic: str
    available_at: datetime
    attempts: int = 0
    locked_until: datetime | None = None
    token: str | None = None
    published_at: datetime | None = None
    failed_at: datetime | None = None
    records: dict[str, Outcome] = field(default_factory=dict)
    exhausted: bool = False  # claimed although earlier (crashed) attempts used every one up

    def state(self, now: datetime) -> State:
        if self.published_at is not None:
            return State.PUBLISHED
        if self.failed_at is not None:
            return State.DEAD
        if self.locked_until is not None and self.locked_until > now:
            return State.CLAIMED
        return State.PENDING

    def due(self, now: datetime) -> bool:
        return self.state(now) is State.PENDING and self.available_at <= now

    @property
    def subscribed(self) -> list[str]:
        return [name for name, _ in TOPICS[self.topic]]


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.clock = FrozenClock("2030-01-01T00:00:00Z")
        self.store = SpyStore()
        self.observer = Observer()
        self.events: dict[int, Model] = {}
        self.rolled_back: set[int] = set()
        self.held: list[Claim] = []  # the manual poller's claims
        self.script: dict[tuple[int, str], str] = {}  # (event, handler) -> behaviour
        self.calls: list[tuple[int, str, int]] = []  # (event, handler, attempt), every handler run
        self.tokens: set[str] = set()

    # -- setup ------------------------------------------------------------------------------------

    @initialize(
        max_retries=st.integers(0, 3),
        lease=st.sampled_from([5, 10, 30]),
        batch_size=st.integers(1, 3),
        policy=st.sampled_from(POLICIES),
    )
    def setup(
        self,
        max_retries: int,
        lease: int,
        batch_size: int,
        policy: tuple[Any, Callable[[int], float]],
    ) -> None:
        backoff, self.expected_delay = policy
        bus = EventBus()
        for topic, handlers in TOPICS.items():
            for name, transactional in handlers:
                bus.subscribe(topic, self._handler(name), name=name, transactional=transactional)
        # The Outbox-wide max_retries is wrong on purpose: the poller's option must win (R14).
        self.outbox = Outbox(
            self.store,
            bus,
            clock=self.clock,
            max_retries=max_retries + 5,
            backoff=backoff,
            plugins=[self.observer],
            load_entry_points=False,
        )
        self.poller = self.outbox.poller(
            max_retries=max_retries, lease=lease, batch_size=batch_size
        )
        self.max_retries = max_retries
        self.lease = timedelta(seconds=lease)
        assert self.poller.options.max_retries == max_retries
        self.ready = True

    def _handler(self, name: str) -> Callable[[Event, Any], None]:
        def handle(event: Event, ctx: Any) -> None:
            self.calls.append((event.id, name, ctx.attempt))
            if TRANSACTIONAL[name]:
                ctx.connection.insert(
                    "effects", {"event": event.id, "handler": name, "attempt": ctx.attempt}
                )
            behaviour = self.script.get((event.id, name), "ok")
            if behaviour == "reject":
                raise Reject("not wanted")
            if behaviour == "fail":
                raise RuntimeError("handler failed")
            if behaviour == "crash":
                raise Crash

        return handle

    # -- model helpers ----------------------------------------------------------------------------

    @property
    def now(self) -> datetime:
        return self.clock.now()

    def _due_order(self) -> list[int]:
        now = self.now
        return [
            eid
            for _, eid in sorted(
                (m.available_at, eid) for eid, m in self.events.items() if m.due(now)
            )
        ]

    def _is_stale(self, claim: Claim) -> bool:
        return self.events[claim.event.id].token != claim.token

    def _check_claims(self, claims: list[Claim], batch_size: int, expected: list[int]) -> None:
        """R3: exactly the oldest due events, none of them leased; lease, attempt and token set."""
        now = self.now
        got = [c.event.id for c in claims]
        leased = {eid for eid, m in self.events.items() if m.state(now) is State.CLAIMED}
        assert not leased & set(got), f"claimed currently leased events {leased & set(got)}"
        assert got == expected[:batch_size]
        for c in claims:
            m = self.events[c.event.id]
            m.attempts += 1
            m.locked_until = now + self.lease
            m.token = c.token
            m.exhausted = m.exhausted or m.attempts > self.max_retries + 1
            if m.attempts > self.max_retries + 1:
                note("claim of an exhausted event")
            assert c.attempt == m.attempts
            assert c.locked_until == m.locked_until
            assert dict(c.done) == m.records, "a claim must carry every recorded handler"
            assert c.token not in self.tokens, "claim tokens are fresh"
            self.tokens.add(c.token)

    def _settle_model(self, claim: Claim) -> str:
        """R8, computed independently of the core: returns "published", "retried" or "dead"."""
        m = self.events[claim.event.id]
        now = self.now
        m.locked_until = None
        m.token = None
        if all(name in m.records for name in m.subscribed):
            m.published_at = now
            return "published"
        if claim.attempt > self.max_retries:
            m.failed_at = now
            return "dead"
        m.available_at = now + timedelta(seconds=self.expected_delay(claim.attempt))
        return "retried"

    def _snapshot(self) -> tuple[Any, ...]:
        ids = sorted(self.events) + sorted(self.rolled_back)
        return (
            [self.store.get(i) for i in ids],
            [self.store.records(i) for i in ids],
            self.store.stats(now=self.now),
            self.store.dead_letters(limit=10**6),
            self.store.rows("effects"),
        )

    def _expect_stale(self, claim: Claim, decision: Any) -> None:
        """A stale token changes nothing: no settle, no delivery, no extension, no release."""
        before = self._snapshot()
        assert settle_one(self.store, claim, decision, error="stale", now=self.now) is False
        with pytest.raises(LeaseLostError):
            self._open_delivery(claim)
        assert self.store.extend([claim], lease=self.lease, now=self.now) == []
        assert self.store.release([claim], now=self.now) == 0
        assert self._snapshot() == before

    def _open_delivery(self, claim: Claim) -> None:
        with self.store.delivery(claim, now=self.now) as tx:
            tx.record("a", Outcome.SUCCEEDED)
            raise AssertionError("a stale token opened a delivery transaction")

    # -- rules ------------------------------------------------------------------------------------

    @precondition(lambda self: self.ready)
    @rule(
        topic=st.sampled_from(sorted(TOPICS)),
        commit=st.sampled_from([True, True, True, False]),
        delay=st.sampled_from([None, 0, 3]),
    )
    def publish(self, topic: str, commit: bool, delay: int | None) -> None:
        tx = self.store.begin()
        eid = self.outbox.enqueue(tx, topic, {"topic": topic}, delay=delay)
        assert self.store.get(eid) is None, "an event is invisible until its transaction commits"
        if commit:
            tx.commit()
            self.events[eid] = Model(topic, self.now + timedelta(seconds=delay or 0))
        else:
            tx.rollback()
            self.rolled_back.add(eid)

    @precondition(lambda self: self.ready)
    @rule(seconds=st.sampled_from([0.5, 1, 2, 5, 10, 30, 60]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        """The real poller: claim, deliver to scripted handlers, settle."""
        self._run_poller(self.poller, lambda eid, name: data.draw(BEHAVIOURS, f"{eid}/{name}"))

    def _run_poller(self, poller: Poller, behaviour: Callable[[int, str], str]) -> None:
        max_attempt = self.max_retries + 1
        expected_ids = self._due_order()[: poller.options.batch_size]
        for eid in expected_ids:
            for name in handlers_to_run(self.events[eid].subscribed, self.events[eid].records):
                self.script[(eid, name)] = behaviour(eid, name)
        rejected = {
            (eid, h)
            for eid, m in self.events.items()
            for h, o in m.records.items()
            if o is Outcome.REJECTED
        }
        first_call, first_claim = len(self.calls), len(self.store.claim_log)
        first_event = len(self.observer.events)
        try:
            report = poller.run_once()
        except Crash:
            report = None
        claims = self.store.claim_log[first_claim:]
        self._check_claims(claims, poller.options.batch_size, expected_ids)

        # What the poller must have done, claim by claim.
        calls: list[tuple[int, str, int]] = []
        results: dict[str, list[int]] = {"published": [], "retried": [], "dead": []}
        released: list[int] = []
        crashed = False
        for claim in claims:
            m = self.events[claim.event.id]
            if crashed:  # released unstarted: lease cleared, attempt refunded
                m.attempts -= 1
                m.locked_until = m.token = None
                released.append(claim.event.id)
                continue
            if claim.attempt <= max_attempt:
                for name in handlers_to_run(m.subscribed, claim.done):
                    calls.append((claim.event.id, name, claim.attempt))
                    outcome = self.script[(claim.event.id, name)]
                    if outcome == "crash":
                        crashed = True  # the event in hand keeps its lease
                        break
                    if outcome == "ok":
                        m.records[name] = Outcome.SUCCEEDED
                    elif outcome == "reject":
                        m.records[name] = Outcome.REJECTED
            if not crashed:
                results[self._settle_model(claim)].append(claim.event.id)
        for kind, ids in results.items():
            if ids:
                note(f"poller: {kind}")
        if crashed:
            note("poller: crash mid-batch" + (", rest released" if released else ""))

        new_calls = self.calls[first_call:]
        assert new_calls == calls, "R5: claim order, subscription order, recorded handlers skipped"
        assert not rejected & {(e, h) for e, h, _ in new_calls}, "a rejected handler ran again"
        assert all(attempt <= max_attempt for _, _, attempt in new_calls), "R11: too many attempts"
        assert (report is None) == crashed
        if report is not None:
            assert report.claimed == [c.event.id for c in claims]
            assert report.published == results["published"]
            assert report.retried == results["retried"]
            assert report.dead_lettered == results["dead"]
            assert report.released == []
            assert report.lease_lost == []
        seen = self.observer.events[first_event:]
        assert [e.event_id for e in seen if isinstance(e, Published)] == results["published"]
        assert [e.event_id for e in seen if isinstance(e, DeadLettered)] == results["dead"]
        retries = [(e.event_id, e.attempt, e.delay) for e in seen if isinstance(e, RetryScheduled)]
        assert retries == [
            (eid, k, timedelta(seconds=self.expected_delay(k)))
            for eid in results["retried"]
            for k in [self.events[eid].attempts]
        ]
        assert [e.event_id for e in seen if isinstance(e, Unrouted)] == [
            c.event.id for c in claims if not TOPICS[c.event.topic] and c.event.id not in released
        ]
        for eid in results["retried"]:  # the retry delay after failure k is the policy's value
            k = self.events[eid].attempts
            event = self.store.get(eid)
            assert event is not None
            assert event.available_at - self.now == timedelta(seconds=self.expected_delay(k))

    @precondition(lambda self: self.ready)
    @rule(batch_size=st.integers(1, 3))
    def claim(self, batch_size: int) -> None:
        """The manual poller claims a batch."""
        expected = self._due_order()
        claims = self.store.claim(batch_size=batch_size, lease=self.lease, now=self.now)
        self._check_claims(claims, batch_size, expected)
        self.held.extend(claims)

    @precondition(lambda self: self.ready and self.held)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """The manual poller delivers one held claim and settles it (or crashes doing it)."""
        claim = self.held.pop(data.draw(st.integers(0, len(self.held) - 1), "claim"))
        eid = claim.event.id
        m = self.events[eid]
        if self._is_stale(claim):  # the lease passed and someone re-claimed the event
            note("manual: held claim gone stale")
            self._expect_stale(claim, data.draw(STALE_DECISIONS, "decision"))
            return
        outcomes = dict(claim.done)
        errors: list[str] = []
        if claim.attempt <= self.max_retries + 1:
            for name in handlers_to_run(m.subscribed, outcomes):
                behaviour = data.draw(BEHAVIOURS, f"{eid}/{name}")
                self.calls.append((eid, name, claim.attempt))
                if behaviour == "crash":
                    with pytest.raises(Crash):
                        self._run_manual(claim, name, Crash())
                    return  # the poller died: its claim is abandoned, the lease holds
                if behaviour == "fail":
                    with pytest.raises(RuntimeError):
                        self._run_manual(claim, name, RuntimeError("boom"))
                    errors.append(f"{name}: boom")
                    continue
                if behaviour == "reject":  # R6: the writes roll back, a rejected record commits
                    with pytest.raises(Reject):
                        self._run_manual(claim, name, Reject("no"))
                    with self.store.delivery(claim, now=self.now) as tx:
                        tx.record(name, Outcome.REJECTED, reason="no")
                    outcomes[name] = m.records[name] = Outcome.REJECTED
                    continue
                self._run_manual(claim, name, None)
                outcomes[name] = m.records[name] = Outcome.SUCCEEDED
        settlement = decide_settlement(
            subscribed=m.subscribed,
            outcomes=outcomes,
            attempts=claim.attempt,
            max_retries=self.max_retries,
            backoff=self.poller.options.backoff,
        )
        expected = self._settle_model(claim)
        kind = {Publish: "published", Retry: "retried", DeadLetter: "dead"}[type(settlement)]
        assert kind == expected
        note(f"manual: {kind}")
        error = "; ".join(errors) or None
        assert settle_one(self.store, claim, settlement, error=error, now=self.now) is True
        if isinstance(settlement, Retry):
            delay = timedelta(seconds=self.expected_delay(claim.attempt))
            assert settlement.delay == delay
            assert settlement.retry == claim.attempt
            event = self.store.get(eid)
            assert event is not None
            assert event.available_at - self.now == delay

    def _run_manual(self, claim: Claim, name: str, error: BaseException | None) -> None:
        """One handler run in a delivery transaction: its write, then success or ``error``."""
        with self.store.delivery(claim, now=self.now) as tx:
            if TRANSACTIONAL[name]:
                tx.connection.insert(
                    "effects", {"event": claim.event.id, "handler": name, "attempt": claim.attempt}
                )
            if error is not None:
                raise error
            tx.record(name, Outcome.SUCCEEDED)

    @precondition(lambda self: self.ready and self.held)
    @rule()
    def crash_poller(self) -> None:
        """The manual poller dies: its claims are abandoned and recover by their leases."""
        self.held.clear()

    def _taken_over(self) -> list[Claim]:
        """Old claims whose lease passed and whose event another claim holds now."""
        return [
            c
            for c in self.store.claim_log
            if self._is_stale(c) and self.events[c.event.id].token is not None
        ]

    def _finished(self) -> list[Claim]:
        """Old claims whose event was settled, released or requeued since."""
        return [
            c
            for c in self.store.claim_log
            if self._is_stale(c) and self.events[c.event.id].token is None
        ]

    @precondition(lambda self: self.ready and self._taken_over())
    @rule(data=st.data())
    def stale_settle_after_takeover(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self._taken_over()), "stale claim")
        note("stale token: the event was re-claimed")
        self._expect_stale(claim, data.draw(STALE_DECISIONS, "decision"))

    @precondition(lambda self: self.ready and self._finished())
    @rule(data=st.data())
    def stale_settle_after_settle(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self._finished()), "stale claim")
        note("stale token: the event was settled or released")
        self._expect_stale(claim, data.draw(STALE_DECISIONS, "decision"))

    @precondition(lambda self: self.ready and any(m.failed_at for m in self.events.values()))
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        """R12: attempts reset, due at once, recorded handlers stay done."""
        dead = sorted(eid for eid, m in self.events.items() if m.failed_at is not None)
        ids = data.draw(st.lists(st.sampled_from(dead), min_size=1, unique=True), "ids")
        assert self.outbox.requeue(ids) == len(ids)
        note("requeue")
        for eid in ids:
            m = self.events[eid]
            m.failed_at = m.locked_until = m.token = None
            m.attempts = 0
            m.available_at = self.now
            m.exhausted = False

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        if not self.ready:
            return
        now = self.now
        for eid, m in self.events.items():
            event = self.store.get(eid)
            assert event is not None
            assert (event.attempts, event.available_at) == (m.attempts, m.available_at)
            names = [r.handler for r in self.store.records(eid)]
            assert len(names) == len(set(names)), "at most one record per (event, handler)"
            assert {r.handler: r.outcome for r in self.store.records(eid)} == m.records
        for eid in self.rolled_back:
            assert self.store.get(eid) is None, "a rolled-back enqueue leaves no trace"
        stats = self.store.stats(now=now)
        states = Counter(m.state(now).value for m in self.events.values())
        assert (stats.pending, stats.claimed, stats.published, stats.dead) == (
            states["pending"],
            states["claimed"],
            states["published"],
            states["dead"],
        )
        dead = self.store.dead_letters(limit=10**6)
        assert len(dead) == stats.dead, "a dead event is never also published"
        assert {d.event.id: d.failed_at for d in dead} == {
            eid: m.failed_at for eid, m in self.events.items() if m.failed_at is not None
        }
        # A transactional handler's writes commit exactly with its success record.
        effects = Counter((r["event"], r["handler"]) for r in self.store.rows("effects"))
        assert effects == Counter(
            (eid, h)
            for eid, m in self.events.items()
            for h, o in m.records.items()
            if o is Outcome.SUCCEEDED and TRANSACTIONAL[h]
        )

    @invariant()
    def published_xor_dead(self) -> None:
        for m in self.events.values():
            assert m.published_at is None or m.failed_at is None

    @invariant()
    def attempts_are_bounded(self) -> None:
        if not self.ready:
            return
        assert all(attempt <= self.max_retries + 1 for _, _, attempt in self.calls)
        for m in self.events.values():
            assert m.attempts <= self.max_retries + 1 or m.exhausted

    # -- teardown ---------------------------------------------------------------------------------

    def teardown(self) -> None:
        # Hypothesis calls teardown in a ``finally``: after a failed step, report that failure
        # alone (a drain on top of a broken model only adds noise and slows the shrinking).
        if not self.ready or sys.exc_info()[0] is not None:
            return
        # The manual poller is gone; every handler behaves from now on.
        self.held.clear()
        drain = self.outbox.poller(max_retries=self.max_retries, lease=self.lease, batch_size=1000)
        longest = max(self.expected_delay(k) for k in range(1, self.max_retries + 2))
        for _ in range(5):
            stats = self.store.stats(now=self.now)
            if stats.pending == stats.claimed == 0:
                break
            self.clock.advance(self.lease + timedelta(seconds=longest + 1))
            self._run_poller(drain, lambda eid, name: "ok")
            self.store_matches_model()
        stats = self.store.stats(now=self.now)
        assert stats.pending == stats.claimed == 0, f"left pending after the drain: {stats}"
        assert stats.published + stats.dead == len(self.events)


TestLifecycleStateful = LifecycleMachine.TestCase
TestLifecycleStateful.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    # No explain phase: it can take minutes on a failing run of a 40-step machine.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
