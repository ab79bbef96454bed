"""Store-level checks: each test drives the Store protocol directly, time through ``now``."""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import replace
from datetime import timedelta

import pytest

from outboxkit import (
    FrozenClock,
    InvalidEvent,
    LeaseLostError,
    Outbox,
    Outcome,
    Store,
)
from outboxkit.core.machine import DeadLetter, Publish, Retry
from outboxkit.core.payload import build_event
from outboxkit.store import settle_one

from ._base import LEASE, ConformanceBase
from ._procs import claim_until_empty

__all__ = ["StoreLevelTests"]

S = timedelta(seconds=1)


class StoreLevelTests(ConformanceBase):
    # -- transactional visibility (R1) --------------------------------------------------------

    def test_committed_enqueue_is_visible(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", {"n": 1}))
        event = store.get(event_id)
        assert event is not None
        assert (event.topic, event.payload, event.attempts) == ("t", {"n": 1}, 0)
        assert event.available_at == clock.now()
        assert store.stats(now=clock.now()).pending == 1

    def test_rolled_back_enqueue_never_existed(self, store: Store, clock: FrozenClock) -> None:
        event = build_event("t", {"n": 1})
        ids: list[int] = []
        with pytest.raises(RuntimeError, match="app failed"), store.transaction() as conn:
            ids = store.enqueue(conn, [event], now=clock.now())
            raise RuntimeError("app failed")
        assert len(ids) == 1
        assert store.get(ids[0]) is None
        assert self.claim(store, clock.now()) == []
        assert store.stats(now=clock.now()).total == 0

    def test_enqueue_never_commits_the_callers_transaction(
        self, store: Store, clock: FrozenClock
    ) -> None:
        # Several enqueues, then a failure: if any enqueue had committed, something would remain.
        with pytest.raises(RuntimeError), store.transaction() as conn:
            store.enqueue(conn, [build_event("t", 1)], now=clock.now())
            store.enqueue(conn, [build_event("t", 2), build_event("t", 3)], now=clock.now())
            raise RuntimeError("roll back")
        assert store.stats(now=clock.now()).total == 0

    def test_enqueue_many_in_one_call(self, store: Store, clock: FrozenClock) -> None:
        ids = self.put(store, clock.now(), *[("t", i) for i in range(25)])
        assert len(set(ids)) == 25
        assert ids == sorted(ids)
        assert [store.get(i).payload for i in ids] == list(range(25))  # type: ignore[union-attr]

    def test_payload_headers_and_key_round_trip(self, store: Store, clock: FrozenClock) -> None:
        payload = {"s": "héllo ✓ 𝄞", "n": [1, 2.5, None, True], "big": 2**53 + 1, "o": {}}
        event = build_event("t", payload, headers={"trace": "abc"}, key="order-1")
        with store.transaction() as conn:
            (event_id,) = store.enqueue(conn, [event], now=clock.now())
        got = store.get(event_id)
        assert got is not None
        assert got.payload == payload
        assert dict(got.headers) == {"trace": "abc"}
        assert got.key == "order-1"

    def test_a_batch_keeps_each_events_topic_headers_key_and_delay(
        self, store: Store, clock: FrozenClock
    ) -> None:
        now = clock.now()
        events = [
            build_event('t "quoted" \\ é', {"n": 1}, headers={"a": 'b " c', "é": "✓"}, key='k "1"'),
            build_event("t", [1, "two"], delay=1.5),
            build_event("t", None, delay=timedelta(microseconds=1)),
        ]
        with store.transaction() as conn:
            ids = store.enqueue(conn, events, now=now)
        got = [store.get(i) for i in ids]
        assert all(e is not None for e in got)
        one, two, three = (e for e in got if e is not None)
        assert (one.topic, one.payload, dict(one.headers), one.key) == (
            't "quoted" \\ é',
            {"n": 1},
            {"a": 'b " c', "é": "✓"},
            'k "1"',
        )
        assert (two.payload, dict(two.headers), two.key) == ([1, "two"], {}, None)
        assert three.payload is None
        assert one.available_at == now
        assert two.available_at == now + timedelta(seconds=1.5)
        assert three.available_at == now + timedelta(microseconds=1)

    def test_bad_payload_rejected_before_any_write(
        self, store: Store, outbox: Outbox, clock: FrozenClock
    ) -> None:
        with store.transaction() as conn:
            for bad in ({"x": float("nan")}, {"x": "a\x00b"}, {"x": "\ud800"}, {1: "key"}, {1, 2}):
                with pytest.raises(InvalidEvent):
                    outbox.enqueue(conn, "t", bad)
            # The transaction is still usable: a good event commits with it.
            good = outbox.enqueue(conn, "t", {"ok": True})
        assert store.stats(now=clock.now()).total == 1
        assert store.get(good) is not None

    # -- due-ness and order (R2, R3) ----------------------------------------------------------

    def test_claim_takes_due_events_oldest_first(self, store: Store, clock: FrozenClock) -> None:
        now = clock.now()
        late = self.put(store, now, ("t", "late", 10))
        first = self.put(store, now - 5 * S, ("t", "first"))
        second = self.put(store, now - 5 * S, ("t", "second"))
        third = self.put(store, now, ("t", "third"))
        claims = self.claim(store, now)
        assert self.ids(claims) == first + second + third
        assert late[0] not in self.ids(claims)

    def test_delayed_event_is_due_at_its_time(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1, 60))
        assert self.claim(store, clock.now() + 59 * S) == []
        assert self.ids(self.claim(store, clock.now() + 60 * S)) == [event_id]

    def test_batch_limit_holds(self, store: Store, clock: FrozenClock) -> None:
        ids = self.put(store, clock.now(), *[("t", i) for i in range(7)])
        assert self.ids(self.claim(store, clock.now(), batch_size=3)) == ids[:3]
        assert self.ids(self.claim(store, clock.now(), batch_size=3)) == ids[3:6]
        assert self.ids(self.claim(store, clock.now(), batch_size=3)) == ids[6:]
        assert self.claim(store, clock.now(), batch_size=3) == []

    def test_claim_counts_the_attempt_and_sets_the_lease(
        self, store: Store, clock: FrozenClock
    ) -> None:
        self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now(), lease=timedelta(seconds=45))
        assert claim.attempt == 1
        assert claim.locked_until == clock.now() + timedelta(seconds=45)
        assert claim.token
        assert claim.done == {}
        event = store.get(claim.event.id)
        assert event is not None and event.attempts == 1
        assert store.stats(now=clock.now()).claimed == 1

    def test_leased_event_is_not_claimed_again(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1))
        assert len(self.claim(store, clock.now())) == 1
        assert self.claim(store, clock.now() + LEASE - S) == []

    def test_lease_expiry_makes_the_event_claimable(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (first,) = self.claim(store, clock.now())
        (second,) = self.claim(store, clock.now() + LEASE)
        assert second.event.id == event_id
        assert second.attempt == 2  # R4: the crashed attempt is used up
        assert second.token != first.token

    def test_claims_return_distinct_fresh_tokens(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), *[("t", i) for i in range(10)])
        tokens = [c.token for c in self.claim(store, clock.now())]
        assert len(set(tokens)) == 10

    # -- fencing ------------------------------------------------------------------------------

    def test_stale_token_changes_nothing(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (stale,) = self.claim(store, clock.now())
        later = clock.now() + LEASE
        (fresh,) = self.claim(store, later)
        assert settle_one(store, stale, Publish(), error=None, now=later) is False
        assert settle_one(store, stale, DeadLetter(), error="x", now=later) is False
        assert store.extend([stale], lease=LEASE, now=later) == []
        assert store.release([stale], now=later) == 0
        with pytest.raises(LeaseLostError), store.delivery(stale, now=later) as tx:
            tx.record("h", Outcome.SUCCEEDED)  # pragma: no cover - never reached
        event = store.get(event_id)
        assert event is not None and event.attempts == 2
        assert store.records(event_id) == []
        assert store.stats(now=later).claimed == 1
        # The new owner is unaffected.
        assert settle_one(store, fresh, Publish(), error=None, now=later) is True
        assert store.stats(now=later).published == 1

    def test_settle_twice_is_refused(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        assert settle_one(store, claim, Publish(), error=None, now=clock.now()) is True
        assert settle_one(store, claim, DeadLetter(), error="x", now=clock.now()) is False
        assert store.stats(now=clock.now()).published == 1
        assert store.stats(now=clock.now()).dead == 0

    def test_extend_pushes_the_lease(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1), ("t", 2))
        claims = self.claim(store, clock.now())
        later = clock.now() + 20 * S
        kept = store.extend(claims, lease=LEASE, now=later)
        assert sorted(self.ids(kept)) == sorted(self.ids(claims))
        assert all(c.locked_until == later + LEASE for c in kept)
        assert self.claim(store, clock.now() + LEASE + S) == []  # the old lease end passed
        assert len(self.claim(store, later + LEASE)) == 2

    def test_release_refunds_the_attempt(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        claims = self.claim(store, clock.now())
        assert store.release(claims, now=clock.now()) == 1
        (again,) = self.claim(store, clock.now())  # at once, no lease to wait out
        assert again.event.id == event_id
        assert again.attempt == 1

    # -- delivery records (R5, R6) ------------------------------------------------------------

    def test_delivery_commits_records_and_follow_ups(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            (follow_up,) = tx.enqueue([build_event("next", {"from": event_id})])
            tx.record("h1", Outcome.SUCCEEDED)
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("h2", Outcome.REJECTED, reason="no stock")
        records = {r.handler: r for r in store.records(event_id)}
        assert records["h1"].outcome is Outcome.SUCCEEDED
        assert records["h1"].attempt == 1
        assert records["h1"].recorded_at == clock.now()
        assert records["h2"].outcome is Outcome.REJECTED
        assert records["h2"].reason == "no stock"
        got = store.get(follow_up)
        assert got is not None and got.topic == "next" and got.payload == {"from": event_id}

    def test_failed_delivery_rolls_back(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        event_id = claim.event.id
        follow_up: list[int] = []
        with (
            pytest.raises(RuntimeError, match="handler failed"),
            store.delivery(claim, now=clock.now()) as tx,
        ):
            follow_up = tx.enqueue([build_event("next", 1)])
            tx.record("h1", Outcome.SUCCEEDED)
            raise RuntimeError("handler failed")
        assert store.records(event_id) == []
        assert store.get(follow_up[0]) is None
        assert store.stats(now=clock.now()).total == 1

    def test_recorded_handlers_come_back_with_the_claim(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("ok", Outcome.SUCCEEDED)
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("no", Outcome.REJECTED, reason="r")
        retry = Retry(delay=5 * S, retry=1)
        assert settle_one(store, claim, retry, error="other: boom", now=clock.now()) is True
        (again,) = self.claim(store, clock.now() + 5 * S)
        assert again.event.id == event_id
        assert dict(again.done) == {"ok": Outcome.SUCCEEDED, "no": Outcome.REJECTED}
        assert again.attempt == 2

    def test_delivery_record_is_unique_per_event_and_handler(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("h", Outcome.SUCCEEDED)
        with pytest.raises(Exception), store.delivery(claim, now=clock.now()) as tx:  # noqa: B017
            tx.record("h", Outcome.SUCCEEDED)
        assert len(store.records(event_id)) == 1

    # -- batches ------------------------------------------------------------------------------

    def test_batch_commits_once_and_a_savepoint_rolls_back_one_delivery(
        self, store: Store, clock: FrozenClock
    ) -> None:
        self.require(store, "batches")
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        claims = self.claim(store, clock.now())
        follow_ups: list[int] = []
        with store.batch(now=clock.now()) as batch:
            with batch.delivery(claims[0], now=clock.now()) as tx:
                follow_ups += tx.enqueue([build_event("next", 1)])
                tx.record("h", Outcome.SUCCEEDED)
            with (
                pytest.raises(RuntimeError, match="second fails"),
                batch.delivery(claims[1], now=clock.now()) as tx,
            ):
                follow_ups += tx.enqueue([build_event("next", 2)])
                tx.record("h", Outcome.SUCCEEDED)
                raise RuntimeError("second fails")
            with batch.delivery(claims[2], now=clock.now()) as tx:
                tx.record("h", Outcome.REJECTED, reason="no")
            assert settle_one(batch, claims[0], Publish(), error=None, now=clock.now()) is True
            retry = Retry(delay=5 * S, retry=1)
            assert settle_one(batch, claims[1], retry, error="h: boom", now=clock.now()) is True
            assert settle_one(batch, claims[2], Publish(), error=None, now=clock.now()) is True
            kept = batch.extend(claims, lease=LEASE, now=clock.now())
            assert self.ids(kept) == []  # all three settled already (in this transaction)
        one, two, three = (store.get(i) for i in ids)
        assert one is not None and one.published_at == clock.now()
        assert two is not None and two.published_at is None and two.last_error == "h: boom"
        assert two.available_at == clock.now() + 5 * S
        assert three is not None and three.published_at == clock.now()
        assert [r.outcome for r in store.records(ids[0])] == [Outcome.SUCCEEDED]
        assert store.records(ids[1]) == []
        assert [r.reason for r in store.records(ids[2])] == ["no"]
        assert store.get(follow_ups[0]) is not None
        assert store.get(follow_ups[1]) is None

    def test_settle_many_settles_each_fenced_by_its_token(
        self, store: Store, clock: FrozenClock
    ) -> None:
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3), ("t", 4))
        claims = self.claim(store, clock.now(), batch_size=3)
        (stale,) = self.claim(store, clock.now(), batch_size=1)
        assert store.release([stale], now=clock.now()) == 1
        (fresh,) = self.claim(store, clock.now(), batch_size=1)  # the 4th, a new token
        assert (fresh.event.id, fresh.attempt) == (stale.event.id, 1)
        later = clock.now() + S
        done = store.settle_many(
            [
                (claims[0], Publish(), None),
                (claims[1], Retry(delay=5 * S, retry=1), "h: boom"),
                (claims[2], DeadLetter(), "h: always"),
                (stale, Publish(), None),
            ],
            now=later,
        )
        assert done == [True, True, True, False]
        one, two, three, four = (store.get(i) for i in ids)
        assert one is not None and one.published_at == later
        assert two is not None and two.available_at == later + 5 * S
        assert two.last_error == "h: boom" and two.published_at is None
        assert three is not None and three.failed_at == later and three.last_error == "h: always"
        assert four is not None and four.published_at is None  # the stale token changed nothing
        assert store.settle_many([(fresh, Publish(), None)], now=later) == [True]
        assert store.settle_many([], now=later) == []

    def test_batch_settle_many_writes_in_the_batch(self, store: Store, clock: FrozenClock) -> None:
        """A batch's events are settled with one ``settle_many`` inside the batch: fenced by
        token, true once the batch commits, undone if it rolls back."""
        self.require(store, "batches")
        ids = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        claims = self.claim(store, clock.now(), batch_size=2)
        at = clock.now() + S
        with (
            pytest.raises(RuntimeError, match="batch dies"),
            store.batch(now=at) as batch,
        ):
            assert batch.settle_many([(claims[0], Publish(), None)], now=at) == [True]
            raise RuntimeError("batch dies")
        undone = store.get(ids[0])
        assert undone is not None and undone.published_at is None
        (other,) = self.claim(store, clock.now(), batch_size=1)  # the third, not in the batch
        with store.batch(now=at) as batch:
            for claim in claims:
                with batch.delivery(claim, now=at) as tx:
                    tx.record("h", Outcome.SUCCEEDED)
            done = batch.settle_many(
                [
                    (claims[0], Publish(), None),
                    (claims[1], Retry(delay=5 * S, retry=1), "h: boom"),
                    (replace(other, token=claims[0].token), Publish(), None),
                ],
                now=at,
            )
            assert batch.settle_many([], now=at) == []
        assert done == [True, True, False]
        one, two, three = (store.get(i) for i in ids)
        assert one is not None and one.published_at == at
        assert two is not None and two.available_at == at + 5 * S and two.last_error == "h: boom"
        assert three is not None and three.published_at is None  # a foreign token settles nothing
        assert settle_one(store, other, Publish(), error=None, now=at) is True

    def test_batch_that_raises_leaves_nothing(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "batches")
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        with (
            pytest.raises(RuntimeError, match="poller died"),
            store.batch(now=clock.now()) as batch,
        ):
            with batch.delivery(claim, now=clock.now()) as tx:
                tx.enqueue([build_event("next", 1)])
                tx.record("h", Outcome.SUCCEEDED)
            assert settle_one(batch, claim, Publish(), error=None, now=clock.now()) is True
            raise RuntimeError("poller died")
        event = store.get(event_id)
        assert event is not None and event.published_at is None
        assert store.records(event_id) == []
        assert store.stats(now=clock.now()).total == 1  # no follow-up
        # The claim still holds: once its lease passes, another poller takes the event over.
        assert self.claim(store, clock.now()) == []
        (again,) = self.claim(store, clock.now() + LEASE)
        assert (again.event.id, again.attempt, dict(again.done)) == (event_id, 2, {})

    def test_batch_refuses_a_stale_token(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "batches")
        self.put(store, clock.now(), ("t", 1))
        (stale,) = self.claim(store, clock.now())
        (fresh,) = self.claim(store, clock.now() + LEASE)
        with store.batch(now=clock.now() + LEASE) as batch:
            with pytest.raises(LeaseLostError), batch.delivery(stale, now=clock.now() + LEASE):
                pass
            assert settle_one(batch, stale, Publish(), error=None, now=clock.now() + LEASE) is False
            assert batch.extend([stale], lease=LEASE, now=clock.now() + LEASE) == []
        assert settle_one(store, fresh, Publish(), error=None, now=clock.now() + LEASE) is True

    # -- settle (R8, R10, R12) ----------------------------------------------------------------

    def test_publish_sets_published_at(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        at = clock.now() + 3 * S
        assert settle_one(store, claim, Publish(), error=None, now=at) is True
        stats = store.stats(now=at)
        assert (stats.published, stats.pending, stats.claimed) == (1, 0, 0)
        assert self.claim(store, at + 1000 * LEASE) == []
        assert store.get(event_id) is not None

    def test_retry_schedules_available_at(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        (claim,) = self.claim(store, clock.now())
        at = clock.now() + 2 * S
        assert settle_one(store, claim, Retry(delay=8 * S, retry=1), error="h: boom", now=at)
        event = store.get(event_id)
        assert event is not None
        assert event.available_at == at + 8 * S
        assert event.attempts == 1
        assert self.claim(store, at + 7 * S) == []  # lease cleared, but not yet available
        (again,) = self.claim(store, at + 8 * S)
        assert again.attempt == 2

    def test_dead_letter_is_never_claimed_until_requeued(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", {"p": 1}))
        (claim,) = self.claim(store, clock.now())
        with store.delivery(claim, now=clock.now()) as tx:
            tx.record("done-handler", Outcome.SUCCEEDED)
        assert settle_one(store, claim, DeadLetter(), error="h: boom", now=clock.now())
        far = clock.now() + timedelta(days=365)
        assert self.claim(store, far) == []
        (dead,) = store.dead_letters()
        assert dead.event.id == event_id
        assert dead.failed_at == clock.now()
        assert dead.last_error == "h: boom"
        assert [r.handler for r in dead.records] == ["done-handler"]
        assert store.stats(now=far).dead == 1
        assert store.requeue([event_id, 999_999], now=far) == 1
        (again,) = self.claim(store, far)
        assert again.event.id == event_id
        assert again.attempt == 1  # attempts reset
        assert dict(again.done) == {"done-handler": Outcome.SUCCEEDED}
        assert store.dead_letters() == []

    def test_requeue_ignores_events_that_are_not_dead(
        self, store: Store, clock: FrozenClock
    ) -> None:
        (pending,) = self.put(store, clock.now(), ("t", 1))
        assert store.requeue([pending], now=clock.now()) == 0
        event = store.get(pending)
        assert event is not None and event.attempts == 0

    def test_dead_letters_filter_by_topic_and_since(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), ("a", 1), ("b", 2))
        claims = self.claim(store, clock.now())
        for offset, claim in enumerate(claims):
            settle_one(store, claim, DeadLetter(), error="x", now=clock.now() + offset * S)
        assert [d.event.topic for d in store.dead_letters()] == ["a", "b"]
        assert [d.event.topic for d in store.dead_letters(topic="b")] == ["b"]
        assert [d.event.topic for d in store.dead_letters(since=clock.now() + S)] == ["b"]
        assert len(store.dead_letters(limit=1)) == 1

    # -- operations ---------------------------------------------------------------------------

    def test_purge_published_leaves_pending_and_dead(
        self, store: Store, clock: FrozenClock
    ) -> None:
        now = clock.now()
        old, new, dead, _pending_id = self.put(store, now, ("t", 1), ("t", 2), ("t", 3), ("t", 4))
        claims = {c.event.id: c for c in self.claim(store, now, batch_size=3)}
        with store.delivery(claims[old], now=now) as tx:
            tx.record("h", Outcome.SUCCEEDED)
        settle_one(store, claims[old], Publish(), error=None, now=now)
        settle_one(store, claims[new], Publish(), error=None, now=now + 10 * S)
        settle_one(store, claims[dead], DeadLetter(), error="x", now=now)
        deleted = store.purge_published(before=now + 5 * S, limit=1000)
        assert deleted == 1
        assert store.get(old) is None
        assert store.records(old) == []
        assert store.get(new) is not None
        stats = store.stats(now=now + 10 * S)
        assert (stats.published, stats.dead, stats.pending) == (1, 1, 1)

    def test_purge_published_in_pages(self, store: Store, clock: FrozenClock) -> None:
        self.put(store, clock.now(), *[("t", i) for i in range(5)])
        for claim in self.claim(store, clock.now()):
            settle_one(store, claim, Publish(), error=None, now=clock.now())
        later = clock.now() + S
        assert store.purge_published(before=later, limit=2) == 2
        assert store.purge_published(before=later, limit=2) == 2
        assert store.purge_published(before=later, limit=2) == 1
        assert store.purge_published(before=later, limit=2) == 0

    def test_purge_dead_by_id_and_age(self, store: Store, clock: FrozenClock) -> None:
        a, b, c = self.put(store, clock.now(), ("t", 1), ("t", 2), ("t", 3))
        for offset, claim in enumerate(self.claim(store, clock.now())):
            settle_one(store, claim, DeadLetter(), error="x", now=clock.now() + offset * 10 * S)
        assert store.purge_dead(ids=[b], limit=100) == 1
        assert store.purge_dead(before=clock.now() + 15 * S, limit=100) == 1  # a only
        assert [d.event.id for d in store.dead_letters()] == [c]
        assert store.get(a) is None and store.get(b) is None

    def test_stats_counts_by_state_and_topic(self, store: Store, clock: FrozenClock) -> None:
        now = clock.now()
        self.put(store, now - 10 * S, ("a", 1))
        self.put(store, now, ("a", 2), ("b", 3), ("b", 4), ("c", 5, 60))
        c1, c2, c3 = self.claim(store, now, batch_size=3)
        settle_one(store, c1, Publish(), error=None, now=now)
        settle_one(store, c2, DeadLetter(), error="x", now=now)
        # c3 stays claimed; one "b" is pending and due; "c" is pending but delayed.
        assert c3.event.topic == "b"
        stats = store.stats(now=now)
        assert (stats.pending, stats.claimed, stats.published, stats.dead) == (2, 1, 1, 1)
        assert dict(stats.by_topic["a"]) == {"published": 1, "dead": 1}
        assert dict(stats.by_topic["b"]) == {"claimed": 1, "pending": 1}
        assert dict(stats.by_topic["c"]) == {"pending": 1}
        assert stats.oldest_due_at == now  # the delayed "c" event does not count

    def test_migrate_is_idempotent(self, store: Store, clock: FrozenClock) -> None:
        (event_id,) = self.put(store, clock.now(), ("t", 1))
        store.migrate()
        store.migrate()
        assert store.get(event_id) is not None
        assert store.stats(now=clock.now()).pending == 1

    # -- time ---------------------------------------------------------------------------------

    def test_store_honours_the_given_time(self, store: Store) -> None:
        y2001 = FrozenClock("2001-01-01T00:00:00Z").now()
        y2099 = FrozenClock("2099-06-01T12:00:00Z").now()
        (event_id,) = self.put(store, y2001, ("t", 1))
        event = store.get(event_id)
        assert event is not None
        assert event.created_at == y2001 and event.available_at == y2001
        assert self.claim(store, y2001 - S) == []
        (claim,) = self.claim(store, y2001)
        assert claim.locked_until == y2001 + LEASE
        (again,) = self.claim(store, y2099)  # the 2001 lease is long gone
        assert again.attempt == 2
        assert again.locked_until == y2099 + LEASE
        assert settle_one(store, again, Publish(), error=None, now=y2099) is True
        (future,) = self.put(store, y2099, ("t", 2, 3600))
        assert self.claim(store, y2099) == []
        assert self.ids(self.claim(store, y2099 + timedelta(hours=1))) == [future]

    def test_production_clock_path(self, store: Store) -> None:
        # now=None: the store's own clock (the database clock where it has one).
        (event_id,) = self.put(store, None, ("t", 1))
        (claim,) = self.claim(store, None)
        assert claim.event.id == event_id
        assert settle_one(store, claim, Publish(), error=None, now=None) is True
        assert store.stats(now=None).published == 1

    def test_now_is_the_stores_production_clock(self, store: Store) -> None:
        # What now=None means: an aware instant; an event enqueued with now=None is stamped
        # with it (the store's clock is where every cutoff comes from).
        before = store.now()
        assert before.utcoffset() is not None
        (event_id,) = self.put(store, None, ("t", 1))
        after = store.now()
        event = store.get(event_id)
        assert event is not None and event.created_at is not None
        slack = timedelta(seconds=5)  # a database clock is read at its own statement's start
        assert before - slack <= event.created_at <= after + slack

    # -- text ---------------------------------------------------------------------------------

    def test_any_storable_text_round_trips(self, store: Store, clock: FrozenClock) -> None:
        # What outboxkit stores besides validated events - error texts, rejection reasons -
        # passes through outboxkit.core.text.storable first: no NUL, no lone surrogate, but
        # anything else a store must keep exactly.
        text = "quotes ' \" back\\slash %s %(x)s ; -- \x01\x1b[2J\t\n 日本 😀 \u202e x" * 20
        (reject_id, dead_id) = self.put(store, clock.now(), ("t", 1), ("t", 2))
        claims = {c.event.id: c for c in self.claim(store, clock.now())}
        with store.delivery(claims[reject_id], now=clock.now()) as tx:
            tx.record("h", Outcome.REJECTED, reason=text)
        assert settle_one(store, claims[reject_id], Publish(), error=None, now=clock.now())
        assert settle_one(store, claims[dead_id], DeadLetter(), error=text, now=clock.now())
        assert [r.reason for r in store.records(reject_id)] == [text]
        (letter,) = store.dead_letters()
        assert letter.last_error == text

    # -- concurrency --------------------------------------------------------------------------

    def test_two_threads_never_claim_the_same_event(self, store: Store, clock: FrozenClock) -> None:
        self.require(store, "concurrent_claimers")
        total = 1000
        for start in range(0, total, 250):
            self.put(store, clock.now(), *[("t", i) for i in range(start, start + 250)])
        seen: list[list[int]] = [[], []]
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def work(slot: int) -> None:
            try:
                barrier.wait(timeout=30)
                while claims := self.claim(store, clock.now(), batch_size=7):
                    seen[slot].extend(self.ids(claims))
                    for claim in claims:
                        assert settle_one(store, claim, Publish(), error=None, now=clock.now())
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(slot,)) for slot in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "claimer threads did not finish"
        assert errors == []
        both = seen[0] + seen[1]
        assert len(both) == total
        assert len(set(both)) == total
        assert set(seen[0]).isdisjoint(seen[1])
        assert store.stats(now=clock.now()).published == total

    def test_two_processes_never_claim_the_same_event(
        self, store: Store, clock: FrozenClock
    ) -> None:
        self.require(store, "multiprocess")
        total = 1000
        for start in range(0, total, 250):
            self.put(store, clock.now(), *[("t", i) for i in range(start, start + 250)])
        url, options = store.url, dict(store.options)
        context = multiprocessing.get_context("spawn")
        with context.Pool(2) as pool:
            jobs = [
                pool.apply_async(claim_until_empty, (url, options, clock.now().isoformat(), 7))
                for _ in range(2)
            ]
            seen = [job.get(timeout=300) for job in jobs]
        both = seen[0] + seen[1]
        assert len(both) == total
        assert len(set(both)) == total
        assert store.stats(now=clock.now()).published == total
