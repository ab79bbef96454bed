"""The gap: an enqueue transaction held open while later events commit and are delivered.

Event A is enqueued first, so it has the smallest id and the earliest ``available_at`` (the
enqueue transaction's start), but its transaction stays open while 100 later events commit in
transactions of their own and a poller delivers all of them. Then A's transaction commits. A
poller that kept a high-water mark (the largest id it has seen) would never look below it again
and lose A; outboxkit's claim keeps none: it takes whatever is due in ``(available_at, id)`` order
``FOR UPDATE SKIP LOCKED``, so A is claimed and delivered as soon as it is visible. Then a
fault-free drain and the figures: nothing lost, no duplicates, nothing stuck or dead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Outbox
from outboxkit_pg import PostgresStore
from tests.faults._harness import TOPICS, drain, enqueue, figures
from tests.integration.pg._workers import Fleet, create_app_tables, wait_until

pytestmark = [pytest.mark.pg, pytest.mark.faults]

LATER = 100
EVENTS = LATER + 1
BATCH = 10


def test_an_event_committed_late_below_delivered_ids_is_still_delivered(
    pg_url: str,
    pg_schema: str,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        store.migrate()
        create_app_tables(admin, pg_schema)
        outbox = Outbox(store)
        options = {"batch_size": BATCH, "lease": 5.0, "interval": 0.2}
        with (
            Fleet(pg_url, pg_schema, tmp_path, options, topics=TOPICS) as fleet,
            psycopg.connect(pg_url) as held,  # A's transaction, left open (psycopg's default)
        ):
            fleet.spawn()
            assert fleet.wait_ready(60), "poller process did not start"
            event_a = outbox.enqueue(held, TOPICS[0], {"n": LATER, "late": True})
            later: list[int] = []
            for n in range(LATER):  # 100 transactions, each committed at once
                later += enqueue(pg_url, outbox, 1, start=n)
            assert min(later) > event_a
            assert wait_until(lambda: store.stats(now=None).published == LATER, 60), (
                f"the later events were not delivered: {store.stats(now=None)}"
            )
            a_before_commit = store.get(event_a)  # invisible: not committed yet
            held.commit()
            assert wait_until(lambda: store.stats(now=None).published == EVENTS, 30), (
                f"A was not delivered after its commit: {store.stats(now=None)}"
            )
            exit_codes = fleet.shutdown()
        assert drain(pg_url, pg_schema, timeout=30)
        result = figures(admin, pg_schema, EVENTS, fleet.traces())
        a_row = admin.execute(
            sql.SQL(
                "SELECT attempts, published_at IS NOT NULL,"
                " round(1000 * extract(epoch FROM published_at - created_at)) FROM {}"
                " WHERE id = %s"
            ).format(sql.Identifier(pg_schema, "outbox_events")),
            (event_a,),
        ).fetchone()
        a_ledger = admin.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE event_id = %s").format(
                sql.Identifier(pg_schema, "ledger")
            ),
            (event_a,),
        ).fetchone()
    finally:
        store.close()
    assert a_row is not None
    with capsys.disabled():
        print(
            f"\n[faults:gap-pg] {EVENTS} events, 1 poller, A (id {event_a}) held open while "
            f"{LATER} later ones were delivered, then published {a_row[2]}ms after its "
            f"creation: {result.line()}"
        )
    assert a_before_commit is None
    assert a_row[:2] == (1, True)  # delivered once, on its first attempt
    assert a_ledger == (1,)
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext == 0  # no crash, no lost lease: no duplicate at all
    assert exit_codes == [0]
