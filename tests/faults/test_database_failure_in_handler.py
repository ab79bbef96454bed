"""A database failure under a running handler is the database's, never the handler's.

A transactional handler whose connection the server terminates (``pg_terminate_backend``: what a
restart or a failover does) and which then runs a statement sees the driver's error; once, that
was recorded as ``HandlerFailed`` and, with ``max_retries=0``, dead-lettered on attempt 1. Now the
store tells the database's failure apart by the connection itself (broken, whatever the handler
raised or caught): ``run_once`` raises ``StoreUnavailable`` (``run_forever`` waits it out), no
handler failure is emitted or recorded, the batch's unstarted events are handed back at once, and
the event in hand comes back when its lease runs out, as after a crash. On SQLite the same holds
for a file that fails under the handler (disk full). Not marked ``faults``: one process, a frozen
clock.
"""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from typing import Any

import pytest

from outboxkit import (
    Event,
    EventBus,
    FrozenClock,
    HandlerFailed,
    Outbox,
    StoreError,
    StoreUnavailable,
)
from outboxkit.testing import Recorder
from tests.faults._sites import Site, open_site

LEASE = timedelta(seconds=30)


@pytest.mark.pg
def test_a_terminated_connection_under_a_handler_is_a_store_failure(
    tmp_path: Any, admin: Any
) -> None:
    with open_site("pg", tmp_path) as site:
        _check_database_failure(site, lambda ctx: _terminate_own_backend(admin, ctx))


def test_a_full_disk_under_a_handler_is_a_store_failure(tmp_path: Any) -> None:
    with open_site("sqlite", tmp_path) as site:
        _check_database_failure(site, _fill_the_disk)


def _terminate_own_backend(admin: Any, ctx: Any) -> None:
    pid = ctx.connection.info.backend_pid
    admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    ctx.connection.execute("SELECT 1")  # raises: the server closed the connection


def _fill_the_disk(ctx: Any) -> None:
    conn: sqlite3.Connection = ctx.connection
    (pages,) = conn.execute("PRAGMA page_count").fetchone()
    conn.execute(f"PRAGMA max_page_count = {pages}")  # the file cannot grow: SQLITE_FULL
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (blob BLOB)")
        conn.execute("INSERT INTO filler VALUES (zeroblob(1000000))")
    finally:
        conn.execute("PRAGMA max_page_count = 1073741823")


def _check_database_failure(site: Site, fail: Any) -> None:
    bus = EventBus()
    runs: list[tuple[int, int]] = []

    @bus.handler("t", name="ledger")
    def ledger(event: Event, ctx: Any) -> None:
        runs.append((event.id, ctx.attempt))
        site.write_order(ctx.connection)
        if event.id == first and ctx.attempt == 1:
            fail(ctx)

    clock = FrozenClock()
    recorder = Recorder()
    outbox = Outbox(
        site.store,
        bus,
        clock=clock,
        lease=LEASE,
        max_retries=0,
        plugins=[recorder],
        load_entry_points=False,
    )
    with site.store.transaction() as conn:
        first, second = outbox.enqueue_many(conn, [("t", 1), ("t", 2)])
    poller = outbox.poller()
    with pytest.raises(StoreUnavailable) as info:
        poller.run_once()
    assert isinstance(info.value, StoreError)
    assert "while a handler ran" in str(info.value)
    assert recorder.of(HandlerFailed) == []  # never blamed on the handler
    assert site.store.records(first) == []
    assert site.committed_orders() == 0  # the handler's write went with the connection
    held = site.store.get(first)
    assert held is not None and held.failed_at is None and held.published_at is None
    # The unstarted event was handed back with its attempt refunded, and the store still works.
    unstarted = site.store.get(second)
    assert unstarted is not None and unstarted.attempts == 0
    assert poller.run_once().published == [second]
    # The event in hand is recovered by its lease, as after a crash: its attempt was used.
    clock.advance(LEASE)
    report = poller.run_once()
    assert report.dead_lettered == [first]  # max_retries=0 and attempt 1 was used up
    letter = outbox.dead_letter(first)
    assert letter is not None
    assert letter.last_error == "attempts used up: attempt 1 crashed or lost its lease"
    assert recorder.of(HandlerFailed) == []
    assert runs == [(first, 1), (second, 1)]
