"""The round-trip budget of a delivery on MariaDB/MySQL, per path: every statement flight a
store connection sends (``StoreConnection.query``: one ``COM_QUERY``, one round trip, however
many statements it carries), counted as the difference between a drain of 2N events and one of
N, so that the batch's own claim, records and settlement drop out. A change that adds a round
trip to a delivery fails here; one that removes some updates the table."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import Event, EventBus, Outbox
from outboxkit_mysql.dialect import StoreConnection

from .server import migrated_store

N = 10

# Round trips per event, the handler's own statement included.
BUDGET = {
    # XA START with the token check and row lock (after a handler had the connection, the
    # session set back first, in the same flight); the handler's INSERT; the record with XA END
    # and XA COMMIT.
    ("per_event", "writes"): 3,
    # A handler that never takes the connection: its record, fenced by the token, alone.
    ("per_event", "noop"): 1,
    # The savepoint with the token check and row lock; the handler's INSERT (the records are
    # written with the batch's commit, all at once).
    ("per_batch", "writes"): 2,
    ("per_batch", "noop"): 0,
}


def round_trips(transaction: str, handler: str, events: int) -> int:
    counted = [0]
    original = StoreConnection.query

    def counting(self: StoreConnection, sql: Any, unbuffered: bool = False) -> int:
        counted[0] += 1
        return original(self, sql, unbuffered)

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
            report = poller.run_once()
        assert len(report.published) == events
    return counted[0]


@pytest.mark.parametrize("handler", ["writes", "noop"])
@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
def test_the_delivery_budget(mysql_server: str, transaction: str, handler: str) -> None:
    per_event = (
        round_trips(transaction, handler, 2 * N) - round_trips(transaction, handler, N)
    ) / N
    assert per_event == BUDGET[(transaction, handler)], per_event
