"""A delivery's opening (XA START or the batch's savepoint, the token check and row lock) goes
to the server with the handler's first statement, in its round trip (``LazyDelivery.defer``,
``StoreConnection.query``): the handler gets its own statement's answer; with a stale token it
gets ``LeaseLostError`` instead, and nothing of its statement commits, whatever it does next
(R6). Every test runs in a database of its own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import pymysql.cursors
import pytest

from outboxkit import LeaseLostError, Outcome, StoreError
from outboxkit.storekit import Claim
from outboxkit_mysql import MySQLStore

from .server import migrated_store

LEASE = timedelta(seconds=30)


@pytest.fixture
def store(mysql_server: str) -> Iterator[MySQLStore]:
    with migrated_store() as made:
        with made.dialect.write("ledger") as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE ledger (event_id BIGINT NOT NULL) ENGINE=InnoDB")
        yield made


def claims(store: MySQLStore, count: int) -> tuple[list[Claim], Any]:
    """``count`` fresh claims, and the instant they were claimed at."""
    with store.transaction() as tx:
        store.enqueue(tx, [_event(n) for n in range(count)], now=None)
    now = store.now()
    return store.claim(batch_size=count, lease=LEASE, now=now), now


def _event(n: int) -> Any:
    from outboxkit.core.payload import build_event

    return build_event("t", {"n": n})


def ledger(store: MySQLStore) -> list[int]:
    with store.dialect.read("ledger") as conn, conn.cursor() as cur:
        cur.execute("SELECT event_id FROM ledger ORDER BY event_id")
        return [row[0] for row in cur.fetchall()]


def write(tx: Any, claim: Claim) -> None:
    """A handler's work: one ledger row, then its record."""
    with tx.connection.cursor() as cur:
        cur.execute("INSERT INTO ledger (event_id) VALUES (%s)", (claim.event.id,))
    tx.record("h", Outcome.SUCCEEDED)


Deliveries = Callable[[MySQLStore, Claim, Any], AbstractContextManager[Any]]


@contextlib.contextmanager
def in_batch(store: MySQLStore, claim: Claim, now: Any) -> Iterator[Any]:
    with store.batch(now=now) as batch, batch.delivery(claim, now=now) as tx:
        yield tx


def per_event(store: MySQLStore, claim: Claim, now: Any) -> AbstractContextManager[Any]:
    return store.delivery(claim, now=now)


MODES = pytest.mark.parametrize("deliver", [per_event, in_batch], ids=["per_event", "per_batch"])


@MODES
def test_the_handler_gets_its_own_statements_answer(store: MySQLStore, deliver: Deliveries) -> None:
    (claim,), now = claims(store, 1)
    with deliver(store, claim, now) as tx:
        with tx.connection.cursor() as cur:
            assert cur.execute("SELECT 7, 'seven' UNION ALL SELECT 8, 'eight'") == 2
            assert cur.fetchall() == ((7, "seven"), (8, "eight"))
            cur.execute("INSERT INTO ledger (event_id) VALUES (%s)", (claim.event.id,))
            assert cur.rowcount == 1
        tx.record("h", Outcome.SUCCEEDED)
    assert ledger(store) == [claim.event.id]
    assert [r.handler for r in store.records(claim.event.id)] == ["h"]


@MODES
def test_an_unbuffered_first_statement_streams_its_rows(
    store: MySQLStore, deliver: Deliveries
) -> None:
    (claim,), now = claims(store, 1)
    with deliver(store, claim, now) as tx:
        with tx.connection.cursor(pymysql.cursors.SSCursor) as cur:
            cur.execute("SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3")
            assert [row[0] for row in cur] == [1, 2, 3]
        write(tx, claim)
    assert ledger(store) == [claim.event.id]


def _stale(store: MySQLStore) -> tuple[Claim, Claim, Any]:
    (stale,), now = claims(store, 1)
    later = now + LEASE
    (fresh,) = store.claim(batch_size=1, lease=LEASE, now=later)
    return stale, fresh, later


@MODES
@pytest.mark.parametrize(
    "first",
    [
        "INSERT INTO ledger (event_id) VALUES (%(id)s)",
        "SELECT 1 UNION ALL SELECT 2",
        "INSERT INTO ledger (event_id) VALUES (%(id)s); INSERT INTO ledger VALUES (%(id)s)",
        "INSERT INTO no_such_table VALUES (1)",
    ],
    ids=["write", "read", "two-statements", "failing"],
)
def test_a_stale_token_refuses_the_first_statement_and_commits_nothing(
    store: MySQLStore, deliver: Deliveries, first: str
) -> None:
    stale, fresh, later = _stale(store)
    refused: list[BaseException] = []
    with pytest.raises(LeaseLostError), deliver(store, stale, later) as tx:
        with tx.connection.cursor() as cur:
            try:
                cur.execute(first, {"id": stale.event.id})
            except LeaseLostError as exc:  # a handler that swallows it, and goes on
                refused.append(exc)
        tx.record("h", Outcome.SUCCEEDED)
    assert len(refused) == 1
    assert ledger(store) == []
    assert store.records(stale.event.id) == []
    # The connection serves on: the new owner's delivery commits.
    with store.delivery(fresh, now=later) as tx:
        write(tx, fresh)
    assert ledger(store) == [fresh.event.id]


@MODES
def test_a_connection_taken_and_never_used_opens_at_the_end(
    store: MySQLStore, deliver: Deliveries
) -> None:
    (claim,), now = claims(store, 1)
    with deliver(store, claim, now) as tx:
        assert tx.connection is not None
        tx.record("h", Outcome.SUCCEEDED)
    assert [r.handler for r in store.records(claim.event.id)] == ["h"]


@MODES
def test_a_stale_connection_taken_and_never_used_is_refused_at_the_end(
    store: MySQLStore, deliver: Deliveries
) -> None:
    stale, _, later = _stale(store)
    with pytest.raises(LeaseLostError), deliver(store, stale, later) as tx:
        assert tx.connection is not None
        tx.record("h", Outcome.SUCCEEDED)
    assert store.records(stale.event.id) == []


def test_a_batch_goes_on_after_a_stale_delivery(store: MySQLStore) -> None:
    (stale, mine), now = claims(store, 2)
    later = now + LEASE
    (fresh,) = store.claim(batch_size=1, lease=LEASE, now=later)
    assert fresh.event.id == stale.event.id
    with store.batch(now=later) as batch:
        for claim in (stale, mine):
            with contextlib.suppress(LeaseLostError), batch.delivery(claim, now=later) as tx:
                write(tx, claim)
    assert ledger(store) == [mine.event.id]
    assert store.records(stale.event.id) == []
    assert [r.handler for r in store.records(mine.event.id)] == ["h"]


def test_a_stale_unbuffered_first_statement_closes_the_connection(store: MySQLStore) -> None:
    """Its rows are not read to be dropped: the connection closes (the server rolls the
    delivery back), and the store goes on with another."""
    stale, fresh, later = _stale(store)
    with (
        pytest.raises(LeaseLostError),
        store.delivery(stale, now=later) as tx,
        tx.connection.cursor(pymysql.cursors.SSCursor) as cur,
    ):
        cur.execute("SELECT 1 UNION ALL SELECT 2")
    assert store.records(stale.event.id) == []
    with store.delivery(fresh, now=later) as tx:
        write(tx, fresh)
    assert ledger(store) == [fresh.event.id]


def test_a_stale_unbuffered_first_statement_in_a_batch_fails_the_batch(
    store: MySQLStore,
) -> None:
    """In a batch the closed connection was the batch's: it fails as the store's failure, and
    nothing of it commits."""
    (stale, mine), now = claims(store, 2)
    later = now + LEASE
    store.claim(batch_size=1, lease=LEASE, now=later)
    with pytest.raises(StoreError), store.batch(now=later) as batch:
        with batch.delivery(mine, now=later) as tx:
            write(tx, mine)
        with (
            contextlib.suppress(LeaseLostError),
            batch.delivery(stale, now=later) as tx,
            tx.connection.cursor(pymysql.cursors.SSCursor) as cur,
        ):
            cur.execute("SELECT 1 UNION ALL SELECT 2")
        batch.settle_many([], now=later)
    assert ledger(store) == []
    assert store.records(mine.event.id) == []


def test_a_batch_told_its_claims_checks_them_all_at_its_first_opening(store: MySQLStore) -> None:
    """``Batch.claimed`` (both pollers call it): the tokens are checked and the rows locked
    once, at the first delivery that opens; a delivery then sends only its savepoint with the
    handler's statement, and one whose claim went stale before is refused at once."""
    (first, stale, last), now = claims(store, 3)
    later = now + LEASE
    (fresh,) = store.claim(batch_size=1, lease=LEASE, now=later)  # the oldest expired one
    assert fresh.event.id == first.event.id
    with store.batch(now=later) as batch:
        batch.claimed([first, stale, last])
        # The first is refused (taken over); the others, whose leases ran out but were not
        # taken, are still this batch's (their tokens hold) and are locked now.
        with pytest.raises(LeaseLostError), batch.delivery(first, now=later) as tx:
            assert tx.connection is not None
        assert batch.owned == {first.token: False, stale.token: True, last.token: True}
        for claim in (stale, last):
            with batch.delivery(claim, now=later) as tx:
                write(tx, claim)
        # Meanwhile another poller, once every lease ran out, takes only the event the batch
        # lost: it holds the rows of the others.
        taken = store.claim(batch_size=10, lease=LEASE, now=later + 2 * LEASE)
        assert [claim.event.id for claim in taken] == [first.event.id]
    assert ledger(store) == [stale.event.id, last.event.id]
    assert store.records(first.event.id) == []


def test_a_claim_the_batch_was_not_told_of_is_checked_on_its_own(store: MySQLStore) -> None:
    (told, untold), now = claims(store, 2)
    with store.batch(now=now) as batch:
        batch.claimed([told])
        for claim in (told, untold):
            with batch.delivery(claim, now=now) as tx:
                write(tx, claim)
        assert batch.owned == {told.token: True}
    assert ledger(store) == [told.event.id, untold.event.id]
