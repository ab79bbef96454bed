"""Enqueue (R1): an event exists iff the caller's transaction commits, and comes back as it
was written (topic, payload, headers, key, delay), with a message identity of its own. A key
is written only to a store that keeps per-key order (``capabilities.ordering``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from outboxkit import FrozenClock, InvalidEvent, Outbox, Store
from outboxkit.core.machine import DeadLetter
from outboxkit.core.payload import build_event

from ._base import ConformanceBase

__all__ = ["EnqueueTests"]


class EnqueueTests(ConformanceBase):
    """Transactional visibility and round-tripping of what ``enqueue`` writes."""

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
        key = _key(store, "order-1")
        event = build_event("t", payload, headers={"trace": "abc"}, key=key)
        with store.transaction() as conn:
            (event_id,) = store.enqueue(conn, [event], now=clock.now())
        got = store.get(event_id)
        assert got is not None
        assert got.payload == payload
        assert dict(got.headers) == {"trace": "abc"}
        assert got.key == key

    def test_a_batch_keeps_each_events_topic_headers_key_and_delay(
        self, store: Store, clock: FrozenClock
    ) -> None:
        now = clock.now()
        key = _key(store, 'k "1"')
        events = [
            build_event('t "quoted" \\ é', {"n": 1}, headers={"a": 'b " c', "é": "✓"}, key=key),
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
            key,
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

    def test_events_carry_a_message_id_unique_across_stores(
        self, store: Store, clock: FrozenClock, tmp_path: Path
    ) -> None:
        """``Event.message_id`` is an event's identity outside its store: the relays send it
        as the message's id and a consumer's inbox keys on it. Event ids are unique in one
        store only (two stores both have an event 1), so the store draws it, unique across
        stores, when the event is written; every read gives the same one (``get``,
        ``events``, the claim, ``dead_letters``)."""
        now = clock.now()
        ids = self.put(store, now, *[("t", n) for n in range(3)])
        with self.another_store(tmp_path) as other:
            other_ids = self.put(other, now, *[("t", n) for n in range(3)])
            theirs = [other.get(i) for i in other_ids]
        ours = [store.get(i) for i in ids]
        assert all(e is not None for e in ours + theirs)
        mine = [e.message_id for e in ours if e is not None]
        other_ones = {e.message_id for e in theirs if e is not None}
        assert all(isinstance(m, str) and m for m in mine), mine
        assert len(set(mine)) == 3, f"message ids repeat in one store: {mine}"
        assert not set(mine) & other_ones, (
            f"two stores' events share message ids: {sorted(set(mine) & other_ones)}"
        )
        assert [e.message_id for e in store.events() if e.id in ids] == mine
        claims = self.claim(store, now)
        assert [c.event.message_id for c in claims] == mine
        assert store.settle_many([(claims[0], DeadLetter(), "h: boom")], now=now) == [True]
        (dead,) = store.dead_letters()
        assert dead.event.message_id == mine[0]
        again = store.get(ids[0])
        assert again is not None and again.message_id == mine[0]


def _key(store: Store, key: str) -> str | None:
    """``key`` for a store that keeps per-key order, None for one without (``Outbox`` never
    hands it a key)."""
    return key if "ordering" in store.capabilities else None
