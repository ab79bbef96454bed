"""Behind PgBouncer in transaction mode (bug 14).

psycopg prepares a statement on the server once it has run it ``prepare_threshold`` times on one
connection (5 by default), under a name of its own (``_pg3_0``...). Behind a pooler in
transaction mode each transaction may run on another server connection, where that name is
missing or prepared for another statement: "prepared statement ... does not exist" (26000),
"... already exists" (42P05), "bind message supplies 0 parameters, but prepared statement ...
requires 1" (08P01). The store says that this is the pooler and what to set, instead of "the
connection was lost"; with ``prepare_threshold=None`` and ``notify=False`` it works through it.

The PgBouncer is ``tests/pgbouncer.py``'s, one per test (its server connections keep the
statements a test prepared). Nothing is set in the environment: the store's own connections send
no startup ``options`` (PgBouncer refuses them) and put their sessions in UTC with a ``SET``,
which PgBouncer keeps per client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from outboxkit import EventBus, Outbox, StoreError, StoreUnavailable
from outboxkit_pg import PostgresStore
from outboxkit_pg.errors import POOLER_HINT, pooler_mixup
from tests.pgbouncer import PgBouncer, running_pgbouncer

pytestmark = pytest.mark.pg

EVENTS = 200
BATCH = 10


@pytest.fixture
def pgbouncer(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[PgBouncer]:
    for name in ("PGTZ", "PGOPTIONS"):  # the store must do without them
        monkeypatch.delenv(name, raising=False)
    with running_pgbouncer(pg_url, pool_size=2) as bouncer:
        yield bouncer


def _bus(seen: list[int]) -> EventBus:
    bus = EventBus()

    @bus.handler("order.placed", name="ship")
    def ship(event: Any, ctx: Any) -> None:
        seen.append(event.id)

    return bus


def _enqueue(store: PostgresStore, outbox: Outbox) -> list[int]:
    ids: list[int] = []
    for first in range(0, EVENTS, 20):  # several transactions, each on any server connection
        with store.transaction() as conn:
            batch = [("order.placed", {"n": n}) for n in range(first, first + 20)]
            ids += outbox.enqueue_many(conn, batch)
    assert len(ids) == EVENTS
    return ids


def test_pgbouncer_prepared_statements_error_names_the_pooler(
    pg_store: PostgresStore, pg_schema: str, pgbouncer: PgBouncer
) -> None:
    """With the default ``prepare_threshold`` the poller fails with the named error (the events
    are enqueued directly, so that it is the poller's round through PgBouncer that meets it)."""
    seen: list[int] = []
    _enqueue(pg_store, Outbox(pg_store, _bus([]), load_entry_points=False))
    store = PostgresStore(pgbouncer.url(), schema=pg_schema)  # the default prepare_threshold=5
    try:
        outbox = Outbox(store, _bus(seen), load_entry_points=False)
        with pytest.raises(StoreError) as failed:
            outbox.poller(batch_size=BATCH).run_until_idle()
    finally:
        store.close()
    error = failed.value
    assert not isinstance(error, StoreUnavailable), repr(error)
    message = str(error)
    assert "prepared statement" in message, message
    assert "a connection pooler in transaction mode (such as PgBouncer)" in message
    assert "prepare_threshold=None" in message and "notify=False" in message
    assert "lost" not in message and "unavailable" not in message
    assert f"127.0.0.1:{pgbouncer.port}" in message
    assert pg_store.stats(now=None).published < EVENTS  # it did stop


def test_pgbouncer_without_prepared_statements_publishes_every_event(
    pg_schema: str, pg_store: PostgresStore, pgbouncer: PgBouncer
) -> None:
    """``prepare_threshold=None, notify=False``: enqueued and delivered through PgBouncer,
    200 of 200 published, each once."""
    seen: list[int] = []
    store = PostgresStore(pgbouncer.url(), schema=pg_schema, prepare_threshold=None, notify=False)
    try:
        outbox = Outbox(store, _bus(seen), load_entry_points=False)
        ids = _enqueue(store, outbox)
        reports = outbox.poller(batch_size=BATCH).run_until_idle()
        stats = outbox.stats()
    finally:
        store.close()
    assert sorted(seen) == sorted(ids)  # each event's handler ran once
    assert sum(len(r.published) for r in reports) == EVENTS
    assert (stats.published, stats.pending, stats.dead) == (EVENTS, 0, 0)


PREPARED_MIXUPS = {
    "26000": 'prepared statement "_pg3_0" does not exist',
    "42P05": 'prepared statement "_pg3_0" already exists',
    "08P01": 'bind message supplies 0 parameters, but prepared statement "_pg3_0" requires 1',
}


@pytest.mark.parametrize("sqlstate", sorted(PREPARED_MIXUPS))
def test_each_prepared_statement_mixup_names_the_pooler(sqlstate: str) -> None:
    """The three errors a transaction pooler makes of psycopg's prepared statements: each a
    plain StoreError with the hint, never "the connection was lost" (08P01 is of class 08)."""
    exc = pg_errors.lookup(sqlstate)(PREPARED_MIXUPS[sqlstate])
    assert pooler_mixup(exc)
    store = PostgresStore("postgresql://app@db.example:6432/shop")  # never connects
    try:
        error = store.dialect.error(exc, "claim events")
    finally:
        store.close()
    assert type(error) is StoreError, repr(error)
    assert str(error) == (
        f"PostgreSQL at db.example:6432/shop: claim events failed: {type(exc).__name__}: "
        f"{PREPARED_MIXUPS[sqlstate]}; {POOLER_HINT}"
    )


def test_another_protocol_violation_is_still_an_outage() -> None:
    exc = pg_errors.lookup("08P01")("unsupported startup parameter: options")
    assert not pooler_mixup(exc)
    store = PostgresStore("postgresql://app@db.example:6432/shop")  # never connects
    try:
        error = store.dialect.error(exc, "claim events")
    finally:
        store.close()
    assert isinstance(error, StoreUnavailable) and "PgBouncer" not in str(error)
    assert isinstance(exc, psycopg.OperationalError)
