"""The bad-input table on every store: memory, SQLite (a real file), PostgreSQL.

Each row raises the named error before any write and leaves the caller's transaction usable: still
open, not aborted, holding its own write, and a good event committed afterwards is the only one.
The payload table itself is ``tests/unit/test_payload.py``'s (validated there on the pure core);
here it runs through each store's ``enqueue``. Not marked ``faults``: no processes, CI runs it.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    InvalidEvent,
    Message,
    Outbox,
    SchemaError,
)
from tests.faults._sites import Site
from tests.unit.test_bus_options_plugins import BAD_OPTIONS
from tests.unit.test_payload import BAD, Bad

TABLE = [
    *BAD,
    Bad("topic-10000", r"topic is 10000 characters; the limit is 255", topic="t" * 10_000),
]


def _message(case: Bad, topic: Any = None) -> Message:
    return Message(
        case.topic if topic is None else topic,
        case.payload,
        headers=case.headers,
        key=case.key,
        delay=case.delay,
    )


@pytest.mark.parametrize("case", TABLE, ids=lambda c: c.id)
def test_bad_event_raises_before_any_write_and_leaves_the_caller_usable(
    site: Site, case: Bad
) -> None:
    clock = FrozenClock()
    outbox = Outbox(site.store, EventBus(), clock=clock, max_payload_bytes=case.max_payload_bytes)
    with site.caller() as conn:
        with pytest.raises(InvalidEvent, match=case.match) as info:
            outbox.enqueue(conn, case.topic, case.payload, **case.kwargs())
        assert isinstance(info.value, ValueError)
        if site.backend == "sqlite":
            assert conn.total_changes == 1  # only the caller's own insert ran
        site.assert_usable(conn, before=0)
        # A batch with the bad event in the middle writes none of the batch.
        with pytest.raises(InvalidEvent, match="event #1"):
            outbox.enqueue_many(conn, [Message("ok", 1), _message(case), Message("ok", 3)])
        if site.backend == "sqlite":
            assert conn.total_changes == 1
        site.assert_usable(conn, before=0)
        good = outbox.enqueue(conn, "order.placed", "ok")  # small enough for every row's limit
        site.commit(conn)
    assert site.committed_orders() == 1
    assert outbox.stats().total == 1
    event = site.store.get(good)
    assert event is not None
    assert (event.topic, event.payload) == ("order.placed", "ok")


# -- options ---------------------------------------------------------------------------------------

OPTIONS = [
    *BAD_OPTIONS,
    ("max_payload_bytes", 0),
    ("max_payload_bytes", True),
    ("max_payload_bytes", "1024"),
]


@pytest.mark.parametrize(("option", "value"), OPTIONS, ids=[f"{o}={v!r}" for o, v in OPTIONS])
def test_every_invalid_option_is_refused_at_construction(
    site: Site, option: str, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=option) as info:
        Outbox(site.store, EventBus(), **{option: value})
    assert isinstance(info.value, ValueError)
    if option != "max_payload_bytes":  # an Outbox-wide option only
        outbox = Outbox(site.store, EventBus())
        with pytest.raises(ConfigurationError, match=option):
            outbox.poller(**{option: value})
    with pytest.raises(ConfigurationError, match=r"unknown poller option\(s\) \['batchsize'\]"):
        Outbox(site.store, EventBus()).poller(batchsize=5)
    assert site.store.stats(now=None).total == 0


# -- schema: missing or older, a clear error on the first poll, no spinning ------------------------


class NoWait:
    """A waiter that fails the test if the poller ever waits: SchemaError must not be retried."""

    waits = 0

    def wait(self, timeout: float) -> None:
        self.waits += 1
        raise AssertionError(f"the poller waited ({timeout}s) instead of raising SchemaError")

    def wake(self) -> None:
        pass


def _assert_first_poll_fails(store: Any, match: str) -> None:
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="h")
    outbox = Outbox(store, bus, clock=FrozenClock())
    with pytest.raises(SchemaError, match=match):
        outbox.poller().run_once()
    waiter = NoWait()
    with pytest.raises(SchemaError, match=match):
        outbox.poller(waiter=waiter).run_forever()
    assert waiter.waits == 0


def test_missing_schema_sqlite(tmp_path: Path) -> None:
    from outboxkit_sqlite import SQLiteStore

    with SQLiteStore(tmp_path / "app.db", migrate=False) as store:
        _assert_first_poll_fails(store, "migrate")


@pytest.mark.parametrize("old", [1, 2])
def test_older_schema_sqlite(tmp_path: Path, old: int) -> None:
    """``migrate=False`` on a file of an older version: the first poll is refused, naming both
    versions; ``migrate()`` lifts it, and the events written meanwhile are delivered."""
    from outboxkit_sqlite import SQLiteStore, schema
    from outboxkit_sqlite.tables import TableNames

    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        schema.migrate(conn, TableNames(), applied_at=0, where=str(path), target=old)
        conn.execute("COMMIT")
    with SQLiteStore(path, migrate=False) as store:
        with store.transaction() as conn:  # enqueueing still works: the tables are there
            event_id = Outbox(store).enqueue(conn, "t", {})
            with pytest.raises(SchemaError, match=r"dedupe_key needs version .*migrate"):
                Outbox(store).enqueue(conn, "t", {}, dedupe_key="once")
        _assert_first_poll_fails(
            store,
            rf"version {old}, older than version {schema.SCHEMA_VERSION} .*run `outboxkit migrate`",
        )
        store.migrate()
        bus = EventBus()
        bus.subscribe("t", lambda event, ctx: None, name="h")
        outbox = Outbox(store, bus, clock=FrozenClock())
        assert outbox.poller().run_once().published == [event_id]


@pytest.mark.pg
def test_missing_schema_pg(pg_url: str, pg_schema: str) -> None:
    from outboxkit_pg import PostgresStore

    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        _assert_first_poll_fails(store, "run `outboxkit migrate`")
    finally:
        store.close()


@pytest.mark.pg
def test_older_schema_pg(pg_url: str, pg_schema: str, admin: Any) -> None:
    from psycopg import sql

    from outboxkit_pg import PostgresStore

    store = PostgresStore(pg_url, schema=pg_schema)
    store.migrate()
    store.close()
    admin.execute(
        sql.SQL("UPDATE {} SET version = version - 1").format(
            sql.Identifier(pg_schema, "outbox_schema")
        )
    )
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        _assert_first_poll_fails(store, r"older than version \d+ .*run `outboxkit migrate`")
    finally:
        store.close()


# -- a row written behind outboxkit's back ---------------------------------------------------------


def test_non_json_payload_row_is_dead_lettered_at_once(tmp_path: Path) -> None:
    from outboxkit_sqlite import SQLiteStore

    path = tmp_path / "app.db"
    calls: list[int] = []
    bus = EventBus()

    @bus.handler("t", name="h")
    def handler(event: Event, ctx: Any) -> None:
        calls.append(event.id)

    with SQLiteStore(path) as store:
        outbox = Outbox(store, bus, clock=FrozenClock(), max_retries=10)
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute(
                "INSERT INTO outbox_events (topic, payload, headers, created_at, available_at)"
                " VALUES ('t', 'not json', '{}', 0, 0)"
            )
            (bad_id,) = conn.execute("SELECT max(id) FROM outbox_events").fetchone()
        with store.transaction() as conn:
            good_id = outbox.enqueue(conn, "t", {"fine": True})
        report = outbox.poller().run_once()
        assert report.dead_lettered == [bad_id]
        assert report.published == [good_id]
        assert calls == [good_id]  # the handler never saw the undecodable row
        (dead,) = outbox.dead_letters()
        assert dead.event.id == bad_id
        assert dead.event.attempts == 1
        assert "not valid JSON" in (dead.last_error or "")
        assert not outbox.poller().run_once()  # never retried


def test_non_json_payload_row_cannot_exist_on_pg() -> None:
    pytest.skip(
        "PostgreSQL stores payloads as jsonb: the server refuses a non-JSON value on insert, "
        "so no such row can be written behind outboxkit's back"
    )
