"""How both pollers hand a relay its events: a claimed batch's matching events together, each
recorded only when the relay confirmed it, the rest retried and dead-lettered."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, Message, Outbox
from outboxkit.errors import RelayError
from outboxkit.testing import Drain


class FakeRelay:
    """A relay that answers from a script: ``fail`` holds the event ids it refuses (once each
    unless ``always``); every call's ids are kept."""

    def __init__(self, fail=(), *, always=False, answer=None, raises=None):
        self.calls: list[list[int]] = []
        self.fail = set(fail)
        self.always = always
        self.answer = answer
        self.raises = raises

    def _answers(self, events):
        self.calls.append([e.id for e in events])
        if self.raises is not None:
            raise self.raises
        if self.answer is not None:
            return self.answer
        answers = []
        for event in events:
            if event.id in self.fail:
                if not self.always:
                    self.fail.discard(event.id)
                answers.append(RelayError(f"nack {event.id}", refused=True))
            else:
                answers.append(None)
        return answers

    async def publish(self, events):
        return self._answers(events)

    def publish_blocking(self, events):
        return self._answers(events)


def make(relay, *, topics=("order.*",), max_retries=3, handlers=()):
    bus = EventBus()
    for topic, name, fn in handlers:
        bus.subscribe(topic, fn, name=name, transactional=False)
    bus.relay(relay, topics=list(topics), name="relay")
    clock = FrozenClock("2030-01-01T00:00:00Z")
    return Outbox(MemoryStore(), bus, clock=clock, max_retries=max_retries), clock


def enqueue(outbox, topics):
    with outbox.store.transaction() as tx:
        return outbox.enqueue_many(tx, [Message(t, {"i": i}) for i, t in enumerate(topics)])


MODES = [
    pytest.param("per_event", "sync", id="sync-per_event"),
    pytest.param("per_batch", "sync", id="sync-per_batch"),
    pytest.param("per_event", "async", id="async-per_event"),
    pytest.param("per_batch", "async", id="async-per_batch"),
]


def run_round(outbox, mode, poller):
    if poller == "sync":
        return outbox.poller(transaction=mode, batch_size=100).run_once()

    async def once():
        p = outbox.async_poller(transaction=mode, batch_size=100)
        try:
            return await p.run_once()
        finally:
            await outbox.store.async_store().close()

    return asyncio.run(once())


@pytest.mark.parametrize(("mode", "poller"), MODES)
def test_a_round_hands_the_relay_its_matching_events_together(mode, poller):
    relay = FakeRelay()
    outbox, _ = make(relay)
    ids = enqueue(outbox, ["order.placed", "invoice.sent", "order.paid", "order.placed.eu"])
    report = run_round(outbox, mode, poller)
    assert relay.calls == [[ids[0], ids[2]]]  # one call, claim order, only the matches
    assert sorted(report.published) == ids  # the other two have no subscriber (R9)
    assert [r.handler for r in outbox.store.records(ids[0])] == ["relay"]
    assert outbox.store.records(ids[1]) == []


@pytest.mark.parametrize(("mode", "poller"), MODES)
def test_an_unconfirmed_event_alone_is_retried_and_others_recorded(mode, poller):
    outbox, clock = make(FakeRelay())
    ids = enqueue(outbox, ["order.a"] * 3)
    relay = outbox.bus.find("relay").relay
    relay.fail = {ids[1]}
    report = run_round(outbox, mode, poller)
    assert report.published == [ids[0], ids[2]]
    assert report.retried == [ids[1]]
    assert outbox.store.records(ids[1]) == []
    assert "nack" in (outbox.store.get(ids[1]).last_error or "")
    clock.advance(1)  # the first retry's backoff
    report = run_round(outbox, mode, poller)
    assert relay.calls[-1] == [ids[1]]  # only the unconfirmed one again
    assert report.published == [ids[1]]


def test_a_relay_that_never_confirms_dead_letters_the_event():
    relay = FakeRelay(always=True)
    outbox, clock = make(relay, max_retries=2)
    [event_id] = enqueue(outbox, ["order.a"])
    relay.fail = {event_id}
    d = Drain(outbox, clock)
    with d.expect_failures(RelayError):
        report = d()
    assert report.dead_lettered == [event_id]
    assert len(relay.calls) == 3  # max_retries + 1 attempts, each a publish
    assert outbox.store.records(event_id) == []


def test_an_event_already_relayed_is_not_handed_again_when_another_handler_fails():
    failures = {"left": 1}

    def flaky(event, ctx):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("flaky")

    relay = FakeRelay()
    outbox, clock = make(relay, handlers=[("order.a", "flaky", flaky)])
    [event_id] = enqueue(outbox, ["order.a"])
    d = Drain(outbox, clock)
    with d.expect_failures(RuntimeError):
        report = d()
    assert report.published == [event_id]
    assert relay.calls == [[event_id]]  # the retry ran only the flaky handler


@pytest.mark.parametrize(
    ("relay", "message"),
    [
        (FakeRelay(raises=RuntimeError("relay bug")), "relay bug"),
        (FakeRelay(answer=[None]), "answered list for 2 event"),
        (FakeRelay(answer="yes"), "answered str for 2 event"),
    ],
)
def test_a_broken_relay_fails_every_event_it_was_handed(relay, message):
    outbox, _ = make(relay)
    ids = enqueue(outbox, ["order.a", "order.b"])
    report = outbox.poller().run_once()
    assert report.retried == ids
    for event_id in ids:
        assert message in (outbox.store.get(event_id).last_error or "")
        assert outbox.store.records(event_id) == []


@pytest.mark.parametrize("mode", ["per_event", "per_batch"])
def test_a_confirm_whose_lease_was_taken_over_is_not_recorded(mode):
    """The confirmed events are recorded together, each fenced by its token: one whose lease
    another poller took over meanwhile gets no record of this round, and is not settled by it
    (the other poller delivers it)."""
    outbox, clock = make(FakeRelay())
    store = outbox.store
    ids = enqueue(outbox, ["order.a"] * 3)
    claimed = []
    claim = store.claim

    def traced(**kw):
        claims = claim(**kw)
        claimed.extend(claims)
        return claims

    store.claim = traced
    relay = outbox.bus.find("relay").relay
    taken_over = []

    def answers(events, _answers=relay._answers):
        if not taken_over:  # another poller takes the first event over meanwhile
            store.release([claimed[0]], now=clock.now())
            lease = timedelta(seconds=30)
            taken_over.extend(claim(batch_size=1, lease=lease, now=clock.now(), dead_key="release"))
        return _answers(events)

    relay.publish_blocking = answers
    report = outbox.poller(transaction=mode, batch_size=100).run_once()
    assert [c.event.id for c in taken_over] == [ids[0]]
    assert sorted(report.published) == [ids[1], ids[2]]
    assert report.lease_lost == [ids[0]]
    assert store.records(ids[0]) == []  # this round's confirm: fenced out
    assert [r.handler for r in store.records(ids[1])] == ["relay"]
    event = store.get(ids[0])
    assert event is not None and event.published_at is None  # the other poller's to settle
