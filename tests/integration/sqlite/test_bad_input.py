"""The SQLite store's refusals: clear errors, raised before any write."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    HandlerCrashed,
    InvalidEvent,
    Outbox,
    SchemaError,
    StoreError,
    StoreUnavailable,
    open_store,
)
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one
from outboxkit_sqlite import SQLiteStore, schema
from outboxkit_sqlite.tables import TableNames

LEASE = timedelta(seconds=30)

# -- opening --------------------------------------------------------------------------------------


def test_missing_directory_is_named_at_open(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "dir" / "app.db"
    with pytest.raises(ConfigurationError, match="does not exist") as info:
        open_store(f"sqlite:///{path}")
    assert str(path) in str(info.value)
    assert not path.parent.exists()


OPEN_SCRIPT = """
import sys
from outboxkit import open_store
try:
    open_store(sys.argv[1]).close()
except Exception as exc:
    print(type(exc).__name__, exc, sep=": ")
else:
    print("opened")
"""


def open_without_privileges(url: str) -> str:
    """Open ``url`` in a child process that file permissions apply to, even when we are root."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv is missing: cannot drop CAP_DAC_OVERRIDE")
        # Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH obeys the file mode bits.
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    result = subprocess.run(
        [*prefix, sys.executable, "-c", OPEN_SCRIPT, url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def existing_db(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "app.db"
    SQLiteStore(path).close()
    yield path
    path.chmod(0o644)
    path.parent.chmod(0o755)


def test_read_only_database_file_is_named_at_open(existing_db: Path) -> None:
    existing_db.chmod(0o444)
    out = open_without_privileges(f"sqlite:///{existing_db}")
    assert out.startswith("ConfigurationError: ")
    assert str(existing_db) in out and "read-only" in out


def test_read_only_directory_is_named_at_open(existing_db: Path) -> None:
    existing_db.parent.chmod(0o555)
    out = open_without_privileges(f"sqlite:///{existing_db}")
    assert out.startswith("ConfigurationError: ")
    assert str(existing_db.parent) in out and "not writable" in out


def test_writable_database_opens_without_privileges(existing_db: Path) -> None:
    # The check above is the permission, not the unprivileged child itself.
    existing_db.parent.chmod(0o755)
    assert open_without_privileges(f"sqlite:///{existing_db}") == "opened"


def test_a_file_that_is_not_a_database_is_named_at_open(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a database, just some text long enough to fill a header " * 20)
    with pytest.raises(ConfigurationError) as info:
        SQLiteStore(path)
    assert str(path) in str(info.value)


def test_a_directory_is_not_a_database(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="is a directory"):
        SQLiteStore(tmp_path)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://relative.db",  # two slashes: a host, not a path
        "sqlite:///",
        "sqlite:///app.db?mode=ro",
        "sqlite://host/app.db",
        "postgresql:///app.db",
    ],
)
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        SQLiteStore.from_url(url)


def test_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with open_store("sqlite:///relative.db") as relative:
        assert relative.path == tmp_path / "relative.db"
        assert "multiprocess" in relative.capabilities
        # The URL a worker process reopens is absolute: four slashes.
        assert relative.url == f"sqlite:///{tmp_path / 'relative.db'}"
        assert relative.url.startswith("sqlite:////")
    with open_store(f"sqlite:///{tmp_path / 'absolute.db'}") as absolute:
        assert absolute.path == tmp_path / "absolute.db"
    with open_store("sqlite://:memory:") as memory:
        assert memory.path is None
        assert "multiprocess" not in memory.capabilities
    assert sorted(p.name for p in tmp_path.glob("*.db")) == ["absolute.db", "relative.db"]


@pytest.mark.parametrize(
    "options",
    [
        {"unknown_option": 1},
        {"busy_timeout": -1},
        {"busy_timeout": float("nan")},
        {"busy_timeout": "5"},
        {"busy_timeout": True},
    ],
)
def test_bad_options_are_refused(tmp_path: Path, options: dict[str, Any]) -> None:
    path = tmp_path / "app.db"
    with pytest.raises(ConfigurationError):
        open_store(f"sqlite:///{path}", **options)
    assert not path.exists()


# -- table names ----------------------------------------------------------------------------------

HOSTILE = [
    'outbox"; DROP TABLE orders; --',
    "orders; DELETE FROM orders",
    "1events",
    "events table",
    "événements",
    "x" * 64,
    "",
    "outbox_events\n",
    42,
]


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("option", ["events_table", "deliveries_table", "schema_table"])
def test_hostile_table_names_are_refused_before_anything_is_opened(
    tmp_path: Path, option: str, name: object
) -> None:
    path = tmp_path / "app.db"
    with pytest.raises(ConfigurationError, match=option):
        options: dict[str, Any] = {option: name}
        open_store(f"sqlite:///{path}", **options)
    assert not path.exists()


@pytest.mark.parametrize("prefix", ['x"', "1", "a-b_", "x" * 60])
def test_hostile_table_prefixes_are_refused(tmp_path: Path, prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="table_prefix"):
        SQLiteStore(tmp_path / "app.db", table_prefix=prefix)


def test_table_names_must_differ(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="must differ"):
        SQLiteStore(tmp_path / "app.db", events_table="t", deliveries_table="t")


def test_custom_table_names_are_used(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with SQLiteStore(path, table_prefix="app_outbox_", schema_table="app_outbox_version") as store:
        with store.transaction() as conn:
            store.enqueue(conn, [], now=None)
        clock = FrozenClock()
        outbox = Outbox(store, EventBus(), clock=clock)
        with store.transaction() as conn:
            outbox.enqueue(conn, "t", {"n": 1})
        assert store.stats(now=clock.now()).pending == 1
        assert store.options["events_table"] == "app_outbox_events"
    with closing(sqlite3.connect(path)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"app_outbox_events", "app_outbox_deliveries", "app_outbox_version"} <= tables
    assert "outbox_events" not in tables


# -- payloads -------------------------------------------------------------------------------------


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[SQLiteStore, Outbox, sqlite3.Connection]]:
    path = tmp_path / "app.db"
    with SQLiteStore(path) as store, closing(sqlite3.connect(path)) as conn:
        yield store, Outbox(store, EventBus(), clock=FrozenClock()), conn


@pytest.mark.parametrize(
    "payload",
    [{1, 2}, object(), {"x": float("nan")}, {"x": float("inf")}, b"bytes", {1: "int key"}],
    ids=["set", "object", "nan", "inf", "bytes", "int-key"],
)
def test_non_json_payload_raises_before_any_write(
    app: tuple[SQLiteStore, Outbox, sqlite3.Connection], payload: object
) -> None:
    store, outbox, conn = app
    with pytest.raises(InvalidEvent):
        outbox.enqueue(conn, "t", payload)
    # No statement ran: Python's default handling would have opened a transaction for it.
    assert conn.total_changes == 0
    assert not conn.in_transaction
    with pytest.raises(InvalidEvent, match="event #1"):
        outbox.enqueue_many(conn, [("t", 1), ("t", payload), ("t", 3)])
    assert conn.total_changes == 0
    with conn:  # the connection is still usable: a good event commits
        outbox.enqueue(conn, "t", {"ok": True})
    assert store.stats(now=None).total == 1


# -- schema versions ------------------------------------------------------------------------------


def test_newer_schema_is_refused_naming_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    SQLiteStore(path).close()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("INSERT INTO outbox_schema (version, applied_at) VALUES (99, 0)")
    for migrate in (True, False):
        with pytest.raises(SchemaError) as info:
            SQLiteStore(path, migrate=migrate)
        message = str(info.value)
        assert "99" in message and str(schema.SCHEMA_VERSION) in message and str(path) in message


def test_older_schema_is_migrated_keeping_its_events(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    tables = TableNames()
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        schema.migrate(conn, tables, applied_at=0, where=str(path), target=1)
        conn.execute(
            "INSERT INTO outbox_events (topic, payload, headers, created_at, available_at)"
            " VALUES ('t', '{\"n\": 1}', '{}', 0, 0)"
        )
        conn.execute("COMMIT")
        assert schema.current_version(conn, tables) == 1
    with SQLiteStore(path, migrate=False) as store:  # an older schema opens; migrate() upgrades
        store.migrate()
        store.migrate()  # idempotent
    with SQLiteStore(path) as store:
        (claim,) = store.claim(batch_size=10, lease=LEASE, now=None)
        assert claim.event.payload == {"n": 1}
    with closing(sqlite3.connect(path)) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM outbox_schema ORDER BY 1")]
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert versions == list(range(1, schema.SCHEMA_VERSION + 1))
    assert "outbox_events_due" in indexes
    assert "outbox_events_token" not in indexes  # version 3 dropped it


def test_missing_schema_with_migrate_false_is_a_schema_error(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "app.db", migrate=False) as store:
        with pytest.raises(SchemaError, match="migrate"):
            store.stats(now=None)
        store.migrate()
        assert store.stats(now=None).total == 0


def test_clashing_tables_are_a_schema_error(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE outbox_events (id INTEGER PRIMARY KEY)")
    with pytest.raises(SchemaError, match="table_prefix"):
        SQLiteStore(path)


def test_purged_ids_are_never_reused(tmp_path: Path) -> None:
    clock = FrozenClock()
    with SQLiteStore(tmp_path / "app.db") as store:
        outbox = Outbox(store, EventBus(), clock=clock)
        with store.transaction() as conn:
            first = outbox.enqueue_many(conn, [("t", 1), ("t", 2)])
        for claim in store.claim(batch_size=10, lease=LEASE, now=clock.now()):
            settle_one(store, claim, Publish(), error=None, now=clock.now())
        assert store.purge_published(before=clock.advance(1), limit=10) == 2
        with store.transaction() as conn:
            (again,) = outbox.enqueue_many(conn, [("t", 3)])
        assert again > max(first)


# -- handlers that misuse their connection --------------------------------------------------------


@pytest.mark.parametrize("how", ["commit", "rollback", "execute-commit", "close"])
def test_a_handler_cannot_end_its_delivery_transaction(tmp_path: Path, how: str) -> None:
    clock = FrozenClock()
    bus = EventBus()
    broken = [True]

    @bus.handler("t", name="ledger")
    def ledger(event: Event, ctx: Any) -> None:
        conn = ctx.connection
        conn.execute("INSERT INTO ledger (event_id) VALUES (?)", (event.id,))
        if broken[0]:
            if how == "commit":
                conn.commit()
            elif how == "rollback":
                conn.rollback()
            elif how == "execute-commit":
                conn.execute("COMMIT")
            else:
                conn.close()

    path = tmp_path / "app.db"
    with SQLiteStore(path) as store:
        with store.transaction() as conn:
            conn.execute("CREATE TABLE ledger (event_id INTEGER PRIMARY KEY)")
        outbox = Outbox(store, bus, clock=clock)
        with store.transaction() as conn:
            event_id = outbox.enqueue(conn, "t", {})
        report = outbox.poller().run_once()
        (delivery,) = report.deliveries
        assert delivery.outcome.name == "FAILED"
        assert "HandlerCrashed" in (delivery.error or "")
        assert report.retried == [event_id]
        with closing(sqlite3.connect(path)) as check:
            assert check.execute("SELECT count(*) FROM ledger").fetchone() == (0,)
        broken[0] = False
        clock.advance(1)
        assert outbox.poller().run_once().published == [event_id]
        with closing(sqlite3.connect(path)) as check:
            assert check.execute("SELECT count(*) FROM ledger").fetchone() == (1,)


# -- driver errors are mapped at the boundary -----------------------------------------------------


def test_a_lock_held_past_busy_timeout_is_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with (
        SQLiteStore(path, busy_timeout=0.05) as store,
        closing(sqlite3.connect(path, isolation_level=None)) as other,
    ):
        other.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        with pytest.raises(StoreUnavailable, match="locked") as info:
            store.claim(batch_size=10, lease=LEASE, now=None)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        assert str(path) in str(info.value)
        assert store.stats(now=None).total == 0  # reads are not blocked (WAL)
        other.execute("ROLLBACK")
        assert store.claim(batch_size=10, lease=LEASE, now=None) == []


def test_a_closed_store_says_so(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "app.db")
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.stats(now=None)


def test_only_the_store_ends_its_own_transactions(tmp_path: Path) -> None:
    # Even after the app's COMMIT text was tried on a store connection, a handler's COMMIT on
    # that connection is refused (no prepared statement is reused past the guard).
    clock = FrozenClock()
    bus = EventBus()
    tried: list[str] = []

    @bus.handler("t", name="h")
    def handler(event: Event, ctx: Any) -> None:
        for statement in ("COMMIT", "ROLLBACK", "END", "BEGIN"):
            with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
                ctx.connection.execute(statement)
            tried.append(statement)
        ctx.connection.execute("SAVEPOINT inner")  # savepoints are the handler's own
        ctx.connection.execute("RELEASE inner")

    with SQLiteStore(tmp_path / "app.db") as store:
        with store.transaction() as conn:
            with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
                conn.execute("COMMIT")
            with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
                conn.commit()
            event_id = Outbox(store, bus, clock=clock).enqueue(conn, "t", {})
        report = Outbox(store, bus, clock=clock).poller().run_once()
    # R17: the attempts were refused, and the delivery fails all the same (the handler went
    # on as if its transaction had ended): nothing of it commits, it runs again.
    (delivery,) = report.deliveries
    assert isinstance(delivery.exception, HandlerCrashed)
    assert report.retried == [event_id]
    assert tried == ["COMMIT", "ROLLBACK", "END", "BEGIN"]


def test_an_upgrade_to_version_7_starts_each_errors_list_empty_and_keeps_the_last_error(
    tmp_path: Path,
) -> None:
    # A dead letter version 6 left keeps its last error; the list of errors by attempt begins
    # with the first failure after the upgrade.
    from outboxkit import EventBus, FrozenClock, Outbox
    from outboxkit_sqlite import SQLiteStore
    from outboxkit_sqlite.tables import TableNames

    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        schema.migrate(conn, TableNames(), applied_at=0, where=str(path), target=6)
        conn.execute(
            "INSERT INTO outbox_events (topic, payload, headers, created_at, available_at,"
            " attempts, failed_at, last_error) VALUES ('t', '1', '{}', 0, 0, 1, 0, ?)",
            ("h: RuntimeError: down 1",),
        )
        conn.execute("COMMIT")
    clock = FrozenClock("2030-01-01T00:00:00Z")
    bus = EventBus()

    @bus.handler("t", name="h")
    def h(event: object, ctx: object) -> None:
        raise RuntimeError("down again")

    with SQLiteStore(path) as store:  # migrates to the current version
        outbox = Outbox(store, bus, clock=clock, max_retries=0, load_entry_points=False)
        (dead,) = [letter.event.id for letter in store.dead_letters()]
        assert outbox.attempt_errors(dead) == []
        with store.transaction() as tx:
            later = outbox.enqueue(tx, "t", 2)
        outbox.poller().run_once()
        (error,) = outbox.attempt_errors(later)
        assert (error.attempt, error.at, error.error) == (
            1,
            clock.now(),
            "h: RuntimeError: down again",
        )
