"""The round-trip budget of a delivery on MariaDB/MySQL, per path: every statement flight a
store connection sends (``StoreConnection.query``: one ``COM_QUERY``, one round trip, however
many statements it carries), counted as the difference between a drain of 2N events and one of
N, so that the batch's own claim, records and settlement drop out; and the answers among them
that carry rows (a result set for PyMySQL to parse, in Python: the dearest answer a statement
gets). A change that adds a round trip or a result set to a delivery fails here; one that
removes some updates the table."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import Event, EventBus, Outbox
from outboxkit_mysql.dialect import StoreConnection

from .server import migrated_store

N = 10

# (Round trips, result sets) per event, the handler's own statement included. A delivery's
# opening (XA START or the savepoint, the token check and row lock) travels with the handler's
# first statement; the token check selects INTO a variable: its answer is an OK packet with a
# row count, not a result set.
BUDGET = {
    # The opening with the handler's INSERT (after a handler had the connection, the session
    # set back first, in the same flight); the record with XA END and XA COMMIT.
    ("per_event", "writes"): (2, 0),
    # A handler that never takes the connection: its record, fenced by the token, alone.
    ("per_event", "noop"): (1, 0),
    # The savepoint with the handler's INSERT: the batch checked every token and locked the
    # rows once, at its first delivery (Batch.lock); the records are written with the batch's
    # commit, all at once.
    ("per_batch", "writes"): (1, 0),
    ("per_batch", "noop"): (0, 0),
}


def _has_rows(conn: StoreConnection) -> int:
    result = conn._result  # PyMySQL's answer to the last statement read
    return int(result is not None and result.description is not None)


def round_trips(transaction: str, handler: str, events: int) -> tuple[int, int]:
    counted = [0, 0]
    query, next_result = StoreConnection.query, StoreConnection.next_result

    def counting(self: StoreConnection, sql: Any, unbuffered: bool = False) -> int:
        counted[0] += 1
        found = query(self, sql, unbuffered)
        counted[1] += _has_rows(self)
        return found

    def counting_next(self: StoreConnection, unbuffered: bool = False) -> int:
        found: int = next_result(self, unbuffered)
        counted[1] += _has_rows(self)
        return found

    with migrated_store() as store:
        with store.dialect.write("ledger") as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE ledger (event_id BIGINT NOT NULL) ENGINE=InnoDB")
        bus = EventBus()

        @bus.handler("t", name="h")
        def handle(event: Event, ctx: Any) -> None:
            if handler == "writes":
                with ctx.connection.cursor() as cur:
                    cur.execute("INSERT INTO ledger (event_id) VALUES (%s)", (event.id,))

        outbox = Outbox(store, bus, load_entry_points=False)
        with store.transaction() as tx:
            outbox.enqueue_many(tx, [("t", {"n": n}) for n in range(events)])
        poller = outbox.poller(transaction=transaction, batch_size=100)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(StoreConnection, "query", counting)
            patch.setattr(StoreConnection, "next_result", counting_next)
            report = poller.run_once()
        assert len(report.published) == events
    return counted[0], counted[1]


@pytest.mark.parametrize("handler", ["writes", "noop"])
@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_the_delivery_budget(mysql_server: str, transaction: str, handler: str) -> None:
    (flights_2n, rows_2n), (flights_n, rows_n) = (
        round_trips(transaction, handler, 2 * N),
        round_trips(transaction, handler, N),
    )
    per_event = ((flights_2n - flights_n) / N, (rows_2n - rows_n) / N)
    assert per_event == BUDGET[(transaction, handler)], per_event
