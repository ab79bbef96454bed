"""The statements a SQLite delivery costs with a handler that writes one row through
``ctx.connection``, counted from SQLite's own trace (exact, unlike timings): a change that adds
a statement to the transactional path fails here.

Between two handlers' rows, per event: its record and the commit, then the next delivery's
``BEGIN IMMEDIATE`` and token check. Per batch: the savepoint's release, then the next
savepoint. The batch's transaction holds the database's one write lock, so its first delivery
that opens checks every token of the batch at once (``lock_claimed``) and the others check
nothing; the records are kept and written together with the batch's settlement.
"""

from __future__ import annotations

import sqlite3
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, Outbox
from outboxkit_sqlite import SQLiteStore

EVENTS = 6
ROW = "INSERT INTO ledger (event_id, handler) VALUES (?, 'h')"

BETWEEN_ROWS = {
    # the record, COMMIT; BEGIN IMMEDIATE, the token check (``owned``)
    "per_event": ["INSERT", "COMMIT", "BEGIN", "SELECT"],
    # RELEASE; SAVEPOINT
    "per_batch": ["RELEASE", "SAVEPOINT"],
}


def traced_drain(store: SQLiteStore, transaction: str) -> list[str]:
    """Every statement the store's connections ran from the first handler's row on, as the
    first word of each (``ROW`` for a handler's row)."""
    statements: list[str] = []
    traced: set[int] = set()
    bus = EventBus()

    def handle(event: Event, ctx: Any) -> None:
        conn: sqlite3.Connection = ctx.connection
        if id(conn) not in traced:
            traced.add(id(conn))
            conn.set_trace_callback(statements.append)
        conn.execute(ROW, (event.id,))

    bus.subscribe("t", handle, name="h", transactional=True)
    outbox = Outbox(store, bus, clock=FrozenClock(), load_entry_points=False)
    with store.transaction() as conn:
        outbox.enqueue_many(conn, [("t", {"n": n}) for n in range(EVENTS)])
    report = outbox.poller(batch_size=EVENTS, transaction=transaction).run_once()
    assert len(report.published) == EVENTS
    return ["ROW" if "ledger" in s else s.split(None, 1)[0].upper() for s in statements]


@pytest.mark.parametrize("transaction", sorted(BETWEEN_ROWS))
def test_the_statements_between_two_handlers_rows(tmp_path: Path, transaction: str) -> None:
    with SQLiteStore(tmp_path / "budget.db") as store:
        with store.transaction() as conn:
            conn.execute("CREATE TABLE ledger (event_id INTEGER NOT NULL, handler TEXT NOT NULL)")
        words = traced_drain(store, transaction)
    handler_rows = [i for i, word in enumerate(words) if word == "ROW"]
    assert len(handler_rows) == EVENTS
    for start, end in pairwise(handler_rows):
        assert words[start + 1 : end] == BETWEEN_ROWS[transaction]
