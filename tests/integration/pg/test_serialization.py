"""A serialization failure in the app's own transaction is a ``SerializationFailure`` (retry the
whole transaction), not "PostgreSQL ... is unavailable" (bug 12).

Sixteen enqueuers, each in a ``REPEATABLE READ`` transaction of its own that has taken its
snapshot, enqueue the same dedupe keys at once; PostgreSQL lets one writer per key commit and
fails the others (SQLSTATE 40001: the row that took the key is invisible to their snapshots).
Each then retries its whole transaction, as ``SerializationFailure`` says to.
"""

from __future__ import annotations

import threading
from collections import Counter

import psycopg
import pytest
from psycopg import IsolationLevel

from outboxkit import (
    EventBus,
    Outbox,
    SerializationFailure,
    StoreError,
    StoreUnavailable,
)
from outboxkit_pg import PostgresStore
from outboxkit_pg.errors import SQLSTATES

pytestmark = pytest.mark.pg

ENQUEUERS = 16
KEYS = ("order-1-placed", "order-2-placed")
MAX_TRIES = 10  # a bound, not a tuning: each retry of a loser finds the key taken at once
TIMEOUT = 60.0  # seconds: the most a thread may take (a guard against a hang, never waited out)


def _enqueue_once(
    pg_url: str, outbox: Outbox, key: str, start: threading.Barrier | None
) -> int | SerializationFailure:
    """One REPEATABLE READ transaction: take its snapshot, wait for the others (first try
    only), enqueue with ``key``, commit. Its event id, or the ``SerializationFailure``."""
    with psycopg.connect(pg_url) as conn:
        conn.isolation_level = IsolationLevel.REPEATABLE_READ
        try:
            with conn.transaction():
                conn.execute("SELECT 1")  # the snapshot is taken here, before anyone enqueues
                if start is not None:
                    start.wait(TIMEOUT)
                return outbox.enqueue(conn, "order.placed", {"key": key}, dedupe_key=key)
        except SerializationFailure as failure:
            return failure


def test_dedupe_under_repeatable_read(pg_url: str, pg_store: PostgresStore) -> None:
    outbox = Outbox(pg_store, EventBus(), load_entry_points=False)
    start = threading.Barrier(ENQUEUERS)
    first: list[int | SerializationFailure | BaseException] = [0] * ENQUEUERS
    final: list[int | None] = [None] * ENQUEUERS
    tries = [0] * ENQUEUERS

    def enqueuer(n: int) -> None:
        key = KEYS[n % len(KEYS)]
        try:
            result = first[n] = _enqueue_once(pg_url, outbox, key, start)
            tries[n] = 1
            while isinstance(result, SerializationFailure) and tries[n] < MAX_TRIES:
                result = _enqueue_once(pg_url, outbox, key, None)  # the whole transaction again
                tries[n] += 1
            final[n] = result if isinstance(result, int) else None
        except BaseException as exc:  # anything else is the bug: kept for the assertion
            first[n] = exc
            start.abort()

    threads = [threading.Thread(target=enqueuer, args=(n,)) for n in range(ENQUEUERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)

    # Every first try either enqueued or failed as a serialization failure, never "unavailable".
    unexpected = [r for r in first if not isinstance(r, int | SerializationFailure)]
    assert unexpected == []
    failures = [r for r in first if isinstance(r, SerializationFailure)]
    assert len(failures) == ENQUEUERS - len(KEYS)  # one writer per key won; every other lost
    for failure in failures:
        assert isinstance(failure, StoreError) and not isinstance(failure, StoreUnavailable)
        message = str(failure)
        assert "a concurrent transaction won (SQLSTATE 40001)" in message, message
        assert "run the whole transaction again" in message and "unavailable" not in message
    # After retrying, every enqueuer has its key's one event, and each key has exactly one.
    assert all(event_id is not None for event_id in final)
    by_key: dict[str, set[int | None]] = {key: set() for key in KEYS}
    for n, event_id in enumerate(final):
        by_key[KEYS[n % len(KEYS)]].add(event_id)
    assert all(len(ids) == 1 for ids in by_key.values()), by_key
    assert max(tries) == 2  # a loser's retry found the key taken and returned its holder
    stored = Counter(e.payload["key"] for e in pg_store.events(limit=100))
    assert stored == Counter({key: 1 for key in KEYS})


def test_deadlock_is_a_serialization_failure_too(pg_url: str, pg_store: PostgresStore) -> None:
    """40P01 is of the same family (a concurrent transaction was chosen to lose; run it again):
    two app transactions each take one dedupe key, then each enqueues the other's. PostgreSQL
    aborts one of them (deadlock_timeout shortened for the test's sessions)."""
    assert SQLSTATES["40001"] is SerializationFailure
    assert SQLSTATES["40P01"] is SerializationFailure
    outbox = Outbox(pg_store, EventBus(), load_entry_points=False)
    start = threading.Barrier(2)
    results: list[int | BaseException | None] = [None, None]

    def transaction(n: int) -> None:
        mine, theirs = ("x", "y") if n == 0 else ("y", "x")
        try:
            with psycopg.connect(pg_url) as conn, conn.transaction():
                conn.execute("SET LOCAL deadlock_timeout = '10ms'")
                outbox.enqueue(conn, "t", {}, dedupe_key=mine)
                start.wait(TIMEOUT)
                results[n] = outbox.enqueue(conn, "t", {}, dedupe_key=theirs)
        except BaseException as exc:
            results[n] = exc
            start.abort()

    threads = [threading.Thread(target=transaction, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(lost) == 1 and type(lost[0]) is SerializationFailure, results
    assert "a concurrent transaction won (SQLSTATE 40P01)" in str(lost[0])
    won = [r for r in results if isinstance(r, int)]
    assert len(won) == 1
    assert len(pg_store.events()) == 2  # the winner's two events; nothing of the loser
