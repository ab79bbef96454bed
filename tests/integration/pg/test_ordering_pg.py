"""R15 and R16 under concurrent transactions on a real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg

from outboxkit import Outbox
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one
from outboxkit_pg import PostgresStore

LEASE = timedelta(seconds=30)


def test_overlapping_transactions_deliver_in_commit_order(
    pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    """T1 enqueues K#1; T2 enqueues K#2 and would commit first, but waits on K's row until T1
    commits; an unrelated key J commits and is claimable meanwhile."""
    outbox = Outbox(pg_store, load_entry_points=False)
    done: list[int] = []
    with pg_store.transaction() as t1:
        k1 = outbox.enqueue(t1, "t", 1, key="K")

        def second() -> None:
            with pg_store.transaction() as t2:
                done.append(outbox.enqueue(t2, "t", 2, key="K"))

        thread = threading.Thread(target=second)
        thread.start()
        # Wait (bounded, by asking the server, not by sleeping) until T2 waits on a lock.
        for _ in range(10_000):
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND strpos(query, %s) > 0",
                (pg_store.names.schema,),
            ).fetchone()
            if row and row[0] >= 1:
                break
        else:  # pragma: no cover
            raise AssertionError("the second enqueuer of K never waited")
        assert done == []
        with pg_store.transaction() as t3:
            j1 = outbox.enqueue(t3, "t", 3, key="J")
        (claim,) = pg_store.claim(batch_size=10, lease=LEASE, now=None)
        assert claim.event.id == j1  # J does not wait for K's open transaction
        assert settle_one(pg_store, claim, Publish(), error=None, now=None)
    thread.join(timeout=60)
    (k2,) = done
    assert k2 > k1
    order = []
    while claims := pg_store.claim(batch_size=10, lease=LEASE, now=None):
        for c in claims:
            order.append(c.event.id)
            assert settle_one(pg_store, c, Publish(), error=None, now=None)
    assert order == [k1, k2]


def test_eight_threads_one_dedupe_key(pg_store: PostgresStore) -> None:
    outbox = Outbox(pg_store, load_entry_points=False)
    barrier = threading.Barrier(8)
    ids: list[int] = []
    errors: list[BaseException] = []

    def enqueue() -> None:
        try:
            barrier.wait(timeout=30)
            with pg_store.transaction() as conn:
                ids.append(outbox.enqueue(conn, "t", {}, dedupe_key="order-42-placed"))
                conn.execute("SELECT 1")  # the transaction stays usable
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=enqueue) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(ids) == 8 and len(set(ids)) == 1
    assert pg_store.stats(now=None).total == 1
