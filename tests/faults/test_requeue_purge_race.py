"""A requeue and a purge of the same dead letter never both act on it.

On PostgreSQL the purge's ``DELETE ... WHERE id IN (SELECT ...)`` picked its rows from the
subquery's snapshot and did not check them again on the version a concurrent requeue had just
committed: both calls reported success and the requeued event was gone. The interleaving is
forced here, not hoped for: one side's statement runs in an open transaction, the other is
started in a thread and seen waiting for the row lock (``pg_stat_activity``), then the first
commits. Any serial order lets exactly one of them act, and so must this one, both ways round,
for ids and for the age cutoff. Memory and SQLite serialize writers; they are checked with
plain threads. Not marked ``faults``: the waits are on conditions, bounded.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outboxkit import Event, EventBus, FrozenClock, Outbox
from tests.faults._sites import Site, open_site
from tests.integration.pg._workers import wait_until


def _dead_letters(site: Site, n: int) -> tuple[Outbox, list[int]]:
    bus = EventBus()

    @bus.handler("t", name="fails")
    def fails(event: Event, ctx: Any) -> None:
        raise RuntimeError("boom")

    outbox = Outbox(site.store, bus, clock=FrozenClock(), max_retries=0, load_entry_points=False)
    with site.store.transaction() as conn:
        ids = outbox.enqueue_many(conn, [("t", i) for i in range(n)])
    assert sorted(outbox.poller(batch_size=n).run_once().dead_lettered) == ids
    outbox.clock.advance(timedelta(days=1))  # type: ignore[attr-defined]
    return outbox, ids


def _waiting_for_a_lock(admin: psycopg.Connection[Any], query_start: str) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        (query_start + "%",),
    ).fetchone()
    return bool(row and row[0])


def _race_one(
    site: Site, outbox: Outbox, admin: psycopg.Connection[Any], event_id: int, first: str, by: str
) -> dict[str, int]:
    """``first`` runs in an open transaction; the other one is started and seen waiting for
    the row lock before ``first`` commits. Returns how many rows each one acted on."""
    store: Any = site.store
    results: dict[str, int] = {}
    with psycopg.connect(site.url) as holder:
        if first == "requeue":
            rows = holder.execute(
                store.dialect.queries["requeue"], {"ids": [event_id], "now": None}
            )
            results["requeue"] = len(rows.fetchall())
            second, waits_on = "purge", "WITH gone AS"
        else:
            cursor = holder.execute(
                store.dialect.queries["purge_dead"],
                {
                    "ids": [event_id] if by == "ids" else None,
                    "before": None if by == "ids" else outbox.clock.now(),
                    "limit": 1,
                },
            )
            results["purge"] = cursor.rowcount
            second, waits_on = "requeue", "UPDATE"

        def run_second() -> None:
            if second == "purge":
                results["purge"] = (
                    outbox.purge(dead_ids=[event_id])
                    if by == "ids"
                    else outbox.purge(dead_older_than=0)
                )
            else:
                results["requeue"] = (
                    outbox.requeue([event_id]) if by == "ids" else outbox.requeue_dead()
                )

        thread = threading.Thread(target=run_second)
        thread.start()
        assert wait_until(lambda: _waiting_for_a_lock(admin, waits_on), 10, step=0.01), (
            f"the {second} does not wait for the row lock"
        )
        holder.commit()
        thread.join(10)
        assert not thread.is_alive()
    return results


@pytest.mark.pg
@pytest.mark.parametrize("by", ["ids", "age"])
@pytest.mark.parametrize("first", ["requeue", "purge"])
def test_requeue_and_purge_racing_on_one_dead_letter_act_once(
    tmp_path: Any, admin: psycopg.Connection[Any], first: str, by: str
) -> None:
    with open_site("pg", tmp_path) as site:
        # By age, a requeue_dead()/purge(dead_older_than=0) takes every dead letter: one here.
        outbox, ids = _dead_letters(site, 5 if by == "ids" else 1)
        for event_id in ids:
            results = _race_one(site, outbox, admin, event_id, first, by)
            acted = sorted(name for name, count in results.items() if count)
            assert acted == [first], results  # the one that committed first, alone
            event = site.store.get(event_id)
            if first == "requeue":
                assert event is not None and event.failed_at is None  # requeued, not lost
            else:
                assert event is None  # purged, not resurrected


def _threads_race(outbox: Outbox, event_id: int) -> dict[str, int]:
    results: dict[str, int] = {}
    start = threading.Barrier(2)

    def requeue() -> None:
        start.wait()
        results["requeue"] = outbox.requeue([event_id])

    def purge() -> None:
        start.wait()
        results["purge"] = outbox.purge(dead_ids=[event_id])

    threads = [threading.Thread(target=requeue), threading.Thread(target=purge)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_requeue_and_purge_in_threads_act_once(tmp_path: Any, backend: str) -> None:
    with open_site(backend, tmp_path) as site:
        outbox, ids = _dead_letters(site, 20)
        for event_id in ids:
            results = _threads_race(outbox, event_id)
            assert sum(1 for count in results.values() if count) == 1, results
            event = site.store.get(event_id)
            assert (event is None) == bool(results["purge"])
