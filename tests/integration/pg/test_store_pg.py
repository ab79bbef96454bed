"""The Postgres store's own behaviour, beyond the conformance suite: URLs and options, the
app's connection, handlers that break their transaction, database failures during a delivery,
schema versions, LISTEN/NOTIFY, pools of the app's own, and dropped connections."""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    HandlerCrashed,
    Message,
    Outbox,
    Outcome,
    SchemaError,
    StoreError,
    StoreUnavailable,
    open_store,
)
from outboxkit.core.payload import build_event
from outboxkit_pg import PostgresStore
from outboxkit_pg.store import SCHEMA_VERSION

from ._workers import wait_until
from .conftest import fresh_schema

pytestmark = pytest.mark.pg

LEASE = timedelta(seconds=30)


def table(store: PostgresStore, name: str) -> sql.Identifier:
    return sql.Identifier(store.names.schema, name)


@pytest.fixture
def app_table(pg_store: PostgresStore, admin: psycopg.Connection[Any]) -> sql.Identifier:
    """An app table in the store's schema, for the app's and the handlers' own writes."""
    name = table(pg_store, "orders")
    admin.execute(sql.SQL("CREATE TABLE {} (id bigint NOT NULL)").format(name))
    return name


def rows(admin: psycopg.Connection[Any], name: sql.Identifier) -> list[Any]:
    return [r[0] for r in admin.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(name))]


# -- URLs, options, registration --------------------------------------------------------------


def test_open_store_picks_the_postgres_store_for_both_schemes(pg_url: str, pg_schema: str) -> None:
    for url in (pg_url, pg_url.replace("postgresql://", "postgres://", 1)):
        store = open_store(url, schema=pg_schema, notify=False)
        try:
            assert isinstance(store, PostgresStore)
            assert store.url == url
            assert store.options["schema"] == pg_schema
            assert "listen_notify" not in store.capabilities
            assert {"transactional_handlers", "concurrent_claimers", "multiprocess"} <= set(
                store.capabilities
            )
            assert "database_clock" in store.capabilities
        finally:
            store.close()


def test_options_are_validated_at_construction() -> None:
    url = "postgresql://nobody@127.0.0.1:1/x"
    with pytest.raises(ConfigurationError, match="unknown PostgreSQL store option"):
        open_store(url, tables="x")
    for bad in (
        {"pool_min_size": 0},
        {"pool_max_size": 1, "pool_min_size": 2},
        {"pool_timeout": 0},
        {"pool_timeout": float("nan")},
        {"notify": "yes"},
        {"prepare_threshold": -1},
        {"events_table": "same", "deliveries_table": "same"},
    ):
        with pytest.raises(ConfigurationError):
            PostgresStore(url, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="postgresql://"):
        PostgresStore.from_url("mysql://x@y/z")
    with pytest.raises(ConfigurationError):
        PostgresStore(42)  # type: ignore[arg-type]


def test_a_libpq_conninfo_string_works_but_is_no_url(pg_url: str, pg_schema: str) -> None:
    conninfo = psycopg.conninfo.make_conninfo("", **psycopg.conninfo.conninfo_to_dict(pg_url))
    assert "://" not in conninfo
    store = PostgresStore(conninfo, schema=pg_schema)
    try:
        store.migrate()
        assert store.url is None
        assert "multiprocess" not in store.capabilities  # open_store needs a URL
        assert store.stats(now=None).total == 0
    finally:
        store.close()


def test_import_and_registration_need_no_driver() -> None:
    # psycopg blocked: the package imports, the scheme is registered, opening names the extra.
    code = """
import sys
sys.modules["psycopg"] = None
sys.modules["psycopg_pool"] = None
import outboxkit_pg
from outboxkit import MissingDependency, open_store
try:
    open_store("postgresql://x@y/z")
except MissingDependency as exc:
    print("MISSING", exc)
try:
    outboxkit_pg.PostgresStore
except MissingDependency as exc:
    print("MISSING", exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.count("MISSING") == 2
    assert "install outboxkit[pg]" in out


# -- the app's connection (R1) ------------------------------------------------------------------


def test_enqueue_commits_and_rolls_back_with_the_app(
    pg_url: str, pg_store: PostgresStore, app_table: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    outbox = Outbox(pg_store)
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(app_table)
    with psycopg.connect(pg_url) as conn:  # psycopg's default: no autocommit
        conn.execute(insert, (1,))
        outbox.enqueue(conn, "order.placed", {"id": 1})
        conn.rollback()
        assert pg_store.stats(now=None).total == 0
        conn.execute(insert, (2,))
        outbox.enqueue(conn, "order.placed", {"id": 2})
        assert pg_store.stats(now=None).total == 0  # not visible before the app commits
        conn.commit()
    with psycopg.connect(pg_url, autocommit=True) as conn, conn.transaction():
        conn.execute(insert, (3,))
        outbox.enqueue(conn, "order.placed", {"id": 3})
    assert rows(admin, app_table) == [2, 3]
    assert [e.payload["id"] for e in pg_store.events()] == [2, 3]


def test_enqueue_refuses_an_autocommit_connection_outside_a_transaction(
    pg_url: str, pg_store: PostgresStore
) -> None:
    outbox = Outbox(pg_store)
    with (
        psycopg.connect(pg_url, autocommit=True) as conn,
        pytest.raises(ConfigurationError, match="autocommit"),
    ):
        outbox.enqueue(conn, "t", {})
    with pytest.raises(ConfigurationError, match=r"psycopg\.Connection"):
        outbox.enqueue(object(), "t", {})
    assert pg_store.stats(now=None).total == 0


def test_enqueue_many_is_one_statement(pg_url: str, pg_store: PostgresStore) -> None:
    executed: list[object] = []

    class Counting(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
            executed.append(query)
            return super().execute(query, params, **kw)

    outbox = Outbox(pg_store)
    with psycopg.connect(pg_url, cursor_factory=Counting) as conn:
        outbox.enqueue(conn, "warm-up", {})  # the first use also checks the schema version
        executed.clear()
        ids = outbox.enqueue_many(conn, [Message("t", {"n": n}, key=f"k{n}") for n in range(500)])
        conn.commit()
    assert len(executed) == 1
    assert ids == sorted(ids) and len(ids) == 500
    assert pg_store.get(ids[7]).key == "k7"  # type: ignore[union-attr]


# -- handlers and their transaction (R6) ---------------------------------------------------------


def test_transactional_handler_writes_commit_with_the_record_and_roll_back_on_reject(
    pg_store: PostgresStore, app_table: sql.Identifier, admin: psycopg.Connection[Any]
) -> None:
    bus = EventBus()
    insert = sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(app_table)

    @bus.handler("order", name="writer")
    def writer(event: Event, ctx: Any) -> None:
        ctx.connection.execute(insert, (event.payload["id"],))
        if event.payload["id"] == 2:
            from outboxkit import Reject

            raise Reject("no")

    outbox = Outbox(pg_store, bus)
    with pg_store.transaction() as conn:
        outbox.enqueue_many(conn, [("order", {"id": 1}), ("order", {"id": 2})])
    report = outbox.poller().run_once()
    assert sorted(report.published) == [1, 2]
    assert rows(admin, app_table) == [1]
    assert [r.outcome for r in pg_store.records(2)] == [Outcome.REJECTED]


@pytest.mark.parametrize(
    "breakage",
    ["sql-commit", "sql-rollback", "close", "swallowed-error"],
)
def test_a_handler_that_breaks_its_transaction_crashes(
    pg_store: PostgresStore, app_table: sql.Identifier, breakage: str
) -> None:
    bus = EventBus()

    @bus.handler("t", name="breaker")
    def breaker(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        if breakage == "sql-commit":
            conn.execute("COMMIT")
        elif breakage == "sql-rollback":
            conn.execute("ROLLBACK")
        elif breakage == "close":
            conn.close()
        else:
            with contextlib.suppress(psycopg.Error):
                conn.execute("SELECT no_such_column FROM no_such_table")

    outbox = Outbox(pg_store, bus)
    with pg_store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    report = outbox.poller().run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert isinstance(delivery.exception, HandlerCrashed)
    assert report.retried == [event_id]
    assert pg_store.records(event_id) == []


def test_a_handler_may_not_commit_through_psycopg(pg_store: PostgresStore) -> None:
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: ctx.connection.commit(), name="committer")
    outbox = Outbox(pg_store, bus)
    with pg_store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    (delivery,) = outbox.poller().run_once().deliveries
    assert delivery.outcome is Outcome.FAILED
    assert "commit" in (delivery.error or "")
    assert pg_store.records(event_id) == []


def test_the_handlers_own_failing_sql_is_the_handlers_failure(pg_store: PostgresStore) -> None:
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: ctx.connection.execute("SELECT 1/0"), name="divider")
    outbox = Outbox(pg_store, bus)
    with pg_store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    report = outbox.poller().run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert "DivisionByZero" in (delivery.error or "")
    assert report.retried == [event_id]


def test_a_connection_lost_during_delivery_is_the_databases_failure(
    pg_url: str, pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    bus = EventBus()

    @bus.handler("t", name="victim")
    def victim(event: Event, ctx: Any) -> None:
        # The server drops the delivery connection while the handler runs; the handler itself
        # does nothing wrong.
        admin.execute("SELECT pg_terminate_backend(%s)", (ctx.connection.info.backend_pid,))

    outbox = Outbox(pg_store, bus)
    with pg_store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    with pytest.raises(StoreUnavailable, match="unavailable"):
        outbox.poller().run_once()
    assert pg_store.records(event_id) == []  # no record: neither success nor rejection
    event = pg_store.get(event_id)
    assert event is not None and event.locked_until is not None  # its lease will bring it back
    # The pool replaced the dead connection: the store works on.
    assert pg_store.stats(now=None).claimed == 1


def test_connections_dropped_in_the_pool_are_replaced_without_an_error(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    url = pg_url + "&application_name=okt_dropped" if "?" in pg_url else pg_url
    store = PostgresStore(url, schema=pg_schema, pool_min_size=3, pool_max_size=3)
    try:
        store.migrate()
        assert store.stats(now=None).total == 0
        name = "okt_dropped" if "?" in pg_url else "outboxkit"
        pids = [
            pid
            for (pid,) in admin.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE application_name = %s AND datname = current_database()",
                (name,),
            )
        ]
        assert pids
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
        # pg_terminate_backend only signals the backends: wait until each idle connection in
        # the pool has heard from its server (psycopg_pool internals, for this test only).
        idle = list(store.dialect.pool._pool._pool)  # type: ignore[union-attr]
        assert wait_until(lambda: len(select.select(idle, [], [], 0)[0]) == len(idle), 30)
        for _ in range(5):  # every pooled connection is dead: each is found and replaced
            assert store.stats(now=None).total == 0
    finally:
        store.close()


# -- schema versions ------------------------------------------------------------------------------


def test_an_unmigrated_schema_is_a_schema_error(pg_url: str, pg_schema: str) -> None:
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        with pytest.raises(SchemaError, match="migrate"):
            store.claim(batch_size=1, lease=LEASE, now=None)
        with pytest.raises(SchemaError, match="migrate"):
            Outbox(store).poller().run_forever()  # raised at once, not waited out
    finally:
        store.close()


def test_a_newer_schema_is_refused_naming_both_versions(
    pg_store: PostgresStore, admin: psycopg.Connection[Any], pg_url: str
) -> None:
    admin.execute(
        sql.SQL("INSERT INTO {} (version, description) VALUES (99, 'from the future')").format(
            table(pg_store, "outbox_schema")
        )
    )
    store = PostgresStore(pg_url, schema=pg_store.names.schema)
    try:
        with pytest.raises(SchemaError, match=f"version 99, newer than version {SCHEMA_VERSION}"):
            store.migrate()
        with pytest.raises(SchemaError, match="99"):
            store.stats(now=None)
    finally:
        store.close()


def test_concurrent_migrations_are_safe(pg_url: str, pg_schema: str) -> None:
    stores = [PostgresStore(pg_url, schema=pg_schema) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def migrate(store: PostgresStore) -> None:
        try:
            barrier.wait(timeout=30)
            store.migrate()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(s,)) for s in stores]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        for store in stores:
            store.migrate()  # idempotent
        with psycopg.connect(pg_url) as conn:
            versions = conn.execute(
                sql.SQL("SELECT version FROM {} ORDER BY version").format(
                    sql.Identifier(pg_schema, "outbox_schema")
                )
            ).fetchall()
        assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]  # each applied once
    finally:
        for store in stores:
            store.close()


def test_version_4_upgrade_keeps_a_requeued_events_records_and_purges_them_with_it(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 4 drops the records' foreign key and adds ``has_history``: an event requeued
    under version 3 (attempts back to 0, a handler's record kept) still skips that handler, and
    a purge deletes an event's records with it."""
    import outboxkit_pg.store as pg_store_module

    with monkeypatch.context() as patch:  # the schema as version 3 left it
        patch.setattr(pg_store_module, "SCHEMA_VERSION", 3)
        patch.setattr(pg_store_module, "MIGRATIONS", pg_store_module.MIGRATIONS[:3])
        old = PostgresStore(pg_url, schema=pg_schema, notify=False)
        try:
            assert old.migrate().after == 3
            with old.transaction() as conn:
                (event_id,) = old.enqueue(conn, [build_event("t", {"n": 1})], now=None)
        finally:
            old.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:  # a requeued dead letter, a recorded
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_id, handler, outcome, attempt, recorded_at)"
                " VALUES (%s, 'a', 'succeeded', 1, now())"
            ).format(sql.Identifier(pg_schema, "outbox_deliveries")),
            (event_id,),
        )
    store = PostgresStore(pg_url, schema=pg_schema, notify=False)
    try:
        migration = store.migrate()
        assert (migration.before, migration.after) == (3, SCHEMA_VERSION)
        with psycopg.connect(pg_url) as conn:
            keys = conn.execute(
                "SELECT count(*) FROM pg_constraint WHERE conrelid = %s::regclass"
                " AND contype = 'f'",
                (f'"{pg_schema}"."outbox_deliveries"',),
            ).fetchone()
        assert keys == (0,)
        (claim,) = store.claim(batch_size=5, lease=LEASE, now=None)
        assert claim.event.id == event_id and claim.attempt == 1
        assert list(claim.done) == ["a"]  # read although this is attempt 1
        assert store.release([claim], now=None) == 1
        runs: list[str] = []
        bus = EventBus()
        bus.subscribe("t", lambda e, ctx: runs.append("a"), name="a")
        bus.subscribe("t", lambda e, ctx: runs.append("b"), name="b")
        outbox = Outbox(store, bus, load_entry_points=False)
        outbox.poller().run_once()
        assert runs == ["b"]  # a is not run again
        assert [r.handler for r in store.records(event_id)] == ["a", "b"]
        assert outbox.purge(published_older_than=timedelta(0)) == 1
        with psycopg.connect(pg_url) as conn:
            left = conn.execute(
                sql.SQL("SELECT count(*) FROM {}").format(table(store, "outbox_deliveries"))
            ).fetchone()
        assert left == (0,)
    finally:
        store.close()


def test_custom_names(pg_url: str) -> None:
    with fresh_schema(pg_url) as schema:
        store = PostgresStore(
            pg_url,
            schema=schema,
            table_prefix="app_",
            events_table="evts",
            channel="wake_up",
        )
        try:
            store.migrate()
            assert store.options["deliveries_table"] == "app_deliveries"
            with store.transaction() as conn:
                store.enqueue(conn, [build_event("t", 1)], now=None)
            assert store.claim(batch_size=5, lease=LEASE, now=None)[0].event.payload == 1
            with psycopg.connect(pg_url) as conn:
                tables = conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,)
                ).fetchall()
            assert tables == [("app_deliveries",), ("app_schema",), ("evts",), ("evts_keys",)]
        finally:
            store.close()


# -- LISTEN/NOTIFY ----------------------------------------------------------------------------------


@pytest.fixture
def listener(pg_url: str, pg_store: PostgresStore) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(pg_store.names.channel)))
        yield conn


@pytest.fixture
def pg_store(pg_url: str, pg_schema: str) -> Iterator[PostgresStore]:
    """The suite's store, on a channel of its own: every store on the server defaults to the
    events table's name as its channel, and these tests count notifications."""
    store = PostgresStore(pg_url, schema=pg_schema, channel=pg_schema)
    try:
        store.migrate()
        yield store
    finally:
        store.close()


def test_the_notification_fires_at_commit_and_carries_no_event_data(
    pg_url: str, pg_store: PostgresStore, listener: psycopg.Connection[Any]
) -> None:
    outbox = Outbox(pg_store)
    with psycopg.connect(pg_url) as conn:
        outbox.enqueue_many(conn, [("t", {"secret": "payload"}), ("t", 2)])
        assert list(listener.notifies(timeout=0)) == []  # not before the commit
        conn.commit()
    (note,) = list(listener.notifies(timeout=10, stop_after=1))
    assert note.channel == pg_store.names.channel
    assert note.payload == ""


def test_no_notification_when_notify_is_off(
    pg_url: str, pg_store: PostgresStore, listener: psycopg.Connection[Any]
) -> None:
    # The listened channel (the fixture's own): other tests on the server share the default.
    quiet = PostgresStore(
        pg_url,
        schema=pg_store.names.schema,
        channel=pg_store.names.channel,
        notify=False,
        prepare_threshold=None,
    )
    try:
        assert quiet.make_waiter() is None
        with quiet.transaction() as conn:
            Outbox(quiet).enqueue(conn, "t", {})
            # A marker after it, on the same channel: the first notification must be the marker.
            conn.execute("SELECT pg_notify(%s, 'marker')", (pg_store.names.channel,))
    finally:
        quiet.close()
    (note,) = list(listener.notifies(timeout=10, stop_after=1))
    assert note.payload == "marker"


def test_a_waiting_poller_wakes_on_a_commit_elsewhere(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    channel = f"okt_wake_{uuid.uuid4().hex[:12]}"  # ours alone, to see when it is listened to
    store = PostgresStore(pg_url, schema=pg_schema, channel=channel)
    store.migrate()
    handled = threading.Event()
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: handled.set(), name="h")
    poller = Outbox(store, bus).poller(interval=3600)  # only a notification can wake it
    runner = threading.Thread(target=poller.run_forever)
    runner.start()
    try:
        # The poller listens once its first poll found nothing: from then on only a
        # notification can make it poll again within the hour.
        listening = "SELECT count(*) FROM pg_stat_activity WHERE query = %s"
        query = f'LISTEN "{channel}"'
        assert wait_until(lambda: admin.execute(listening, (query,)).fetchone() == (1,), 30)
        code = (
            "import sys, psycopg\n"
            "from outboxkit import Outbox, open_store\n"
            "store = open_store(sys.argv[1], schema=sys.argv[2], channel=sys.argv[3])\n"
            "with psycopg.connect(sys.argv[1]) as conn:\n"
            "    Outbox(store).enqueue(conn, 't', {})\n"
            "store.close()\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, pg_url, pg_schema, channel], check=True, timeout=60
        )
        assert handled.wait(30), "the poller was not woken by the notification"
    finally:
        poller.stop()
        runner.join(30)
        store.close()
    assert not runner.is_alive()


def test_stop_wakes_a_waiting_poller(pg_store: PostgresStore) -> None:
    poller = Outbox(pg_store).poller(interval=3600)
    runner = threading.Thread(target=poller.run_forever)
    runner.start()
    poller.stop()
    runner.join(30)
    assert not runner.is_alive()


# -- a pool of the app's own ---------------------------------------------------------------------


def test_a_pool_without_autocommit_is_committed_and_left_open(
    pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    with ConnectionPool(pg_url, min_size=1, max_size=2, open=True) as pool:
        store = PostgresStore(pool, schema=pg_schema)
        store.migrate()
        bus = EventBus()
        bus.subscribe("t", lambda event, ctx: None, name="h")
        outbox = Outbox(store, bus)
        with store.transaction() as conn:
            outbox.enqueue(conn, "t", {})
        assert outbox.poller().run_once().published == [1]
        store.close()
        assert not pool.closed
        with pool.connection() as conn:
            published = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NOT NULL").format(
                    sql.Identifier(pg_schema, "outbox_events")
                )
            ).fetchone()
        assert published == (1,)
    assert "rolling back returned connection" not in caplog.text


def test_a_closed_store_refuses_work(pg_store: PostgresStore) -> None:
    pg_store.close()
    with pytest.raises(StoreError, match="closed"):
        pg_store.stats(now=None)


@pytest.mark.parametrize(("threshold", "expected"), [(5, 1), (None, 0)])
def test_the_claim_is_prepared_at_its_first_run(
    pg_url: str, threshold: int | None, expected: int
) -> None:
    """A poller's every-round statements are prepared on a connection's first run of them, not
    after psycopg's ``prepare_threshold`` runs; never without prepared statements (PgBouncer)."""
    with fresh_schema(pg_url) as schema:
        store = PostgresStore(
            pg_url, schema=schema, notify=False, pool_max_size=1, prepare_threshold=threshold
        )
        try:
            store.migrate()
            store.claim(batch_size=1, lease=LEASE, now=None)
            with store.dialect.connection("count prepared statements") as conn:
                row = conn.execute(
                    "SELECT count(*) FROM pg_prepared_statements"
                    " WHERE statement LIKE %s AND NOT from_sql",
                    ("%SKIP LOCKED%",),
                ).fetchone()
            assert row == (expected,)
        finally:
            store.close()


# -- the session's time zone ------------------------------------------------------------------------


def _session_zone(store: PostgresStore) -> str:
    with store.transaction() as conn:
        row = conn.execute("SHOW TimeZone").fetchone()
    assert row is not None
    return str(row[0])


def test_the_stores_own_connections_are_in_utc_and_load_instants_in_utc(
    pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    """The server's default zone stays the server's; the store's own sessions are in UTC, so a
    claim's instants load in ``datetime.UTC`` (psycopg's cheapest conversion)."""
    admin_zone = admin.execute("SHOW TimeZone").fetchone()
    assert admin_zone is not None
    assert _session_zone(pg_store) == "UTC"
    bus = EventBus()
    bus.subscribe("t", lambda event, ctx: None, name="h")
    outbox = Outbox(pg_store, bus, load_entry_points=False)
    with pg_store.transaction() as conn:
        outbox.enqueue(conn, "t", {})
    (claim,) = pg_store.claim(batch_size=1, lease=LEASE, now=None)
    assert claim.event.created_at is not None and claim.event.created_at.tzinfo is UTC
    assert claim.locked_until.tzinfo is UTC


@pytest.mark.parametrize(
    ("options", "environ", "expected"),
    [
        ("-c TimeZone=Europe/Berlin", {}, "Europe/Berlin"),  # given: kept
        ("-c statement_timeout=5000", {}, "UTC"),  # other options: kept, and UTC
        (None, {"PGTZ": "Asia/Tokyo"}, "Asia/Tokyo"),  # libpq's environment says otherwise
        (None, {"PGOPTIONS": "--TimeZone=America/Lima"}, "America/Lima"),
        (None, {"PGOPTIONS": "-c statement_timeout=5000"}, "UTC"),
    ],
)
def test_a_time_zone_the_connection_settings_give_is_kept(
    pg_url: str,
    pg_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    options: str | None,
    environ: dict[str, str],
    expected: str,
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    params = {k: v for k, v in conninfo_to_dict(pg_url).items() if k != "options"}
    if options is not None:
        params["options"] = options
    store = PostgresStore(make_conninfo(**params), schema=pg_schema)
    try:
        store.migrate()
        assert _session_zone(store) == expected
        if "statement_timeout" in (options or "") + environ.get("PGOPTIONS", ""):
            with store.transaction() as conn:
                assert conn.execute("SHOW statement_timeout").fetchone() == ("5s",)
    finally:
        store.close()


def test_an_apps_pool_keeps_its_sessions_zone(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any]
) -> None:
    zone = admin.execute("SHOW TimeZone").fetchone()
    with ConnectionPool(
        pg_url, min_size=1, max_size=1, open=True, kwargs={"options": "-c TimeZone=Asia/Tokyo"}
    ) as pool:
        store = PostgresStore(pool, schema=pg_schema)
        store.migrate()
        assert _session_zone(store) == "Asia/Tokyo"
        store.close()
    assert admin.execute("SHOW TimeZone").fetchone() == zone


def test_an_upgrade_to_version_6_keeps_the_rows_and_starts_each_errors_list_empty(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rows version 5 left (a dead letter among them) keep their last error; the list of
    # errors by attempt begins with the first failure after the upgrade.
    import outboxkit_pg.store as pg_store_module

    clock = FrozenClock(datetime(2030, 1, 1, tzinfo=UTC))
    bus = EventBus()

    @bus.handler("t", name="h")
    def h(event: Any, ctx: Any) -> None:
        raise RuntimeError(f"down {event.attempts}")

    with monkeypatch.context() as patch:
        patch.setattr(pg_store_module, "SCHEMA_VERSION", 5)
        patch.setattr(pg_store_module, "MIGRATIONS", pg_store_module.MIGRATIONS[:5])
        old = PostgresStore(pg_url, schema=pg_schema)
        try:
            assert old.migrate().after == 5
            outbox = Outbox(old, bus, clock=clock, max_retries=0, load_entry_points=False)
            with old.transaction() as tx:
                dead, later = outbox.enqueue_many(tx, [("t", 1), ("t", 2)])
                tx.execute(  # dead as version 5 left it: its last error only
                    sql.SQL(
                        "UPDATE {} SET attempts = 1, failed_at = now(), last_error = %s"
                        " WHERE id = %s"
                    ).format(sql.Identifier(pg_schema, "outbox_events")),
                    ("h: RuntimeError: down 1", dead),
                )
        finally:
            old.close()
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        migration = store.migrate()
        assert (migration.before, migration.after) == (5, SCHEMA_VERSION)
        outbox = Outbox(store, bus, clock=clock, max_retries=0, load_entry_points=False)
        event = store.get(dead)
        assert event is not None and event.last_error == "h: RuntimeError: down 1"
        assert outbox.attempt_errors(dead) == []  # failed before the list was kept
        outbox.poller().run_once()
        (error,) = outbox.attempt_errors(later)
        assert (error.attempt, error.at, error.error) == (1, clock.now(), "h: RuntimeError: down 1")
    finally:
        store.close()
